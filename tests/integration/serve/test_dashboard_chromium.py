"""``GET /dashboard`` (abstain_guard/serve/app.py) rendered by headless Chromium
(Debian's ``chromium``, installed by ``make install``): a real guarded server over a
scripted model answers confident, unsure and unscorable questions, and the figures the
page's own script draws equal what the server reports in ``/v1/monitor`` (participation, the
drift e-value, its threshold, the alarms) and ``/metrics`` (chat completions by reason)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
from _serve_fakes import CONFIDENT, UNSURE, ToolScriptModel, artifact
from langchain_core.messages import AIMessage, BaseMessage

from abstain_guard import GuardConfig
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.serve.runner import ServerThread
from abstain_guard.serve.service import GuardService

#: Questions about Peru are answered, about Chile withheld on their score, about Mars
#: withheld unscored (the reply has no logprobs: scoring fails).
QUESTIONS = ["Peru"] * 12 + ["Chile"] * 20 + ["Mars"] * 3 + ["Peru"] * 5


class MixedModel(ToolScriptModel):
    """:class:`ToolScriptModel` answering ``"Lima"``: confident about Peru, unsure about
    Chile, and without logprobs about Mars."""

    def _reply(self, messages: list[BaseMessage], tools: Any) -> AIMessage:
        unsure = "Chile" in str(messages[-1].content)
        return AIMessage(content="Lima", response_metadata={"lp": UNSURE if unsure else CONFIDENT})

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> Any:
        result = super()._generate(messages, *args, **kwargs)
        if "Mars" in str(messages[-1].content):
            result.generations[0].message.response_metadata.pop("logprobs")
        return result


class Figures(HTMLParser):
    """The rendered DOM's figures: ``data-value`` by element id, ``data-count`` by
    ``data-reason``, the ``data-series`` names of the lines drawn, and ``data-rendered``."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.reasons: dict[str, int] = {}
        self.lines: list[str] = []
        self.rendered = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if "data-value" in a and a.get("id"):
            self.values[str(a["id"])] = str(a["data-value"])
        if "data-reason" in a:
            self.reasons[str(a["data-reason"])] = int(str(a["data-count"]))
        if tag == "polyline" and a.get("data-series"):
            self.lines.append(str(a["data-series"]))
        self.rendered |= tag == "body" and a.get("data-rendered") == "true"


def chromium_dom(url: str, profile: Path) -> str:
    """The DOM of ``url`` after its scripts ran, as headless Chromium serializes it."""
    binary = shutil.which("chromium")
    if binary is None:
        pytest.fail("Chromium is missing: `make install` installs it (Debian's chromium).")
    args = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}"]
    done = subprocess.run(
        [binary, *args, "--dump-dom", url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _served_counts(metrics: str) -> dict[str, int]:
    """``abstain_guard_chat_completions_total`` by ``outcome · reason``."""
    pattern = r'abstain_guard_chat_completions_total\{outcome="(\w+)",reason="(\w+)"\} (\S+)'
    return {f"{o} · {r}": int(float(v)) for o, r, v in re.findall(pattern, metrics)}


def test_the_dashboard_draws_what_the_monitor_and_metrics_report(tmp_path: Path) -> None:
    service = GuardService.from_artifact(
        artifact(), GuardConfig(participation=0.8), model=MixedModel()
    )
    monitor = GuardMonitor(seed=0).fit_artifact(service.guard.artifact, service.guard.config)
    with ServerThread(service, monitor=monitor) as server:
        for country in QUESTIONS:
            ask = [{"role": "user", "content": f"What is the capital of {country}?"}]
            reply = httpx.post(f"{server.base_url}/chat/completions", json={"messages": ask})
            assert reply.status_code == 200, reply.text
        root = server.base_url[: -len("/v1")]
        dom = chromium_dom(f"{root}/dashboard", tmp_path / "profile")
        state = httpx.get(f"{server.base_url}/monitor").json()
        served = _served_counts(httpx.get(f"{root}/metrics").text)

    page = Figures()
    page.feed(dom)
    assert page.rendered, dom[-2000:]  # the page's script ran to its end
    assert int(page.values["decisions"]) == state["decisions"] == len(QUESTIONS)
    assert int(page.values["answered"]) == state["answered"] == 17
    assert float(page.values["participation"]) == state["answered_rate"]
    exchangeability = state["tests"]["exchangeability"]
    assert float(page.values["e-value-all"]) == exchangeability["e_value"]
    assert float(page.values["threshold"]) == exchangeability["threshold"]
    assert int(page.values["alarm-count"]) == len(state["alarms"]) > 0
    assert float(page.values["target"]) == 0.8
    assert served == {"answered · score": 17, "abstained · score": 20,
                      "abstained · scoring_error": 3}  # fmt: skip
    assert page.reasons == {
        "answered · score": served["answered · score"],
        "abstained · score": served["abstained · score"],
        "abstained · unscored": served["abstained · scoring_error"],
    }
    assert state["unscored"] == 3
    assert page.lines == ["all decisions", "last 100", "all"]  # participation and drift drawn
