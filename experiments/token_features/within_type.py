"""Scorer experiment: overall and within-type AUROC, and what risk mode certifies.

Reads the per-token inputs dumped by ``experiments/token_features/token_features.py`` (one
``.npz`` per data set:
every answer's geometry token block, log-probabilities, entropies, split, question type and
label) and, for each seed, fits the library's scorers on the reference and train splits
only (``GeometryScorer.fit_blocks``, ``GeometryPlusScorer.fit_blocks``; the regularisation
of ``geometry_plus`` is chosen by cross-validation on train), then reports on the
calibration and test splits:

* which ``geometry_plus`` variant (:data:`CANDIDATES`: feature sets, covariance) a
  validation part of train prefers: ``--select-folds`` stratified folds of the train split,
  each variant fitted on the other folds and scored on the held-out fold, mean within-type
  AUROC over the folds decides (overall AUROC breaks ties); the chosen variant is refitted on
  all of train and reported as ``geometry_plus (selected)``;

* overall AUROC with a class-stratified bootstrap interval and the correct/incorrect counts;
* mean within-type AUROC (types = each answer's ``group``: the probe set's relation) with its
  interval, over the types that have both classes (and the mean weighted by type size, no
  interval: a type with one correct answer weighs as much as one with hundreds in the plain
  mean);
* the error among the 15 % most confident calibration answers, and the calibration
  participation risk mode certifies at ε ∈ {0.30, 0.35, 0.40}, δ = 0.1 (the shipped
  procedure);
* for ``geometry_plus``, leave-one-family-out ablations (each refitted without the family);
* per fitted scorer the AUROC and within-type AUROC of every seed;
* the within-type gain of ``geometry_plus`` (shipped and selected) over ``geometry`` and over
  the best likelihood baseline of that split, with a paired bootstrap interval (the same
  class-stratified within-type resamples for both scorers);
* with ``--resplits N``: the same selection, fits and point metrics on N random redraws of
  train / calibration / test (reference kept: it fitted the means), summarised per scorer
  (mean, sd, range; AUROC, within-type AUROC, error among the 15 % most confident,
  participation certified at ε = 0.35) with the share of redraws where a gain reaches 0.05;
* per question type: counts and AUROC of the main scorers (seed 0);
* the scoring cost per response of ``geometry`` and ``geometry_plus`` from the token inputs
  (CPU time of ``scores_of`` on one response at a time; reading the message and computing Φ
  are the same for both and not included).

No calibration or test label is read to fit or choose anything.

    python experiments/token_features/within_type.py runs/features/probe.npz --seeds 0 1 2

Last line: one JSON object ``{dataset: {split: {scorer: {...}}}}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from sklearn.model_selection import StratifiedKFold

from abstain_guard import GuardArtifact
from abstain_guard.adapters import ReferenceMeans
from abstain_guard.calibration.measure.ranking import scorer_table
from abstain_guard.guarantee.frontier import certifiable_frontier
from abstain_guard.scorers import ReferenceInputs, TokenBlock
from abstain_guard.scorers.geometry import GeometryScorer
from abstain_guard.scorers.geometry_plus import (
    RESPONSE_FEATURES,
    GeometryPlusScorer,
)

EPSILONS = (0.30, 0.35, 0.40)
FAMILIES = {
    "likelihood": tuple(f for f in RESPONSE_FEATURES if f.startswith(("logprob", "entropy"))),
    "geometry": tuple(f for f in RESPONSE_FEATURES if f.startswith(("d_", "margin"))),
    "length": ("log_tokens",),
}
BASELINES = ("perplexity", "mean_token_entropy", "max_sequence_probability")


def _without(*names: str) -> tuple[str, ...]:
    return tuple(f for f in RESPONSE_FEATURES if f not in names)


CANDIDATES: dict[str, dict[str, Any]] = {
    "all": {"features": RESPONSE_FEATURES},
    "all, OAS covariance": {"features": RESPONSE_FEATURES, "covariance": "oas"},
    "means only": {
        "features": (
            "logprob_mean",
            "entropy_mean",
            "d_corr_mean",
            "d_inc_mean",
            "margin_mean",
            "log_tokens",
        )
    },
    "no first-token": {"features": _without("logprob_first", "entropy_first", "margin_first")},
    "no min/max": {"features": _without("logprob_min", "entropy_max", "margin_min", "margin_max")},
    **{f"-{family}": {"features": _without(*names)} for family, names in FAMILIES.items()},
}
"""The ``geometry_plus`` variants the validation part of train chooses from (``all`` is the
shipped form; the ``-family`` ones are the ablations)."""


def load(path: Path, artifact: str) -> dict[str, Any]:
    """Token blocks and per-answer metadata of one features file (the reference means from
    the file, or, for files written before it stored them, from ``artifact``)."""
    z = np.load(path, allow_pickle=False)
    prefix = "reference_means."
    stored = {k[len(prefix) :]: z[k] for k in z.files if k.startswith(prefix)}
    means = (
        ReferenceMeans.from_arrays(stored)
        if stored
        else cast(Any, GuardArtifact.load(artifact).scorer).reference_means_
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


def _reference(data: dict[str, Any]) -> ReferenceInputs:
    rows = _rows(data, "reference")
    return ReferenceInputs(
        means=data["means"],
        blocks=[data["blocks"][i] for i in rows],
        labels=data["correct"][rows],
        num_layers=data["num_layers"],
    )


def _fold_metrics(scores: np.ndarray, y: np.ndarray, groups: np.ndarray) -> tuple[float, float]:
    """(overall AUROC, mean within-type AUROC) of one validation fold."""
    entry = scorer_table({"s": scores}, y, groups=groups, n_boot=0)["s"]
    return float(entry["auroc"]), float(entry["within_group"]["mean_auroc"])


def select_variant(
    data: dict[str, Any], seed: int, folds: int
) -> tuple[str, dict[str, dict[str, float]]]:
    """The :data:`CANDIDATES` variant with the best mean within-type AUROC on held-out folds
    of the *train* split (each fitted on the other folds), and every variant's fold means."""
    reference = _reference(data)
    train_rows = _rows(data, "train")
    y = data["correct"][train_rows]
    groups = data["group"][train_rows]
    blocks = [data["blocks"][i] for i in train_rows]
    splitter = StratifiedKFold(folds, shuffle=True, random_state=seed)
    table: dict[str, dict[str, float]] = {}
    for name, params in CANDIDATES.items():
        metrics = []
        for fit_idx, val_idx in splitter.split(np.zeros(y.size), y):
            scorer = GeometryPlusScorer(random_state=seed, **params).fit_blocks(
                reference, [blocks[i] for i in fit_idx], y[fit_idx]
            )
            val_scores = scorer.scores_of([blocks[i] for i in val_idx])
            metrics.append(_fold_metrics(val_scores, y[val_idx], groups[val_idx]))
        overall, within = np.mean(metrics, axis=0)
        table[name] = {
            "auroc": round(float(overall), 3),
            "within_type_auroc": round(float(within), 3),
        }
    chosen = max(table, key=lambda n: (table[n]["within_type_auroc"], table[n]["auroc"]))
    return chosen, table


