"""Concurrent callers on one chat model: throughput, latency and exactness (default model, CPU).

For 1, 4 and 8 concurrent callers (threads sharing one ``GeometryChatModel``), with and
without geometry capture, asks the same short questions (greedy, ``max_new_tokens`` 24) and
reports answers/s and p50/p95 latency per call. One caller is "one at a time"; every answer
of the concurrent runs is compared with that caller's answer to the same question: token
ids, logprobs and geometry must be bitwise identical (the max |difference| is printed too).

Both decode modes of the scheduler are measured, each on its own loaded model:
``batch_decode=True`` (concurrent callers share each decode step; on a CPU whose BLAS makes
rows batch-dependent with several threads, steps run on one thread and a lone call pays for 4
rows) and the default (every row decoded alone: lowest solo latency, no concurrency gain on
such a CPU). The last line printed is one JSON object (top level: ``batch_decode``, capture
on)::

    {"throughput_ratio_4", "throughput_ratio_8", "p95_latency_s_8", "identical_to_solo",
     "solo_answers_per_s", "no_capture": {same keys},
     "rows_alone": {same keys, "no_capture": {...}}}

(ratios = concurrent answers/s / one-at-a-time answers/s of the same mode;
``identical_to_solo`` covers every run.)

Run: ``nice -n 5 .venv/bin/python experiments/concurrency/concurrency.py [--questions 16]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
from langchain_core.messages import AIMessage

from abstain_guard.adapters import GeometryChatModel, load_default_model

QUESTIONS = (
    "What is the capital of France?",
    "Who wrote Hamlet?",
    "What is 2+2?",
    "What is the largest planet in the solar system?",
    "What is the chemical symbol for gold?",
    "Who painted the Mona Lisa?",
    "What is the boiling point of water in Celsius?",
    "How many continents are there?",
    "What is the capital of Japan?",
    "Who discovered penicillin?",
    "What is the square root of 81?",
    "Which ocean is the largest?",
    "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?",
    "Who was the first president of the United States?",
    "What gas do plants absorb from the air?",
)
CONCURRENCY = (1, 4, 8)


def _percentile(values: list[float], q: float) -> float:
    """The q-th percentile (linear interpolation) of ``values``."""
    return float(np.percentile(np.asarray(values), q))


def _timed_invoke(
    model: GeometryChatModel, question: str, capture: bool
) -> tuple[AIMessage, float]:
    """One call and its latency in seconds."""
    t0 = time.perf_counter()
    msg = model.invoke(question, capture_geometry=capture)
    return msg, time.perf_counter() - t0


def run_callers(
    model: GeometryChatModel, questions: list[str], callers: int, capture: bool
) -> dict[str, Any]:
    """Ask ``questions`` from ``callers`` threads (each takes the next question when done)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=callers) as pool:
        results = list(pool.map(lambda q: _timed_invoke(model, q, capture), questions))
    wall = time.perf_counter() - t0
    latencies = [lat for _, lat in results]
    return {
        "messages": [m for m, _ in results],
        "answers_per_s": len(questions) / wall,
        "p50_latency_s": statistics.median(latencies),
        "p95_latency_s": _percentile(latencies, 95),
        "wall_s": wall,
    }


def _arrays(msg: AIMessage) -> dict[str, np.ndarray]:
    """Logprobs and geometry of one answer as arrays (empty where absent)."""
    meta = msg.response_metadata
    out = {"logprob": np.asarray([c["logprob"] for c in meta["logprobs"]["content"]])}
    geo = meta.get("geometry") or {}
    for key in ("omega", "theta", "phi_in", "phi_out"):
        if geo.get(key) is not None:
            out[key] = np.asarray(geo[key], dtype=np.float64)
    return out


def compare(solo: list[AIMessage], other: list[AIMessage]) -> tuple[bool, float]:
    """Whether every answer equals its solo answer exactly, and the max |difference| of
    logprobs and geometry features over the answers with the same tokens."""
    identical = True
    worst = 0.0
    for a, b in zip(solo, other, strict=True):
        ma, mb = a.response_metadata, b.response_metadata
        if ma["token_ids"] != mb["token_ids"] or a.content != b.content:
            identical = False
            continue
        xa, xb = _arrays(a), _arrays(b)
        if xa.keys() != xb.keys():
            identical = False
            continue
        for key, va in xa.items():
            if va.size:
                worst = max(worst, float(np.max(np.abs(va - xb[key]))))
        if ma["logprobs"] != mb["logprobs"] or ma.get("geometry") != mb.get("geometry"):
            identical = False
    return identical and worst == 0.0, worst


def bench_mode(model: GeometryChatModel, questions: list[str], capture: bool) -> dict[str, Any]:
    """Throughput and latency at each concurrency, and exactness against one at a time."""
    model.invoke(questions[0], capture_geometry=capture)  # warm-up
    runs = {c: run_callers(model, questions, c, capture) for c in CONCURRENCY}
    solo = runs[1]
    identical = True
    worst = 0.0
    for c in CONCURRENCY:
        same, diff = compare(solo["messages"], runs[c]["messages"])
        identical = identical and same
        worst = max(worst, diff)
        print(
            f"capture={capture!s:5} callers={c}: {runs[c]['answers_per_s']:.3f} answers/s, "
            f"p50 {runs[c]['p50_latency_s']:.2f} s, p95 {runs[c]['p95_latency_s']:.2f} s, "
            f"wall {runs[c]['wall_s']:.1f} s, identical to solo: {same} (max |diff| {diff:.3g})",
            flush=True,
        )
    base = solo["answers_per_s"]
    return {
        "throughput_ratio_4": round(runs[4]["answers_per_s"] / base, 3),
        "throughput_ratio_8": round(runs[8]["answers_per_s"] / base, 3),
        "p95_latency_s_8": round(runs[8]["p95_latency_s"], 3),
        "identical_to_solo": identical,
        "max_abs_diff": worst,
        "solo_answers_per_s": round(base, 3),
        "solo_p50_latency_s": round(solo["p50_latency_s"], 3),
    }


def bench_decode_mode(questions: list[str], batch_decode: bool) -> dict[str, Any]:
    """Both capture settings on a model loaded with ``batch_decode``."""
    print(f"-- batch_decode={batch_decode}", flush=True)
    model = load_default_model(max_new_tokens=24, batch_decode=batch_decode)
    captured = bench_mode(model, questions, capture=True)
    plain = bench_mode(model, questions, capture=False)
    keys = ("throughput_ratio_4", "throughput_ratio_8", "p95_latency_s_8")
    return {
        **{k: captured[k] for k in keys},
        "identical_to_solo": bool(captured["identical_to_solo"] and plain["identical_to_solo"]),
        "max_abs_diff": max(captured["max_abs_diff"], plain["max_abs_diff"]),
        "solo_answers_per_s": captured["solo_answers_per_s"],
        "solo_p50_latency_s": captured["solo_p50_latency_s"],
        "no_capture": {k: v for k, v in plain.items() if k != "max_abs_diff"},
    }


def main() -> None:
    """Run both decode modes and print the summary JSON as the last line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=16, help="questions per run")
    args = parser.parse_args()
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.questions)]
    batched = bench_decode_mode(questions, batch_decode=True)
    alone = bench_decode_mode(questions, batch_decode=False)
    summary = {
        **batched,
        "identical_to_solo": bool(batched["identical_to_solo"] and alone["identical_to_solo"]),
        "rows_alone": alone,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
