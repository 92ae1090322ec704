"""Dump the per-token inputs of every answer of a calibration run, for scorer experiments.

Reads a finished calibration run (its config and run cache: answers and judgments), replays
every answer once with hidden states, and writes one ``.npz`` holding, per answer, the
geometry token block (Ω, Θ, Φ^in, Φ^out with the artifact's reference means), the token
log-probabilities, entropies and top-2 margins, plus the answer's split, group (question
type), label, question and text. Nothing is fitted here;
``experiments/token_features/within_type.py`` reads the
file and fits scorers on the reference/train splits only.

    python experiments/token_features/token_features.py --config configs/default_guard.yaml \
        --cache-dir runs/default_guard.cache --artifact abstain_guard/default_guard \
        --out runs/features/probe.npz

Prints one JSON line: answers per split, correct per split, seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard import GuardArtifact
from abstain_guard.calibration.building.answering.answer_rows import GenerationOptions
from abstain_guard.calibration.building.answering.answers import generate_answers, generated_pairs
from abstain_guard.calibration.building.answering.models import load_model
from abstain_guard.calibration.building.judges.judging import build_judges, judge_answers
from abstain_guard.calibration.building.preflight import preflight
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.building.run.store import RunStore
from abstain_guard.contract.metadata import ResponseMetadata
from abstain_guard.scorers import token_block

SPLITS = ("reference", "train", "calibration", "test")


def _margins(meta: dict[str, Any]) -> np.ndarray:
    """``[N]`` log p(top-1) − log p(top-2) of each generated token (NaN without top-2)."""
    content = (meta.get("logprobs") or {}).get("content") or []
    out = np.full(len(content), np.nan)
    for i, tok in enumerate(content):
        tops = sorted((t["logprob"] for t in tok.get("top_logprobs") or []), reverse=True)
        if len(tops) >= 2:
            out[i] = tops[0] - tops[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--cache-dir", required=True, type=Path)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--data", default="builtin")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args()

    t0 = time.perf_counter()
    cfg = CalibrationConfig.from_file(args.config)
    _items, _, splits = preflight(
        args.data, args.out.parent / "unused-out", args.cache_dir, cfg, check_judge=False
    )
    artifact = GuardArtifact.load(args.artifact)
    means = artifact.scorer.reference_means_
    model = load_model(cfg)
    fingerprint = str(model.fingerprint)
    store = RunStore(args.cache_dir / "run.sqlite")
    answers: dict[str, dict[str, Any]] = {}
    for names, size in ((("reference", "train"), None), (("calibration", "test"), 1)):
        answers.update(
            generate_answers(
                model,
                [it for n in names for it in splits[n]],
                store,
                cfg,
                fingerprint=fingerprint,
                options=GenerationOptions(batch_size=size),
            )
        )
    judges = build_judges(cfg, args.cache_dir / "judgments.sqlite", None)
    ordered = [it for n in SPLITS for it in splits[n]]
    judgments = judge_answers(judges, ordered, answers, progress=False)

    rows: dict[str, list[Any]] = {
        k: []
        for k in (
            "geometry",
            "logprob",
            "entropy",
            "margin",
            "split",
            "group",
            "correct",
            "id",
            "question",
            "text",
        )
    }
    for name in SPLITS:
        its = [it for it in splits[name] if judgments[it.id].correct is not None]
        pairs = generated_pairs(its, answers, cfg)
        for a in range(0, len(its), args.chunk):
            results = model.replay_batch(
                pairs[a : a + args.chunk], batch_size=1, return_states=True, progress=False
            )
            for it, res in zip(its[a : a + args.chunk], results, strict=True):
                block = token_block(res, means)
                meta = answers[it.id]["metadata"]
                rows["geometry"].append(block.geometry.astype(np.float32))
                rows["logprob"].append(block.logprob)
                rows["entropy"].append(ResponseMetadata(res.metadata).entropy())
                rows["margin"].append(_margins(meta))
                rows["split"].append(name)
                rows["group"].append(it.group or "")
                rows["correct"].append(bool(judgments[it.id].correct))
                rows["id"].append(it.id)
                rows["question"].append(it.question)
                rows["text"].append(answers[it.id]["text"])
            print(f"{name}: {min(a + args.chunk, len(its))}/{len(its)}", flush=True)

    lengths = np.array([g.shape[0] for g in rows["geometry"]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out,
        geometry=np.concatenate(rows["geometry"]),
        logprob=np.concatenate(rows["logprob"]),
        entropy=np.concatenate(
            [
                e if e is not None and e.shape == (n,) else np.full(n, np.nan)
                for e, n in zip(rows["entropy"], lengths, strict=True)
            ]
        ),
        margin=np.concatenate(
            [
                m if m.shape == (n,) else np.full(n, np.nan)
                for m, n in zip(rows["margin"], lengths, strict=True)
            ]
        ),
        lengths=lengths,
        split=np.array(rows["split"]),
        group=np.array(rows["group"]),
        correct=np.array(rows["correct"]),
        id=np.array(rows["id"]),
        question=np.array(rows["question"]),
        text=np.array(rows["text"]),
        num_layers=np.array(artifact.scorer.num_layers_),
        **{f"reference_means.{k}": np.asarray(v) for k, v in means.to_arrays().items()},
    )
    split = np.array(rows["split"])
    correct = np.array(rows["correct"])
    print(
        json.dumps(
            {
                "answers": {s: int((split == s).sum()) for s in SPLITS},
                "correct": {s: int(correct[split == s].sum()) for s in SPLITS},
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
