"""Ranking metrics of every scorer on the same labeled answers: AUROC, AUPRC and PRR with
bootstrap intervals, and within-type AUROC (does a score know which *answers* are wrong, or
only which *kinds* of question the model gets wrong?).

The metrics themselves are in :mod:`abstain_guard.calibration.measure.metrics`; this module
tabulates them per scorer and handles scorers that could not score every answer
(``nan_policy``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.errors import InsufficientDataError, InvalidInputError
from abstain_guard.guarantee.validation import check_labels

from .metrics import (
    INTERVAL_METRICS,
    auprc,
    auroc,
    bootstrap_draws,
    bootstrap_intervals,
    check_nan_policy,
    percentile_interval,
    prr,
)


def scorer_metrics(uncertainty: ArrayLike, correct: ArrayLike) -> dict[str, float]:
    """AUROC, AUPRC (paper: positive = correct), AUPRC with positive = incorrect, and PRR
    (quality = correctness) of one scorer; see :mod:`abstain_guard.calibration.measure.metrics`."""
    return {
        "auroc": auroc(uncertainty, correct),
        "auprc": auprc(uncertainty, correct, positive="correct"),
        "auprc_incorrect": auprc(uncertainty, correct, positive="incorrect"),
        "prr": prr(uncertainty, check_labels(correct)),
    }


def select_scored(
    name: str, scores: ArrayLike, y: NDArray[np.int64], nan_policy: str
) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
    """Scorer ``name``'s scores as float ``[n]`` (one per label of ``y [n]``) and the mask
    ``[n]`` of rows to use: NaN rows are dropped under ``"omit"``, an error under ``"raise"``."""
    try:
        s = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"scores of scorer {name!r} are not numeric ({exc}).") from exc
    if s.ndim != 1 or s.size != y.size:
        raise InvalidInputError(
            f"scorer {name!r} has {s.size if s.ndim == 1 else s.shape} scores for {y.size} "
            "labels; pass one score per labeled response, in the same order."
        )
    keep = ~np.isnan(s)
    if not keep.all() and nan_policy == "raise":
        raise InvalidInputError(
            f"scorer {name!r} has {int((~keep).sum())} NaN score(s) of {s.size}; fix the scorer "
            "or pass nan_policy='omit' to evaluate it on the responses it could score."
        )
    return s, keep


def _within_group(
    s: NDArray[np.float64],
    y: NDArray[np.int64],
    groups: NDArray[Any],
    n_boot: int = 0,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """Within-type AUROC of scores ``s [n]``, labels ``y [n]``, question types ``groups [n]``
    (the bootstrap of ``mean_auroc_ci``: docs/results.md, 'Ranking metrics and their
    intervals'). Groups are resampled in sorted order from one Generator seeded with
    ``seed``."""
    per_group: dict[str, dict[str, Any]] = {}
    draws: list[NDArray[np.float64]] = []
    rng = np.random.default_rng(seed)
    skipped: dict[str, str] = {}
    has_group = np.array([v is not None for v in groups.tolist()], dtype=bool)
    names = groups.astype(str)
    for g in sorted({str(v) for v in groups.tolist() if v is not None}):
        mask = has_group & (names == g)
        yg = y[mask]
        if yg.size < 2 or yg.min() == yg.max():
            skipped[g] = (
                f"one class only ({int(yg.sum())} correct of {yg.size})"
                if yg.size
                else "no responses"
            )
            continue
        per_group[g] = {
            "auroc": auroc(s[mask], yg),
            "n": int(yg.size),
            "n_correct": int(yg.sum()),
            "n_incorrect": int(yg.size - yg.sum()),
            "accuracy": float(yg.mean()),
        }
        if n_boot > 0:
            d = bootstrap_draws(s[mask], yg, ("auroc",), n_boot=n_boot, seed=rng)["auroc"]
            per_group[g]["auroc_ci"] = list(percentile_interval(d, confidence))
            draws.append(d)
    aurocs = np.array([v["auroc"] for v in per_group.values()])
    sizes = np.array([v["n"] for v in per_group.values()], dtype=np.float64)
    ci = list(percentile_interval(np.mean(draws, axis=0), confidence)) if draws else None
    return {
        "groups": per_group,
        "n_correct": sum(v["n_correct"] for v in per_group.values()),
        "n_incorrect": sum(v["n_incorrect"] for v in per_group.values()),
        "skipped_groups": skipped,
        "n_groups_used": len(per_group),
        "n_without_group": int((~has_group).sum()),
        "mean_auroc": float(aurocs.mean()) if aurocs.size else float("nan"),
        "mean_auroc_ci": ci,
        "weighted_mean_auroc": (
            float((aurocs * sizes).sum() / sizes.sum()) if aurocs.size else float("nan")
        ),
    }


def scorer_table(
    scores_by_scorer: Mapping[str, ArrayLike],
    correct: ArrayLike,
    groups: ArrayLike | None = None,
    nan_policy: Literal["raise", "omit"] = "raise",
    n_boot: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Ranking metrics of every scorer (name → ``[n]`` uncertainty scores) on the same 0/1
    labels ``correct [n]``, with ``n_boot`` bootstrap resamples for the intervals (0: none)
    and, given ``groups [n]`` (question types), the within-type AUROC. Under
    ``nan_policy="omit"`` a scorer's NaN responses are dropped, and a scorer left with too
    little data gets ``{"n", "n_omitted", "error"}`` instead of metrics. Scorers with the same
    responses get the same resamples (a paired bootstrap). The keys of each scorer's entry:
    docs/results.md, 'Ranking metrics and their intervals'."""
    check_nan_policy(nan_policy)
    if int(n_boot) < 0:
        raise InvalidInputError(f"n_boot must be 0 (no intervals) or more, got {n_boot}.")
    if not scores_by_scorer:
        raise InvalidInputError("scores_by_scorer is empty; pass at least one scorer's scores.")
    y = check_labels(correct)
    g_arr: NDArray[Any] | None = None
    if groups is not None:
        g_arr = np.asarray(groups, dtype=object)
        if g_arr.ndim != 1 or g_arr.size != y.size:
            raise InvalidInputError(
                f"groups must have one entry per response ({y.size}); got shape {g_arr.shape}."
            )
    table: dict[str, dict[str, Any]] = {}
    for name, scores in scores_by_scorer.items():
        s, keep = select_scored(name, scores, y, nan_policy)
        counts = {"n": int(keep.sum()), "n_omitted": int((~keep).sum())}
        try:
            entry: dict[str, Any] = scorer_metrics(s[keep], y[keep])
        except InsufficientDataError as exc:
            if nan_policy == "raise":
                raise
            # Under 'omit' one broken scorer must not sink the whole table: record why.
            table[name] = {**counts, "error": str(exc)}
            continue
        n_correct = int(y[keep].sum())
        entry.update(
            counts,
            n_correct=n_correct,
            n_incorrect=counts["n"] - n_correct,
            accuracy=float(y[keep].mean()),
        )
        if n_boot > 0:
            intervals = bootstrap_intervals(
                s[keep], y[keep], INTERVAL_METRICS, n_boot=n_boot, confidence=confidence, seed=seed
            )
            entry.update({f"{m}_ci": list(lo_hi) for m, lo_hi in intervals.items()})
        if g_arr is not None:
            entry["within_group"] = _within_group(
                s[keep], y[keep], g_arr[keep], n_boot, confidence, seed
            )
        table[name] = entry
    return table
