"""Scorer experiment: overall and within-type AUROC, and what risk mode certifies.

Reads the per-token inputs dumped by ``bench/token_features.py`` (one ``.npz`` per data set:
every answer's geometry token block, log-probabilities, entropies, split, question type and
label) and, for each seed, fits the library's scorers on the reference and train splits
only (``GeometryScorer.fit_blocks``, ``GeometryPlusScorer.fit_blocks``; the regularisation
of ``geometry_plus`` is chosen by cross-validation on train), then reports on the
calibration and test splits:

* overall AUROC with a class-stratified bootstrap interval and the correct/incorrect counts;
* mean within-type AUROC (types = each answer's ``group``: the probe set's relation) with its
  interval, over the types that have both classes;
* the error among the 15 % most confident calibration answers, and the calibration
  participation risk mode certifies at ε ∈ {0.30, 0.35, 0.40}, δ = 0.1 (the shipped
  procedure);
* for ``geometry_plus``, leave-one-family-out ablations (each refitted without the family).

No calibration or test label is read to fit or choose anything.

    python bench/within_type.py runs/features/probe.npz --seeds 0 1 2

Last line: one JSON object ``{dataset: {split: {scorer: {...}}}}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard import GuardArtifact
from abstain_guard.adapters import ReferenceMeans
from abstain_guard.calibration.inference.features import ReferenceInputs, TokenBlock
from abstain_guard.calibration.inference.geometry import GeometryScorer
from abstain_guard.calibration.inference.geometry_plus import (
    RESPONSE_FEATURES,
    GeometryPlusScorer,
)
from abstain_guard.calibration.measure.ranking import scorer_table
from abstain_guard.frontier import certifiable_frontier

EPSILONS = (0.30, 0.35, 0.40)
FAMILIES = {
    "likelihood": tuple(f for f in RESPONSE_FEATURES if f.startswith(("logprob", "entropy"))),
    "geometry": tuple(f for f in RESPONSE_FEATURES if f.startswith(("d_", "margin"))),
    "length": ("log_tokens",),
}


def load(path: Path, artifact: str) -> dict[str, Any]:
    """Token blocks and per-answer metadata of one features file (the reference means from
    the file, or, for files written before it stored them, from ``artifact``)."""
    z = np.load(path, allow_pickle=False)
    prefix = "reference_means."
    stored = {k[len(prefix) :]: z[k] for k in z.files if k.startswith(prefix)}
    means = (
        ReferenceMeans.from_arrays(stored)
        if stored
        else GuardArtifact.load(artifact).scorer.reference_means_
    )
    bounds = np.concatenate([[0], np.cumsum(z["lengths"])])
    geometry = z["geometry"].astype(np.float64)
    blocks = [
        TokenBlock(geometry[a:b], z["logprob"][a:b], z["entropy"][a:b])
        for a, b in itertools.pairwise(bounds)
    ]
    return {
        "blocks": blocks,
        "split": z["split"],
        "group": z["group"],
        "correct": z["correct"].astype(bool),
        "num_layers": int(z["num_layers"]),
        "means": means,
    }


def _rows(data: dict[str, Any], split: str) -> np.ndarray:
    return np.flatnonzero(data["split"] == split)


def fit_scorers(data: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every fitted scorer of this experiment, fitted on reference/train only."""
    ref_rows, train_rows = _rows(data, "reference"), _rows(data, "train")
    y = data["correct"]
    reference = ReferenceInputs(
        means=data["means"],
        blocks=[data["blocks"][i] for i in ref_rows],
        labels=y[ref_rows],
        num_layers=data["num_layers"],
    )
    train_blocks = [data["blocks"][i] for i in train_rows]
    scorers: dict[str, Any] = {
        "geometry": GeometryScorer(random_state=seed).fit_blocks(
            reference, train_blocks, y[train_rows]
        ),
        "geometry_plus": GeometryPlusScorer(random_state=seed).fit_blocks(
            reference, train_blocks, y[train_rows]
        ),
    }
    for family, names in FAMILIES.items():
        kept = tuple(f for f in RESPONSE_FEATURES if f not in names)
        scorers[f"geometry_plus -{family}"] = GeometryPlusScorer(
            features=kept, random_state=seed
        ).fit_blocks(reference, train_blocks, y[train_rows])
    return scorers


def baseline_scores(blocks: list[TokenBlock]) -> dict[str, np.ndarray]:
    """Perplexity, mean token entropy and maximum sequence probability ``[n]`` each."""
    return {
        "perplexity": np.asarray([np.exp(-b.logprob.mean()) for b in blocks]),
        "mean_token_entropy": np.asarray([b.entropy.mean() for b in blocks]),
        "max_sequence_probability": np.asarray([-b.logprob.sum() for b in blocks]),
    }


def risk_summary(scores: np.ndarray, correct: np.ndarray) -> dict[str, Any]:
    order = np.argsort(scores, kind="stable")
    k = int(0.15 * scores.size)
    points = certifiable_frontier(scores, correct, risk_targets=EPSILONS, deltas=(0.1,))
    return {
        "error_top15": round(float(1 - correct[order[:k]].mean()), 3),
        "certified_participation": {
            f"{p.risk_target:.2f}": round(p.participation, 3) for p in points
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("features", nargs="+", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--artifact", default="abstain_guard/default_guard")
    args = ap.parse_args()
    result: dict[str, Any] = {}
    for path in args.features:
        t0 = time.perf_counter()
        data = load(path, args.artifact)
        y = data["correct"]
        out: dict[str, Any] = {}
        per_seed: dict[str, dict[str, list[np.ndarray]]] = {"calibration": {}, "test": {}}
        for seed in args.seeds:
            scorers = fit_scorers(data, seed)
            for split in per_seed:
                rows = _rows(data, split)
                blocks = [data["blocks"][i] for i in rows]
                for name, scorer in scorers.items():
                    per_seed[split].setdefault(name, []).append(scorer.scores_of(blocks))
        for split, by_name in per_seed.items():
            rows = _rows(data, split)
            blocks = [data["blocks"][i] for i in rows]
            scores = {**{k: v[0] for k, v in by_name.items()}, **baseline_scores(blocks)}
            table = scorer_table(
                scores, y[rows], groups=data["group"][rows], n_boot=args.n_boot, seed=0
            )
            out[split] = {}
            for name, entry in table.items():
                row = {
                    "auroc": round(entry["auroc"], 3),
                    "auroc_ci": [round(v, 3) for v in entry["auroc_ci"]],
                    "within_type_auroc": round(entry["within_group"]["mean_auroc"], 3),
                    "within_type_ci": [round(v, 3) for v in entry["within_group"]["mean_auroc_ci"]],
                    "n_correct": entry["n_correct"],
                    "n_incorrect": entry["n_incorrect"],
                }
                if name in by_name and len(by_name[name]) > 1:
                    aurocs = [
                        scorer_table({name: s}, y[rows], n_boot=0)[name]["auroc"]
                        for s in by_name[name]
                    ]
                    row["auroc_by_seed"] = [round(a, 3) for a in aurocs]
                if split == "calibration":
                    row.update(risk_summary(scores[name], y[rows]))
                out[split][name] = row
                print(f"{path.stem:10s} {split:11s} {name:28s} {json.dumps(row)}", flush=True)
        out["seconds"] = round(time.perf_counter() - t0, 1)
        result[path.stem] = out
    print(json.dumps(result))


if __name__ == "__main__":
    main()
