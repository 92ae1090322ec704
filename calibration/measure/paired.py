"""Paired comparisons of scorers on the same held-out answers (issue 37).

For one data set and a reference scorer (the artifact's, e.g. ``geometry``):

* ``auroc_diff``: AUROC(reference) − AUROC(other) with a 95 % percentile interval from a
  *paired* bootstrap — every resample draws the same answers for both scorers (class-
  stratified, :func:`.metrics.bootstrap_draws` with one seed: its resample ``r`` depends only
  on the labels and row ``r`` of the seed's stream);
* ``within_diff``: the same for the mean within-type AUROC (types with both classes; the
  answers resampled within each type and class, the same resamples for both scorers);
* per scorer, ``selective``: the error among the answered at 10/20/30/50 % participation (the
  most confident answers) and the area under that risk–participation curve (AURC);
  ``certified``: on the calibration split only, the smallest risk target ε certified at
  δ = 0.1 and the participation certified at ε = 0.35 (the numbers a user of that scorer's
  guard sees; :mod:`abstain_guard.frontier`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from sklearn.metrics import roc_auc_score

from abstain_guard.frontier import certifiable_frontier, smallest_certifiable_risk

from .metrics import bootstrap_draws, percentile_interval

__all__ = ["PARTICIPATIONS", "paired_report", "selective_risk"]

PARTICIPATIONS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5)
"""Participation levels of the selective-risk summary."""


def selective_risk(scores: ArrayLike, correct: ArrayLike) -> dict[str, Any]:
    """Error among the answered when the ``k`` most confident answers are answered: at
    :data:`PARTICIPATIONS` and the area under the whole curve (AURC, lower is better). Ties
    are broken by position (stable sort)."""
    s = np.asarray(scores, dtype=np.float64)
    wrong = 1.0 - np.asarray(correct, dtype=np.float64)
    order = np.argsort(s, kind="stable")
    curve = np.cumsum(wrong[order]) / np.arange(1, s.size + 1)
    at = {f"{p:g}": float(curve[max(1, round(p * s.size)) - 1]) for p in PARTICIPATIONS}
    return {"error_at": at, "aurc": float(curve.mean()), "base_error": float(wrong.mean())}


def _within_draws(
    s: np.ndarray, y: np.ndarray, groups: np.ndarray, n_boot: int, seed: int
) -> tuple[float, np.ndarray | None, int]:
    """Mean within-type AUROC, its bootstrap draws ``[n_boot]`` and the types used."""
    rng = np.random.default_rng(seed)
    points, draws = [], []
    for g in sorted({str(v) for v in groups.tolist() if v is not None}):
        mask = groups.astype(str) == g
        yg = y[mask]
        if yg.min() == yg.max():
            continue
        points.append(float(roc_auc_score(yg, -s[mask])))
        draws.append(bootstrap_draws(s[mask], yg, ("auroc",), n_boot=n_boot, seed=rng)["auroc"])
    if not points:
        return float("nan"), None, 0
    return float(np.mean(points)), np.mean(draws, axis=0), len(points)


def _interval(draws: np.ndarray) -> list[float]:
    return [round(v, 4) for v in percentile_interval(draws)]


def paired_report(
    scores_by_scorer: Mapping[str, ArrayLike],
    correct: ArrayLike,
    *,
    reference: str,
    groups: Sequence[Any] | None = None,
    calibration: ArrayLike | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    risk_target: float = 0.35,
    delta: float = 0.1,
) -> dict[str, Any]:
    """Paired differences against ``reference`` and per-scorer selective/certified numbers.

    Args:
        scores_by_scorer: scorer → ``[n]`` uncertainty scores of the same held-out answers.
        correct: ``[n]`` labels.
        reference: the scorer every other one is compared with.
        groups: ``[n]`` question types (None entries: no type), or None.
        calibration: ``[n]`` booleans marking the calibration-split answers (the certified
            numbers use only them); None: no certified numbers.
        n_boot, seed: the paired bootstrap.
        risk_target, delta: the (ε, δ) whose certified participation is reported.

    Returns:
        ``{"reference", "n_correct", "n_incorrect", "n_groups_used", "scorers": {name:
        {"auroc", "within_auroc", "selective", "certified", "auroc_diff", "auroc_diff_ci",
        "within_diff", "within_diff_ci"}}}`` (differences are reference − scorer; absent for
        the reference itself).
    """
    y = np.asarray(correct, dtype=np.int64)
    g = None if groups is None else np.asarray(groups, dtype=object)
    cal = None if calibration is None else np.asarray(calibration, dtype=bool)
    draws: dict[str, np.ndarray] = {}
    within: dict[str, tuple[float, np.ndarray | None, int]] = {}
    out: dict[str, Any] = {}
    n_groups = 0
    for name, raw in scores_by_scorer.items():
        s = np.asarray(raw, dtype=np.float64)
        if s.shape != y.shape or not np.all(np.isfinite(s)):
            continue
        draws[name] = bootstrap_draws(s, y, ("auroc",), n_boot=n_boot, seed=seed)["auroc"]
        entry: dict[str, Any] = {
            "auroc": float(roc_auc_score(y, -s)),
            "auroc_ci": _interval(draws[name]),
            "selective": selective_risk(s, y),
        }
        if g is not None:
            w_point, w_draws, n_groups = within[name] = _within_draws(s, y, g, n_boot, seed)
            entry["within_auroc"] = w_point
            if w_draws is not None:
                entry["within_auroc_ci"] = _interval(w_draws)
        if cal is not None and cal.any():
            yc = y[cal]
            [point] = certifiable_frontier(s[cal], yc, [risk_target], [delta])
            entry["certified"] = {
                "n": int(cal.sum()),
                "n_correct": int(yc.sum()),
                "smallest_risk_target": smallest_certifiable_risk(s[cal], yc, delta),
                "participation_at_target": point.participation if point.feasible else 0.0,
                "risk_target": risk_target,
                "delta": delta,
            }
        out[name] = entry
    if reference in draws:
        for name, entry in out.items():
            if name == reference:
                continue
            entry["auroc_diff"] = out[reference]["auroc"] - entry["auroc"]
            entry["auroc_diff_ci"] = _interval(draws[reference] - draws[name])
            ref_w, other_w = within.get(reference), within.get(name)
            if ref_w and other_w and ref_w[1] is not None and other_w[1] is not None:
                entry["within_diff"] = ref_w[0] - other_w[0]
                entry["within_diff_ci"] = _interval(ref_w[1] - other_w[1])
    return {
        "reference": reference,
        "n_correct": int(y.sum()),
        "n_incorrect": int(y.size - y.sum()),
        "n_groups_used": n_groups,
        "method": "paired class-stratified percentile bootstrap, same resamples for all scorers",
        "n_boot": int(n_boot),
        "scorers": out,
    }
