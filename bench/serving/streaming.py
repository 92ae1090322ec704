"""Certified streaming vs the buffered guard, printed as JSON.

On a stream-calibrated guard's own held-out questions (its calibration split certifies, its
test split is held out), at the same certified risk target:

* **offline, every chunk rule at once**: each held-out answer is replayed once and its
  metadata read off that pass after every token (``replay_batch(cuts=...)``), scored by the
  artifact's scorer; a rule's prefix scores are those at its chunk ends. Per rule (and for the
  buffered guard: whole answers), the threshold certified on the calibration split at
  ``--risk-target`` / ``--delta`` (the artifact's selection counted: δ/K), and on the test
  split the participation, the error among completed streams (answered questions), the
  partial-release rate and its certified bound, and the tokens generated before the first
  text is released (answered questions);
* **live, the artifact's rule**: ``--timing`` test questions through the deployed guard
  chain, one at a time and 8 at once, certified streaming (the stream artifact) vs buffered
  (the same calibration answers on the whole-answer rule, the same model, prompt and budget:
  time to first text = time to the decision);
  seconds to the first released text and to the decision, and live = stored (each completed
  stream's running maximum against its offline statistic).

    python bench/serving/streaming.py --artifact runs/stream_guard \\
        --rules sentence,clause,tokens:4,tokens:8 --live-rules tokens:8 --timing 24 \\
        --json bench/serving/streaming.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.adapters.engine.kernels import kernel_facts
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.building.answering.answer_rows import GenerationOptions
from abstain_guard.calibration.building.answering.answers import generate_answers, generated_pairs
from abstain_guard.calibration.building.answering.stream_calibration import answer_decoder
from abstain_guard.calibration.building.judges.judging import (
    build_judges,
    judge_answers,
    labeled_items,
    labels,
)
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.building.run.store import RunStore
from abstain_guard.calibration.measure.held_out import artifact_splits
from abstain_guard.contract.deployment import DeploymentRecord, StreamingRecord
from abstain_guard.contract.runnables import find_chat_models
from abstain_guard.contract.streaming import ChunkRule, first_release_statistic, stream_statistic
from abstain_guard.errors import UncertifiableTargetError
from abstain_guard.guarantee.decision import decision_rule
from abstain_guard.guard.chains import load_guard_chain


class Held:
    """The held-out answers (calibration split first, then test) of a calibration run:
    items, whole-answer metadata, labels, and every answer's score after each token."""

    def __init__(self, art: Any, chat: Any, cache_dir: Path, progress: bool = True) -> None:
        cfg = CalibrationConfig(**art.metadata.get("config", {}))
        _, pool, _ = artifact_splits(art)
        store = RunStore(cache_dir / "run.sqlite", read_only=True)
        fingerprint = str(getattr(chat, "fingerprint", "unknown"))
        answers = generate_answers(
            chat,
            pool,
            store,
            cfg,
            fingerprint=fingerprint,
            options=GenerationOptions(batch_size=1, progress=progress),
        )
        judges = build_judges(cfg, cache_dir / "judgments.sqlite")
        verdicts = judge_answers(judges, pool, answers, progress=progress)
        n_cal = len(labeled_items(pool[: len(art.metadata["calibration_ids"])], verdicts))
        self.items = labeled_items(pool, verdicts)
        self.correct = np.array(labels(self.items, verdicts))
        self.n_calibration = n_cal
        pairs = generated_pairs(self.items, answers, cfg)
        cuts = [list(range(1, len(ids))) for _, ids in pairs]
        scoring = art.scorer.prepare(chat)
        t0 = time.perf_counter()  # one forward pass per answer, every cut read off it
        results = scoring.replay_batch(pairs, batch_size=1, cuts=cuts, progress=progress)
        self.replay_seconds = time.perf_counter() - t0
        self.metadata = [r.metadata for r in results]
        self.whole = np.asarray(art.scorer.score_many(self.metadata), dtype=np.float64)
        self.cuts = [
            np.asarray(art.scorer.score_many(r.cuts), dtype=np.float64) if r.cuts else np.zeros(0)
            for r in results
        ]


