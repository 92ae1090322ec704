"""The guard's metrics and alert rules under a real Prometheus (Debian's ``prometheus``
package: ``/usr/bin/prometheus`` and ``promtool``, which ``make install`` installs):
promtool accepts deploy/prometheus/abstain_guard.rules.yml and passes its unit tests, and
Prometheus scrapes a guarded server (the shipped guard on the embedded model), its query
API shows the decision counters and ``build_info``, and it evaluates the rules on them."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from abstain_guard import GuardArtifact, GuardConfig, default_artifact_path
from abstain_guard.serve.runner import ServerThread, free_port
from abstain_guard.serve.service import GuardService

RULES = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"
JOB = "abstain-guard"


def _tool(name: str) -> str:
    """The path of Prometheus's ``name``; a failure (not a skip) when it is missing."""
    found = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if found is None:
        pytest.fail(
            f"{name} is not installed: `make install` installs it (Debian's prometheus "
            "package, apt-get install prometheus).",
            pytrace=False,
        )
    return found


def test_promtool_accepts_the_rules_and_their_unit_tests() -> None:
    promtool = _tool("promtool")
    for args in (
        ["check", "rules", "abstain_guard.rules.yml"],
        ["test", "rules", "abstain_guard.rules.test.yml"],
    ):
        done = subprocess.run([promtool, *args], cwd=RULES, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


@pytest.fixture(scope="module")
def guarded(default_model: Any) -> Iterator[ServerThread]:
    service = GuardService.from_artifact(
        default_artifact_path(), GuardConfig(participation=0.8), model=default_model
    )
    with ServerThread(service) as server:
        yield server


@pytest.fixture
def prometheus(guarded: ServerThread, tmp_path: Path) -> Iterator[str]:
    """A Prometheus scraping ``guarded`` every second with the guard's rules; its URL."""
    binary = _tool("prometheus")
    target = guarded.base_url.removeprefix("http://").removesuffix("/v1")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{RULES / 'abstain_guard.rules.yml'}]\n"
        f"scrape_configs: [{{job_name: {JOB}, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _get(f"{url}/-/ready") is not None, "Prometheus to start", proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _get(url: str, **params: str) -> Any:
    """The JSON ``url`` answers with 200 (``{}`` for a body that is none), else None."""
    try:
        response = httpx.get(url, params=params, timeout=5)
    except httpx.TransportError:
        return None
    if response.status_code != 200:
        return None
    return response.json() if "json" in response.headers.get("content-type", "") else {}


def _until(ready: Callable[[], Any], what: str, proc: Any = None) -> Any:
    """``ready()``'s first true value, polled for at most 60 s (and while ``proc`` runs)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {proc.stderr.read().decode()[-2000:]}")
        found = ready()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"waited 60 s for {what}")


def _query(url: str, query: str) -> dict[str, Any]:
    """``query``'s instant vector as ``{label values joined by ",": value}``."""
    found = _get(f"{url}/api/v1/query", query=query) or {}
    rows = (found.get("data") or {}).get("result") or []
    return {",".join(r["metric"].values()): float(r["value"][1]) for r in rows}


def test_prometheus_scrapes_the_decisions_and_evaluates_the_rules(
    guarded: ServerThread, prometheus: str
) -> None:
    completions = f"{guarded.base_url}/chat/completions"
    for question in ("What is the capital of France?", "What is the currency of Japan?"):
        ask = {"messages": [{"role": "user", "content": question}]}
        assert httpx.post(completions, json=ask, timeout=120).status_code == 200
    refused = httpx.post(completions, json={**ask, "max_tokens": 64}, timeout=30)
    assert refused.status_code == 400
    by_outcome = f'sum by (outcome) (abstain_guard_chat_completions_total{{job="{JOB}"}})'

    def scraped() -> dict[str, float] | None:
        seen = _query(prometheus, by_outcome)
        decided = seen.get("answered", 0) + seen.get("abstained", 0)
        return seen if decided == 2 and seen.get("refused") == 1 else None

    _until(scraped, "the decisions in Prometheus")
    reasons = _query(prometheus, 'abstain_guard_chat_completions_total{outcome="refused"}')
    assert any("max_tokens_not_calibrated" in key for key in reasons)
    digest = GuardArtifact.load(default_artifact_path()).digest
    build = _query(prometheus, f'abstain_guard_build_info{{artifact_sha256="{digest}"}}')
    assert list(build.values()) == [1.0]
    assert list(_query(prometheus, "abstain_guard_monitor_up").values()) == [1.0]
    assert list(_query(prometheus, "abstain_guard_monitor_decisions_total").values()) == [2.0]

    def evaluated() -> list[dict[str, Any]] | None:
        groups = (_get(f"{prometheus}/api/v1/rules") or {}).get("data") or {}
        rules = [r for g in groups.get("groups", []) for r in g["rules"]]
        done = all(not r["lastEvaluation"].startswith("0001") for r in rules)
        recorded = _query(prometheus, "job:abstain_guard_decisions:increase1h")
        return rules if rules and done and recorded else None

    rules = _until(evaluated, "the rules to evaluate on the scraped series")
    assert len(rules) == 8 and all(r["health"] == "ok" for r in rules), rules
    assert {r["name"] for r in rules if r["type"] == "alerting"} >= {
        "AbstainGuardParticipationOutsideBand",
        "AbstainGuardDriftAlarm",
        "AbstainGuardErrorRate",
    }
