"""Load test of ``abstain-guard serve`` (the shipped default guard, CPU).

Starts the server in a subprocess on a free loopback port, waits for ``/readyz``, measures
a solo request (the median over the question set, asked one at a time), then drives it with
a bounded asyncio client: ``--requests`` requests, ``--concurrency`` at once, alternating
non-streamed and streamed, every ``--malformed-every``-th one malformed (in turn: a budget
other than the calibrated one, a conversation, a body that is not JSON, no messages). Then it
stops the server with SIGTERM (graceful shutdown) and prints one JSON line::

    {"artifact", "requests", "concurrency", "wall_s", "throughput_rps", "p50_s", "p95_s", "solo_s",
     "p95_over_solo", "solo_range_s", "p95_over_own_solo", "errors": {kind: count},
     "well_formed", "decided",
     "every_well_formed_decided", "malformed", "malformed_all_4xx", "abstained",
     "malformed_statuses", "stopped_early", "decode_path", "server_exit_code",
     "server_stopped_cleanly"}

``decode_path`` is the path the guard is served on (the one its artifact was calibrated on:
the prefix path records ``"prefix"``). With ``--runs N`` (and ``--baseline-artifact``, a second
guard whose runs interleave with the first's: A B A B) the line holds, per guard, the medians
over its runs and every run, and ``guard_over_baseline`` (ratios of the medians).

``p95_over_solo`` is the target's measure (p95 over the median solo latency);
``p95_over_own_solo`` is the p95 of each request's latency over the solo latency of its own
question (answers differ in length, so the first mixes question lengths into the tail).
``errors`` counts well-formed requests that got no decision, by kind (HTTP status or
exception); ``throughput_rps`` counts decided requests per second of the load phase;
latencies are of well-formed requests, from sending to the last byte.

Run: ``flock /tmp/heavy.lock .venv/bin/python bench/serving/serve_load.py --requests 150 --runs 2``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.default import default_artifact_path
from abstain_guard.serve.runner import free_port

QUESTIONS = (
    "What is the capital of France?",
    "What is the capital of Peru?",
    "What is the currency of Japan?",
    "On which continent is Kenya?",
    "What is the chemical symbol of gold?",
    "What is the capital of Canada?",
    "What is the currency of the United Kingdom?",
    "On which continent is Chile?",
    "What is the chemical symbol of sodium?",
    "What is the capital of Australia?",
    "What is the capital of Mongolia?",
    "What is the currency of Switzerland?",
)

MALFORMED: tuple[tuple[str, Any], ...] = (
    ("over_budget", {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 64}),
    (
        "conversation",
        {
            "messages": [
                {"role": "user", "content": QUESTIONS[0]},
                {"role": "assistant", "content": "Paris"},
                {"role": "user", "content": QUESTIONS[1]},
            ]
        },
    ),
    ("not_json", b"{not json"),
    ("no_messages", {"messages": []}),
)


def start_server(port: int, artifact: str | None = None) -> subprocess.Popen[bytes]:
    """``abstain-guard serve`` on ``port`` (``artifact``, default the shipped guard) in a
    subprocess."""
    exe = Path(sys.executable).with_name("abstain-guard")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    extra = [] if artifact is None else ["--artifact", artifact]
    return subprocess.Popen([str(exe), "serve", "--port", str(port), *extra], env=env)


async def wait_ready(client: httpx.AsyncClient, root: str, proc: subprocess.Popen[bytes]) -> None:
    """Poll ``/readyz`` until it answers 200 (the model is loaded before the port opens)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if (await client.get(f"{root}/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("the server was not ready within 300 s")


def _decided_json(response: httpx.Response) -> bool | None:
    """Whether the guard abstained (None: the response carries no decision)."""
    decision = response.json()["choices"][0].get("abstention") or {}
    value = decision.get("abstained")
    return value if isinstance(value, bool) else None


def _decided_sse(text: str) -> bool | None:
    lines = [ln[len("data: ") :] for ln in text.splitlines() if ln.startswith("data: ")]
    if not lines or lines[-1] != "[DONE]":
        return None
    for line in lines[:-1]:
        for choice in json.loads(line).get("choices", []):
            if choice.get("finish_reason") and isinstance(
                (choice.get("abstention") or {}).get("abstained"), bool
            ):
                return bool(choice["abstention"]["abstained"])
    return None


async def well_formed(
    client: httpx.AsyncClient, url: str, question: str, stream: bool
) -> tuple[str, float, bool | None]:
    """One request: (outcome kind, seconds, abstained or None)."""
    body = {"model": "abstain-guard", "messages": [{"role": "user", "content": question}]}
    start = time.perf_counter()
    try:
        if stream:
            async with client.stream("POST", url, json={**body, "stream": True}) as r:
                text = (await r.aread()).decode()
                kind = "ok" if r.status_code == 200 else f"http_{r.status_code}"
                decided = _decided_sse(text) if r.status_code == 200 else None
        else:
            r = await client.post(url, json=body)
            kind = "ok" if r.status_code == 200 else f"http_{r.status_code}"
            decided = _decided_json(r) if r.status_code == 200 else None
    except httpx.HTTPError as exc:
        kind, decided = type(exc).__name__, None
    if kind == "ok" and decided is None:
        kind = "no_decision"
    return kind, time.perf_counter() - start, decided


async def malformed(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, int]:
    """One malformed request: (its kind, the HTTP status)."""
    name, body = MALFORMED[i % len(MALFORMED)]  # i: the count of malformed ones so far
    if isinstance(body, bytes):
        r = await client.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(url, json=body)
    return name, r.status_code


async def load(
    client: httpx.AsyncClient,
    url: str,
    requests: int,
    concurrency: int,
    malformed_every: int = 10,
    deadline_s: float = float("inf"),
) -> tuple[dict[str, Any], list[tuple[str, float, bool | None, str]]]:
    """``requests`` requests, ``concurrency`` at once, plain and streamed in turn, every
    ``malformed_every``-th one malformed, none sent after ``deadline_s``: the load's fields of
    the JSON line, and (kind, seconds, abstained, question) per well-formed request."""
    gate = asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + deadline_s
    results: list[tuple[str, float, bool | None, str]] = []
    bad: list[tuple[str, int]] = []
    skipped = 0

    async def one(i: int) -> None:
        nonlocal skipped
        async with gate:
            if time.monotonic() > deadline:
                skipped += 1
            elif i % malformed_every == malformed_every - 1:
                bad.append(await malformed(client, url, i // malformed_every))
            else:
                question = QUESTIONS[i % len(QUESTIONS)]
                out = await well_formed(client, url, question, stream=i % 2 == 1)
                results.append((*out, question))

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - start
    ok = sorted(t for kind, t, _, _ in results if kind == "ok")
    fields = {
        "requests": requests,
        "concurrency": concurrency,
        "wall_s": round(wall, 2),
        "throughput_rps": round(len(ok) / wall, 3),
        "p50_s": round(statistics.median(ok), 3) if ok else None,
        "p95_s": round(_p95(ok), 3),
        "errors": dict(Counter(kind for kind, _, _, _ in results if kind != "ok")),
        "well_formed": len(results),
        "decided": len(ok),
        "every_well_formed_decided": len(ok) == len(results),
        "abstained": sum(1 for kind, _, a, _ in results if kind == "ok" and a),
        "malformed": len(bad),
        "malformed_all_4xx": all(400 <= status < 500 for _, status in bad),
        "malformed_statuses": dict(Counter(f"{n}:{s}" for n, s in bad)),
        "stopped_early": skipped,
    }
    return fields, results


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(0.95 * len(ordered)) - 1)] if ordered else float("nan")


async def drive(args: argparse.Namespace, root: str, client: httpx.AsyncClient) -> dict[str, Any]:
    """Solo latency, then the bounded load; the measurements."""
    url = f"{root}/v1/chat/completions"
    solos = {q: (await well_formed(client, url, q, False))[1] for q in QUESTIONS}
    out, results = await load(
        client, url, args.requests, args.concurrency, args.malformed_every, args.deadline_s
    )
    solo = statistics.median(solos.values())
    p95 = _p95([t for kind, t, _, _ in results if kind == "ok"])
    own = [t / solos[q] for kind, t, _, q in results if kind == "ok"]
    out["solo_s"] = round(solo, 3)
    out["p95_over_solo"] = round(p95 / solo, 2)
    out["solo_range_s"] = [round(min(solos.values()), 3), round(max(solos.values()), 3)]
    out["p95_over_own_solo"] = round(_p95(own), 2)
    return out


def decode_path_of(artifact: str | None) -> dict[str, Any] | None:
    """The decode path the guard is served on: the one its artifact was calibrated on
    (``load_guard_chain`` loads the model on it)."""
    art = GuardArtifact.load(artifact or default_artifact_path())
    record = DeploymentRecord.from_metadata(art.metadata)
    path = record.decoding.get("decode_path") if record is not None else None
    return dict(path) if isinstance(path, dict) else None


async def run_once(args: argparse.Namespace, artifact: str | None) -> dict[str, Any]:
    """One server start, solo latencies, the load and the stop: one run's measurements."""
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    proc = start_server(port, artifact)
    try:
        limits = httpx.Limits(max_connections=args.concurrency + 2)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            await wait_ready(client, root, proc)
            summary = await drive(args, root, client)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    summary["artifact"] = artifact or "default"
    summary["decode_path"] = decode_path_of(artifact)
    summary["server_exit_code"] = code
    # uvicorn re-raises SIGTERM after its graceful shutdown: -15 is a clean stop too.
    summary["server_stopped_cleanly"] = code in (0, -signal.SIGTERM)
    return summary


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("throughput_rps", "p50_s", "p95_s", "solo_s", "p95_over_solo", "p95_over_own_solo")
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """``--runs`` runs of the guard (and, with ``--baseline-artifact``, of the baseline guard,
    interleaved: A B A B); one run's JSON, or the medians with every run."""
    guards: dict[str, str | None] = {"guard": args.artifact}
    if args.baseline_artifact:
        guards["baseline"] = args.baseline_artifact
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in guards}
    for _ in range(args.runs):
        for name, artifact in guards.items():
            runs[name].append(await run_once(args, artifact))
    if args.runs == 1 and len(guards) == 1:
        return runs["guard"][0]
    out: dict[str, Any] = {"requests": args.requests, "concurrency": args.concurrency}
    for name, got in runs.items():
        out[name] = {
            "artifact": got[0]["artifact"],
            "decode_path": got[0]["decode_path"],
            "median": _medians(got),
            "every_well_formed_decided": all(r["every_well_formed_decided"] for r in got),
            "malformed_all_4xx": all(r["malformed_all_4xx"] for r in got),
            "runs": got,
        }
    if "baseline" in out:
        g, b = out["guard"]["median"], out["baseline"]["median"]
        out["guard_over_baseline"] = {
            k: round(g[k] / b[k], 3) for k in ("throughput_rps", "p95_s", "solo_s")
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--artifact",
        default=None,
        help="guard to serve (default: the shipped one); served on the decode path it records",
    )
    parser.add_argument(
        "--baseline-artifact",
        default=None,
        help="a second guard measured in the same invocation, runs interleaved with the first",
    )
    parser.add_argument("--runs", type=int, default=1, help="runs per guard (medians reported)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--malformed-every", type=int, default=10)
    parser.add_argument(
        "--deadline-s", type=float, default=420.0, help="send no new request after this"
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