def _rule_stats(
    rule: ChunkRule | None, held: Held, decode: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(M, F, tokens before the first release)`` per held-out answer under ``rule``
    (None: buffered, whole answers: M = whole score, F = inf, the whole answer first)."""
    m, f, first_t = [], [], []
    for meta, s, c in zip(held.metadata, held.whole, held.cuts, strict=True):
        ids = list(meta["token_ids"])
        ends = [] if rule is None else rule.interior_ends(ids, decode)
        prefix = [float(c[t - 1]) for t in ends]
        m.append(stream_statistic(prefix, float(s)))
        f.append(first_release_statistic(prefix))
        first_t.append(ends[0] if ends else len(ids))
    return np.array(m), np.array(f), np.array(first_t)


def _offline(
    name: str, m: np.ndarray, f: np.ndarray, first_t: np.ndarray, held: Any, art: Any, args: Any
) -> dict[str, Any]:
    n_cal = held.n_calibration
    correct = held.correct
    config = GuardConfig(mode="risk", risk_target=args.risk_target, delta=args.delta)
    try:
        rule = decision_rule(
            m[:n_cal], correct[:n_cal], config, selection=art.selection, stream_first=f[:n_cal]
        )
    except UncertifiableTargetError as exc:
        return {"rule": name, "certified": False, "why": str(exc)}
    tau = rule.threshold
    mt, ft, ct, tt = m[n_cal:], f[n_cal:], correct[n_cal:], first_t[n_cal:]
    answered = mt <= tau
    partial = (ft <= tau) & (mt > tau)
    g = rule.guarantee
    block = g.get("partial_release", {})
    return {
        "rule": name,
        "certified": True,
        "threshold": tau,
        "calibration": {
            "n": int(n_cal),
            "participation": g["calibration_participation"],
            "partial_release_rate": block.get("calibration_rate"),
            "partial_release_certified_bound": block.get("certified_bound"),
            "partial_release_level": block.get("level"),
        },
        "test": {
            "n": int(mt.size),
            "correct": int(ct.sum()),
            "participation": float(answered.mean()),
            "error_among_completed": float((~ct[answered]).mean()) if answered.any() else None,
            "completed": int(answered.sum()),
            "partial_release_rate": float(partial.mean()),
            "partial_releases": int(partial.sum()),
            "partial_release_bound_met": (
                bool(partial.mean() <= block["certified_bound"]) if block else None
            ),
            "mean_tokens_before_first_release_answered": (
                float(tt[answered].mean()) if answered.any() else None
            ),
        },
    }


async def _timed(chain: Any, question: str) -> dict[str, Any]:
    start = time.perf_counter()
    first = None
    last = None
    async for chunk in chain.astream({"question": question}):
        if chunk.content and first is None and "abstention" not in chunk.response_metadata:
            first = time.perf_counter() - start
        last = chunk
    done = time.perf_counter() - start
    decision = last.response_metadata["abstention"]
    return {
        "first_text_s": first if first is not None else done,
        "decision_s": done,
        "abstained": bool(decision["abstained"]),
        "statistic": decision.get("run_statistic", decision.get("score")),
        "streaming": decision.get("streaming"),
    }


async def _run_all(chain: Any, questions: list[str], concurrency: int) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(q: str) -> dict[str, Any]:
        async with gate:
            return await _timed(chain, q)

    return list(await asyncio.gather(*(one(q) for q in questions)))


def _summary(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Seconds to the first released text of the answered questions (what a user of an
    answered question waits for; an abstention's first text is its decision) and to the
    decision of every question."""
    answered = [r["first_text_s"] for r in rows if not r["abstained"]]
    decisions = [r["decision_s"] for r in rows]
    return {
        "n": len(rows),
        "answered": len(answered),
        "wall_s": wall,
        "first_text_s_answered_median": statistics.median(answered) if answered else None,
        "first_text_s_answered_mean": statistics.mean(answered) if answered else None,
        "decision_s_median": statistics.median(decisions),
        "decision_s_p95": float(np.percentile(decisions, 95)),
    }


def _rule_artifact(art: Any, rule: ChunkRule | None, held: Held, decode: Any) -> GuardArtifact:
    """The artifact ``calibrate --chunk-rule rule`` builds from these calibration answers
    (their statistics under ``rule``, read off the same replay; None: whole answers, the
    buffered guard ``calibrate`` without a chunk rule builds), for timing the rule live."""
    m, f, _ = _rule_stats(rule, held, decode)
    n = held.n_calibration
    record = DeploymentRecord.from_metadata(art.metadata)
    assert record is not None
    streaming = None if rule is None else StreamingRecord(chunk_rule=str(rule))
    meta = dict(art.metadata)
    meta["deployment"] = record.model_copy(update={"streaming": streaming}).to_json()
    return GuardArtifact.from_calibration(
        scorer=art.scorer,
        calibration=CalibrationSet(
            m[:n], held.correct[:n], stream_first=None if rule is None else f[:n]
        ),
        model_fingerprint=art.model_fingerprint,
        metadata=meta,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="a guard calibrated with a chunk rule")
    ap.add_argument("--rules", default="sentence,clause,tokens:4,tokens:8")
    ap.add_argument("--risk-target", type=float, default=0.35)
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--timing", type=int, default=24, help="test questions timed live")
    ap.add_argument(
        "--live-rules", default="tokens:8", help="rules timed live besides the artifact's"
    )
    ap.add_argument("--json", help="also write the JSON here")
    args = ap.parse_args()

    art = GuardArtifact.load(args.artifact)
    config = GuardConfig(mode="risk", risk_target=args.risk_target, delta=args.delta)
    _, guard, _ = load_guard_chain(art, config)
    (chat,) = find_chat_models(guard.bound_runnable)
    cache_dir = Path(art.metadata["cache_dir"])
    held = Held(art, chat, cache_dir)
    decode = answer_decoder(chat.tokenizer)
    offline = []
    m_b, f_b, t_b = _rule_stats(None, held, decode)
    offline.append(_offline("buffered (whole answers)", m_b, f_b, t_b, held, art, args))
    stored: dict[str, float] = {}
    own = guard.chunk_rule
    for name in args.rules.split(","):
        rule = ChunkRule.parse(name)
        m, f, first_t = _rule_stats(rule, held, decode)
        offline.append(_offline(str(rule), m, f, first_t, held, art, args))
        if own is not None and str(rule) == str(own):
            stored = {it.question: float(x) for it, x in zip(held.items, m, strict=True)}
    # the artifact's own calibration statistics against this recomputation (same answers)
    n_cal = held.n_calibration
    own_m = np.array([stored[it.question] for it in held.items[:n_cal]]) if stored else None
    recompute = (
        float(np.max(np.abs(own_m - art.scores)))
        if own_m is not None and own_m.size == art.n
        else None
    )

    test_items = held.items[n_cal:][: args.timing]
    questions = [it.question for it in test_items]
    timed = [(f"certified {own}", art)] + [
        (f"certified {r}", _rule_artifact(art, ChunkRule.parse(r), held, decode))
        for r in args.live_rules.split(",")
        if r and str(ChunkRule.parse(r)) != str(own)
    ]
    timed.append(("buffered", _rule_artifact(art, None, held, decode)))
    live: dict[str, Any] = {}
    for label, artifact in timed:
        c, _, _ = load_guard_chain(artifact, config, model=chat)
        asyncio.run(_run_all(c, questions[:2], 1))  # warm
        for conc in (1, 8):
            t = time.perf_counter()
            rows = asyncio.run(_run_all(c, questions, conc))
            live[f"{label} x{conc}"] = _summary(rows, time.perf_counter() - t)
            if label == f"certified {own}" and conc == 1:
                diffs = [
                    abs(r["statistic"] - stored[q])
                    for r, q in zip(rows, questions, strict=True)
                    if not r["abstained"] and r["statistic"] is not None and q in stored
                ]
                live["live_vs_stored_completed"] = {
                    "n": len(diffs),
                    "max_abs_diff": max(diffs) if diffs else None,
                }
    ratios = {}
    for label, _ in timed[:-1]:
        for conc in (1, 8):
            c, b = live[f"{label} x{conc}"], live[f"buffered x{conc}"]
            if c["first_text_s_answered_median"] and b["first_text_s_answered_median"]:
                ratios[f"{label} x{conc}"] = (
                    c["first_text_s_answered_median"] / b["first_text_s_answered_median"]
                )
    live["first_text_answered_ratio_to_buffered"] = ratios
    out = {
        "artifact": args.artifact,
        "artifact_rule": None if own is None else str(own),
        "risk_target": args.risk_target,
        "delta": args.delta,
        "n_candidates": art.n_candidates,
        "held_out": {"calibration": n_cal, "test": len(held.items) - n_cal},
        "replay_seconds_all_cuts": held.replay_seconds,
        "artifact_statistics_recomputed_max_abs_diff": recompute,
        "offline": offline,
        "live": live,
        "processor": {"platform": platform.platform(), **kernel_facts()},
    }
    text = json.dumps(out, indent=2, default=float)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
