"""How often the embedded model answers the built-in probe relations right.

A one-off measurement, not a test. For each chosen relation of the built-in probe set
(``builtin_probe_set()``), ``--n`` questions are sampled, stratified by popularity (the
relation's items sorted by popularity, cut into ``--bins`` equal-count bins, the same number
drawn from each with a seeded generator; a relation with at most ``--n`` items is taken
whole). The embedded model (SmolLM2-135M-Instruct) answers them as calibration does
(``build_messages``, ``max_new_tokens=24``, greedy; batched in chunks of ``--chunk``) and
:class:`LexicalJudge` judges the answers.

Answers are cached in ``--cache`` (JSON, keyed by the question text), so a re-run after an
alias fix only re-judges. ``--details`` writes every judged item (question, gold, answer,
verdict, popularity bin). The last printed line is one JSON object: per relation the number
judged, correct, accuracy and accuracy per popularity bin (least popular first), and the
relation's size in the probe set.

Run: ``OMP_NUM_THREADS=2 nice -n 19 .venv/bin/python experiments/probe_set/probe_accuracy.py
[--relations city_country city_state] [--n 150] [--seed 0] [--cache probe_answers.json]``.

Measured once (2026-11, CPU, 2 threads; ``--n 150`` with ``--seed 0`` and ``--seed 1``, the two
samples pooled by item; about 1 answer per second):

======================  =====  ===============  ========  ===================================
relation                items  judged distinct  accuracy  by popularity bin, seed 0 (low→high)
======================  =====  ===============  ========  ===================================
``city_country``        1656   292              0.30      0.20 0.03 0.23 0.50 0.63
``country_of_capital``  223    199              0.38      0.00 0.07 0.43 0.57 0.83
``city_state``          355    230              0.20      0.23 0.07 0.23 0.23 0.33
``state_capital``       50     50               0.42      0.10 0.60 0.50 0.50 0.40
======================  =====  ===============  ========  ===================================

The first release's relations were measured on the default guard's own calibration run (all
1,077 answers, same judge): 309 right (0.29). Weighted by items the whole set is about 0.29.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from abstain_guard.calibration.building.judges import LexicalJudge
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.questions.probe_relations import RELATIONS
from abstain_guard.contract.prompts import build_messages


def stratified(items: list[QAItem], n: int, bins: int, seed: int) -> list[tuple[int, QAItem]]:
    """``(bin, item)`` for ``n`` items drawn evenly from ``bins`` popularity bins."""
    ordered = sorted(items, key=lambda it: (it.popularity or 0.0, it.id))
    cuts = np.array_split(np.arange(len(ordered)), bins)
    rng = np.random.default_rng(seed)
    out: list[tuple[int, QAItem]] = []
    for b, idx in enumerate(cuts):
        take = len(idx) if len(items) <= n else min(len(idx), round(n / bins))
        for i in sorted(rng.choice(idx, size=take, replace=False)):
            out.append((b, ordered[int(i)]))
    return out


def answer_all(model: Any, items: list[QAItem], cache: dict[str, str], path: Path, chunk: int):
    todo = [it for it in items if it.question not in cache]
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        outs = model.batch([build_messages(it) for it in part])
        for it, msg in zip(part, outs, strict=True):
            cache[it.question] = str(msg.content)
        path.write_text(json.dumps(cache, ensure_ascii=False, indent=0))
        print(f"answered {start + len(part)}/{len(todo)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--relations", nargs="+", default=list(RELATIONS))
    parser.add_argument("--n", type=int, default=150)
    parser.add_argument("--bins", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--cache", default="probe_answers.json")
    parser.add_argument("--details", default=None)
    args = parser.parse_args()

    probe = builtin_probe_set()
    cache_path = Path(args.cache)
    cache: dict[str, str] = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    sample: dict[str, list[tuple[int, QAItem]]] = {}
    for rel in args.relations:
        items = [it for it in probe if it.group == rel]
        sample[rel] = stratified(items, args.n, args.bins, args.seed)
    flat = [it for rows in sample.values() for _, it in rows]
    t = time.perf_counter()
    if any(it.question not in cache for it in flat):
        from abstain_guard.adapters import load_default_model  # torch: only when needed

        model = load_default_model(max_new_tokens=24, capture_geometry=False)
        answer_all(model, flat, cache, cache_path, args.chunk)
    seconds = time.perf_counter() - t

    judge = LexicalJudge()
    result: dict[str, Any] = {}
    details = []
    for rel, rows in sample.items():
        per_bin: dict[int, list[bool]] = {}
        for b, it in rows:
            text = cache[it.question]
            verdict = judge.judge(it.question, it.answers, text)
            ok = bool(verdict.correct)
            per_bin.setdefault(b, []).append(ok)
            details.append(
                {
                    "relation": rel,
                    "bin": b,
                    "id": it.id,
                    "popularity": it.popularity,
                    "question": it.question,
                    "gold": list(it.answers),
                    "answer": text,
                    "correct": ok,
                    "rationale": verdict.rationale,
                }
            )
        correct = sum(sum(v) for v in per_bin.values())
        n = sum(len(v) for v in per_bin.values())
        result[rel] = {
            "size": sum(1 for it in probe if it.group == rel),
            "judged": n,
            "correct": correct,
            "accuracy": round(correct / n, 3) if n else None,
            "accuracy_by_bin": [round(float(np.mean(per_bin[b])), 3) for b in sorted(per_bin)],
        }
    if args.details:
        Path(args.details).write_text(json.dumps(details, ensure_ascii=False, indent=1))
    print(json.dumps({"relations": result, "generate_seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