def fit_scorers(data: dict[str, Any], seed: int, selected: str) -> dict[str, Any]:
    """Every fitted scorer of this experiment, fitted on reference/train only (``selected``:
    the :data:`CANDIDATES` variant chosen on train, refitted on all of it)."""
    train_rows = _rows(data, "train")
    y = data["correct"]
    reference = _reference(data)
    train_blocks = [data["blocks"][i] for i in train_rows]
    scorers: dict[str, Any] = {
        "geometry": GeometryScorer(random_state=seed).fit_blocks(
            reference, train_blocks, y[train_rows]
        ),
        "geometry_plus": GeometryPlusScorer(random_state=seed).fit_blocks(
            reference, train_blocks, y[train_rows]
        ),
    }
    scorers["geometry_plus (selected)"] = GeometryPlusScorer(
        random_state=seed, **CANDIDATES[selected]
    ).fit_blocks(reference, train_blocks, y[train_rows])
    for family in FAMILIES:
        scorers[f"geometry_plus -{family}"] = GeometryPlusScorer(
            random_state=seed, **CANDIDATES[f"-{family}"]
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


def _pair_matrix(s: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``[n_incorrect, n_correct]``: 1 where the incorrect answer scores above the correct
    one, 0.5 on ties (the AUROC is its mean)."""
    inc, corr = s[~y], s[y]
    return (inc[:, None] > corr[None, :]) + 0.5 * (inc[:, None] == corr[None, :])


def within_type_gain(
    a: np.ndarray, b: np.ndarray, y: np.ndarray, groups: np.ndarray, n_boot: int, seed: int
) -> dict[str, Any]:
    """Mean within-type AUROC of ``a`` minus that of ``b`` with a paired bootstrap interval:
    each resample redraws the correct and the incorrect answers within every type (types with
    both classes), the same draw for both scorers."""
    rng = np.random.default_rng(seed)
    deltas = np.zeros(n_boot)
    point = []
    for g in sorted(set(groups.tolist())):
        m = groups == g
        yg = y[m]
        if yg.all() or not yg.any():
            continue
        diff = _pair_matrix(a[m], yg) - _pair_matrix(b[m], yg)
        n_inc, n_corr = diff.shape
        point.append(diff.mean())
        w_inc = rng.multinomial(n_inc, np.full(n_inc, 1 / n_inc), size=n_boot)
        w_corr = rng.multinomial(n_corr, np.full(n_corr, 1 / n_corr), size=n_boot)
        deltas += np.einsum("bi,ij,bj->b", w_inc, diff, w_corr) / (n_inc * n_corr)
    deltas /= len(point)
    ci = [float(v) for v in np.percentile(deltas, [2.5, 97.5])] if n_boot > 0 else None
    return {"delta": round(float(np.mean(point)), 3), "ci": _rounded(ci)}


def gains(
    scores: dict[str, np.ndarray],
    table: dict[str, Any],
    y: np.ndarray,
    groups: np.ndarray,
    n_boot: int,
) -> dict[str, Any]:
    """Within-type gains of the geometry_plus scorers over geometry and the best baseline."""
    best = max(BASELINES, key=lambda n: table[n]["within_group"]["mean_auroc"])
    out: dict[str, Any] = {"best_baseline": best}
    for name in ("geometry_plus", "geometry_plus (selected)"):
        for other in ("geometry", best):
            out[f"{name} - {other}"] = within_type_gain(
                scores[name], scores[other], y, groups, n_boot, seed=0
            )
    return out


def scoring_cost(scorers: dict[str, Any], blocks: Sequence[TokenBlock]) -> dict[str, Any]:
    """Median CPU and wall microseconds per response of ``scores_of([block])`` (one response
    per call, as the guard scores), geometry and geometry_plus, three passes over ``blocks``."""
    out: dict[str, Any] = {"responses": len(blocks)}
    for name in ("geometry", "geometry_plus"):
        cpu, wall = [], []
        for _ in range(3):
            for b in blocks:
                c0, w0 = time.process_time_ns(), time.perf_counter_ns()
                scorers[name].scores_of([b])
                cpu.append(time.process_time_ns() - c0)
                wall.append(time.perf_counter_ns() - w0)
        out[name] = {
            "cpu_us_median": round(float(np.median(cpu)) / 1e3, 1),
            "wall_us_median": round(float(np.median(wall)) / 1e3, 1),
        }
    return out


def _seed_rows(
    by_seed: list[np.ndarray], y: np.ndarray, groups: np.ndarray
) -> dict[str, list[float]]:
    rows = [scorer_table({"s": s}, y, groups=groups, n_boot=0)["s"] for s in by_seed]
    return {
        "auroc_by_seed": [round(r["auroc"], 3) for r in rows],
        "within_type_by_seed": [round(r["within_group"]["mean_auroc"], 3) for r in rows],
    }


def _rounded(interval: Sequence[float] | None) -> list[float] | None:
    return None if interval is None else [round(v, 3) for v in interval]


def report_split(
    data: dict[str, Any], split: str, by_name: dict[str, list[np.ndarray]], n_boot: int
) -> dict[str, Any]:
    """One split's table (seed 0 with intervals, every seed's point values) and gains."""
    rows = _rows(data, split)
    y, groups = data["correct"][rows], data["group"][rows]
    blocks = [data["blocks"][i] for i in rows]
    scores = {**{k: v[0] for k, v in by_name.items()}, **baseline_scores(blocks)}
    table = scorer_table(scores, y, groups=groups, n_boot=n_boot, seed=0)
    out: dict[str, Any] = {}
    for name, entry in table.items():
        row = {
            "auroc": round(entry["auroc"], 3),
            "auroc_ci": _rounded(entry.get("auroc_ci")),
            "within_type_auroc": round(entry["within_group"]["mean_auroc"], 3),
            "within_type_ci": _rounded(entry["within_group"]["mean_auroc_ci"]),
            "within_type_weighted": round(entry["within_group"]["weighted_mean_auroc"], 3),
            "n_correct": entry["n_correct"],
            "n_incorrect": entry["n_incorrect"],
            "types_used": entry["within_group"]["n_groups_used"],
        }
        if name in by_name:
            row.update(_seed_rows(by_name[name], y, groups))
        if split == "calibration":
            row.update(risk_summary(scores[name], y))
        out[name] = row
    out["gains"] = gains(scores, table, y, groups, n_boot)
    out["per_type"] = per_type(table)
    return out


def per_type(table: dict[str, Any]) -> dict[str, Any]:
    """Per question type: counts and the AUROC of geometry, geometry_plus (shipped and
    selected) and the likelihood baselines (types with both classes)."""
    names = ("geometry", "geometry_plus", "geometry_plus (selected)", *BASELINES)
    groups = table["geometry"]["within_group"]["groups"]
    return {
        g: {
            "n_correct": v["n_correct"],
            "n_incorrect": v["n_incorrect"],
            **{n: round(table[n]["within_group"]["groups"][g]["auroc"], 3) for n in names},
        }
        for g, v in groups.items()
    }


def resplit(data: dict[str, Any], seed: int) -> dict[str, Any]:
    """``data`` with its train, calibration and test answers pooled and redrawn at the same
    sizes (seeded); the reference split stays (its answers fitted the means Φ uses)."""
    split = data["split"].copy()
    pooled = np.flatnonzero(split != "reference")
    split[np.random.default_rng(seed).permutation(pooled)] = split[pooled]
    return {**data, "split": split}


def _gain_points(table: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Within-type gains (plain and size-weighted mean) of the geometry_plus scorers over
    geometry and over the best likelihood baseline by that same mean."""
    out: dict[str, dict[str, float]] = {}
    for key, kind in (
        ("mean_auroc", "within-type gain"),
        ("weighted_mean_auroc", "weighted within-type gain"),
    ):
        best = max(BASELINES, key=lambda n: table[n]["within_group"][key])
        for name in ("geometry_plus", "geometry_plus (selected)"):
            mine = table[name]["within_group"][key]
            out.setdefault(kind, {})[f"{name} - geometry"] = (
                mine - table["geometry"]["within_group"][key]
            )
            out[kind][f"{name} - best baseline"] = mine - table[best]["within_group"][key]
    return out


def resplit_summary(data: dict[str, Any], seeds: Sequence[int], folds: int) -> dict[str, Any]:
    """Point AUROC / within-type AUROC / gains on calibration and test over random resplits
    of train + calibration + test (selection on each resplit's train, as in :func:`main`)."""
    values: dict[str, dict[str, list[float]]] = {}
    chosen_by_seed = {}
    for seed in seeds:
        d = resplit(data, seed)
        chosen, _ = select_variant(d, seed, folds)
        chosen_by_seed[str(seed)] = chosen
        scorers = fit_scorers(d, seed, chosen)
        for split in ("calibration", "test"):
            rows = _rows(d, split)
            blocks = [d["blocks"][i] for i in rows]
            y, groups = d["correct"][rows], d["group"][rows]
            scores = {
                **{n: sc.scores_of(blocks) for n, sc in scorers.items()},
                **baseline_scores(blocks),
            }
            table = scorer_table(scores, y, groups=groups, n_boot=0)
            for name, entry in table.items():
                risk = risk_summary(scores[name], y)
                for key, v in (
                    ("auroc", entry["auroc"]),
                    ("within_type", entry["within_group"]["mean_auroc"]),
                    ("within_type_weighted", entry["within_group"]["weighted_mean_auroc"]),
                    ("error_top15", risk["error_top15"]),
                    ("certified_0.35", risk["certified_participation"]["0.35"]),
                ):
                    values.setdefault(f"{split} {key}", {}).setdefault(name, []).append(v)
            for kind, gains_by_name in _gain_points(table).items():
                for name, delta in gains_by_name.items():
                    values.setdefault(f"{split} {kind}", {}).setdefault(name, []).append(delta)
        print(f"resplit {seed}: chose {chosen!r}", flush=True)
    summary: dict[str, Any] = {"chosen": chosen_by_seed}
    for key, by_name in values.items():
        summary[key] = {
            name: {
                "mean": round(float(np.mean(v)), 3),
                "sd": round(float(np.std(v, ddof=1)), 3) if len(v) > 1 else 0.0,
                "min": round(float(np.min(v)), 3),
                "max": round(float(np.max(v)), 3),
                **(
                    {"share_ge_0.05": round(float(np.mean(np.asarray(v) >= 0.05)), 2)}
                    if "gain" in key
                    else {}
                ),
            }
            for name, v in by_name.items()
        }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("features", nargs="+", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--select-folds", type=int, default=5)
    ap.add_argument("--artifact", default="abstain_guard/default_guard")
    ap.add_argument(
        "--resplits",
        type=int,
        default=0,
        help="also redraw train/calibration/test this many times (seeds 1..N) and summarise",
    )
    args = ap.parse_args()
    result: dict[str, Any] = {}
    for path in args.features:
        t0 = time.perf_counter()
        data = load(path, args.artifact)
        out: dict[str, Any] = {"selection": {}}
        per_seed: dict[str, dict[str, list[np.ndarray]]] = {"calibration": {}, "test": {}}
        for seed in args.seeds:
            chosen, table = select_variant(data, seed, args.select_folds)
            out["selection"][str(seed)] = {"chosen": chosen, "validation": table}
            print(f"{path.stem} seed {seed}: chose {chosen!r} {json.dumps(table)}", flush=True)
            scorers = fit_scorers(data, seed, chosen)
            for split in per_seed:
                blocks = [data["blocks"][i] for i in _rows(data, split)]
                for name, scorer in scorers.items():
                    per_seed[split].setdefault(name, []).append(scorer.scores_of(blocks))
        for split, by_name in per_seed.items():
            out[split] = report_split(data, split, by_name, args.n_boot)
            for name, row in out[split].items():
                print(f"{path.stem:10s} {split:11s} {name:28s} {json.dumps(row)}", flush=True)
        test_blocks = [data["blocks"][i] for i in _rows(data, "test")]
        out["scoring_cost"] = scoring_cost(scorers, test_blocks)
        print(f"{path.stem} scoring cost {json.dumps(out['scoring_cost'])}", flush=True)
        if args.resplits:
            seeds = range(1, args.resplits + 1)
            out["resplits"] = resplit_summary(data, seeds, args.select_folds)
            for key, row in out["resplits"].items():
                print(f"{path.stem} resplits {key}: {json.dumps(row)}", flush=True)
        out["seconds"] = round(time.perf_counter() - t0, 1)
        result[path.stem] = out
    print(json.dumps(result))


if __name__ == "__main__":
    main()
