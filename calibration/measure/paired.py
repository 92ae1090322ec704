"""Paired comparisons of scorers on the same held-out answers against a reference scorer
(the artifact's): AUROC and within-type differences with paired bootstrap intervals, paired
DeLong and bootstrap p-values, Holm-adjusted over a report; selective risk and certified
numbers per scorer. What each key holds: docs/results.md, "Paired comparisons"."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import norm, rankdata
from sklearn.metrics import roc_auc_score

from abstain_guard.guarantee.frontier import certifiable_frontier, smallest_certifiable_risk

from .metrics import bootstrap_draws, percentile_interval

PARTICIPATIONS: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5)
"""Participation levels of the selective-risk summary."""

COMPARISONS: tuple[str, ...] = ("auroc_diff", "within_diff")
"""The paired differences of a scorer entry that are tested (overall and within type)."""

FAMILY_ALPHA = 0.05
"""Family-wise error rate of the Holm verdicts."""

NO_DIFFERENCE = f"not significant after Holm at family-wise {FAMILY_ALPHA:g}"
"""The verdict when the Holm-adjusted p-value is above :data:`FAMILY_ALPHA`."""


#: The risk target a report certifies at when the artifact was calibrated without one.
REPORT_RISK_TARGET = 0.35


def bootstrap_p_value(diff_draws: ArrayLike) -> float:
    """Two-sided paired-bootstrap p-value of ``H0: difference = 0`` from the bootstrap draws
    of the difference (reference − other, the same resamples for both scorers):
    ``min(1, 2·min((k_le + 1)/(B + 1), (k_ge + 1)/(B + 1)))`` over the ``B`` finite draws,
    NaN when none is (why it inverts the percentile interval: docs/results.md, 'Paired
    comparisons').
    """
    d = np.asarray(diff_draws, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return float("nan")
    b = d.size
    below = (int(np.count_nonzero(d <= 0.0)) + 1) / (b + 1)
    above = (int(np.count_nonzero(d >= 0.0)) + 1) / (b + 1)
    return float(min(1.0, 2.0 * min(below, above)))


def delong_components(scores: ArrayLike, correct: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """AUROCs ``[k]`` of ``k`` uncertainty scorers (lower = more likely correct) and the
    DeLong covariance of their estimates ``[k, k]`` on the same ``n`` answers.

    DeLong, DeLong & Clarke-Pearson (1988), computed from midranks as Sun & Xu (2014):
    with ``m`` correct and ``q`` wrong answers and ``z = -score``, each correct answer's
    structural component is the share of wrong answers it outranks (ties count ½), each
    wrong answer's the share of correct answers that outrank it; the covariance is
    ``cov(V10)/m + cov(V01)/q``. ``scores`` is ``[k, n]``, one row per scorer.
    """
    z = -np.atleast_2d(np.asarray(scores, dtype=np.float64))
    y = np.asarray(correct, dtype=bool)
    pos, neg = z[:, y], z[:, ~y]
    m, q = pos.shape[1], neg.shape[1]
    if m < 2 or q < 2:
        raise ValueError("DeLong needs at least two correct and two wrong answers")
    tx = rankdata(pos, axis=1)
    ty = rankdata(neg, axis=1)
    tz = rankdata(np.concatenate([pos, neg], axis=1), axis=1)
    aucs = (tz[:, :m].sum(axis=1) / m - (m + 1) / 2.0) / q
    v10 = (tz[:, :m] - tx) / q  # per correct answer: share of wrong ones it outranks
    v01 = 1.0 - (tz[:, m:] - ty) / m  # per wrong answer: share of correct ones above it
    cov = np.atleast_2d(np.cov(v10)) / m + np.atleast_2d(np.cov(v01)) / q
    return aucs, cov


def delong_difference(
    reference: ArrayLike, other: ArrayLike, correct: ArrayLike, groups: ArrayLike | None = None
) -> tuple[float, float, float]:
    """Paired DeLong test of AUROC(reference) − AUROC(other) on the same answers:
    ``(difference, standard error, two-sided p)`` from the normal approximation.

    With ``groups``: the difference of the mean within-group AUROCs over the groups with at
    least two answers of each class; the groups are disjoint, so the variances add
    (``var = Σ var_g / G²``). NaN p when the standard error is 0 (identical rankings)."""
    s = np.vstack([np.asarray(reference, dtype=np.float64), np.asarray(other, dtype=np.float64)])
    y = np.asarray(correct, dtype=bool)
    if groups is None:
        parts = [np.ones(y.size, dtype=bool)]
    else:
        g = np.asarray(groups, dtype=object).astype(str)
        parts = [g == v for v in sorted(set(g.tolist()))]
    diffs, variances = [], []
    for mask in parts:
        yg = y[mask]
        if min(int(yg.sum()), int((~yg).sum())) < 2:
            continue
        aucs, cov = delong_components(s[:, mask], yg)
        diffs.append(float(aucs[0] - aucs[1]))
        variances.append(float(cov[0, 0] + cov[1, 1] - 2.0 * cov[0, 1]))
    if not diffs:
        return float("nan"), float("nan"), float("nan")
    diff = float(np.mean(diffs))
    se = float(np.sqrt(max(0.0, sum(variances)) / len(diffs) ** 2))
    if se == 0.0:
        return diff, se, float("nan")
    return diff, se, float(2.0 * norm.sf(abs(diff) / se))


def holm_adjust(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order (NaN entries stay NaN and are
    not counted in the family).

    With the ``m`` finite p-values sorted ascending ``p_(1) ≤ … ≤ p_(m)``:
    ``adj_(i) = min(1, max_{j ≤ i} (m − j + 1) · p_(j))``. Rejecting every hypothesis with
    ``adj ≤ α`` controls the family-wise error rate at ``α`` under any dependence (Holm 1979);
    the same numbers as ``statsmodels.stats.multitest.multipletests(p, method="holm")[1]``.
    """
    p = np.asarray(p_values, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    m = idx.size
    if m == 0:
        return out.tolist()
    order = idx[np.argsort(p[idx], kind="stable")]
    scaled = (m - np.arange(m)) * p[order]
    out[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return [float(v) for v in out]


def verdict(diff: float, holm_p: float, alpha: float = FAMILY_ALPHA) -> str:
    """``"reference better"`` / ``"baseline better"`` when the Holm-adjusted p-value is at most
    ``alpha`` (the sign of reference − baseline decides which), else ``"not significant
    after Holm at family-wise <alpha>"`` (also for a NaN p-value)."""
    if not np.isfinite(holm_p) or holm_p > alpha or diff == 0:
        return f"not significant after Holm at family-wise {alpha:g}"
    return "reference better" if diff > 0 else "baseline better"


def adjust_family(reports: Sequence[dict[str, Any]], alpha: float = FAMILY_ALPHA) -> dict[str, Any]:
    """Holm-adjust every paired comparison of ``reports`` as one family, in place.

    ``reports`` are :func:`paired_report` results (one per data set of a report). The family is
    every set × every non-reference scorer × each of :data:`COMPARISONS` that has a p-value
    (``<comparison>_p``); each of them gets ``<comparison>_holm_p`` and ``<comparison>_verdict``
    (:func:`verdict`). Comparisons without a p-value are left out of the family and untouched.

    Returns:
        ``{"method": "holm", "alpha", "size", "members", "test"}``: the family's description
        (also stored as ``"family"`` in every report).
    """
    slots: list[tuple[dict[str, Any], str]] = []
    for rep in reports:
        for entry in rep["scorers"].values():
            for comp in COMPARISONS:
                if entry.get(f"{comp}_p") is not None:
                    slots.append((entry, comp))
    adjusted = holm_adjust([float(e[f"{c}_p"]) for e, c in slots])
    for (entry, comp), adj in zip(slots, adjusted, strict=True):
        entry[f"{comp}_holm_p"] = adj
        entry[f"{comp}_verdict"] = verdict(float(entry[comp]), adj, alpha)
    family = {
        "method": "holm",
        "alpha": alpha,
        "size": len(slots),
        "members": "every set x every scorer vs the reference, overall and within type",
        "test": "paired DeLong",
    }
    for rep in reports:
        rep["family"] = dict(family)
    return family


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
        if min(int(yg.sum()), int(yg.size - yg.sum())) < 2:  # as delong_difference's types
            continue
        points.append(float(roc_auc_score(yg, -s[mask])))
        draws.append(bootstrap_draws(s[mask], yg, ("auroc",), n_boot=n_boot, seed=rng)["auroc"])
    if not points:
        return float("nan"), None, 0
    return float(np.mean(points)), np.mean(draws, axis=0), len(points)


def _finite_or_none(p: float) -> float | None:
    """A p-value for the family, or None (left out of it) when it is not finite."""
    return float(p) if np.isfinite(p) else None


def _interval(draws: np.ndarray) -> list[float]:
    return [round(v, 4) for v in percentile_interval(draws)]


@dataclass(frozen=True)
class _Scored:
    """One scorer's ``[n]`` scores, their AUROC bootstrap draws ``[B]`` and, with types,
    :func:`_within_draws`'s ``(mean within-type AUROC, its draws or None, types used)``."""

    scores: np.ndarray
    auroc: float
    draws: np.ndarray
    within: tuple[float, np.ndarray | None, int] | None


def _certified(s: np.ndarray, y: np.ndarray, risk_target: float, delta: float) -> dict[str, Any]:
    """What the calibration split ``s, y`` certifies (:mod:`abstain_guard.guarantee.frontier`)."""
    [point] = certifiable_frontier(s, y, [risk_target], [delta])
    return {
        "n": int(y.size),
        "n_correct": int(y.sum()),
        "smallest_risk_target": smallest_certifiable_risk(s, y, delta),
        "participation_at_target": point.participation if point.feasible else 0.0,
        "risk_target": risk_target,
        "delta": delta,
    }


def _differences(
    ref: _Scored, other: _Scored, y: np.ndarray, groups: np.ndarray | None
) -> dict[str, Any]:
    """Reference − other, overall and (when both have within-type draws) within type: the
    point, its paired interval, DeLong standard error and p, and the bootstrap p."""
    out: dict[str, Any] = {}
    comparisons: list[tuple[str, float, np.ndarray, np.ndarray | None]] = [
        ("auroc_diff", ref.auroc - other.auroc, ref.draws - other.draws, None)
    ]
    if ref.within and other.within and ref.within[1] is not None and other.within[1] is not None:
        within = (ref.within[0] - other.within[0], ref.within[1] - other.within[1], groups)
        comparisons.append(("within_diff", *within))
    for key, point, draws, by in comparisons:
        _, se, p = delong_difference(ref.scores, other.scores, y, groups=by)
        out[key] = point
        out[f"{key}_ci"] = _interval(draws)
        out[f"{key}_se"] = se
        out[f"{key}_p"] = _finite_or_none(p)
        out[f"{key}_bootstrap_p"] = bootstrap_p_value(draws)
    return out


def paired_report(
    scores_by_scorer: Mapping[str, ArrayLike],
    correct: ArrayLike,
    *,
    reference: str,
    groups: Sequence[Any] | None = None,
    calibration: ArrayLike | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    risk_target: float = REPORT_RISK_TARGET,
    delta: float = 0.1,
) -> dict[str, Any]:
    """Paired differences against ``reference`` and per-scorer selective/certified numbers of
    scorer → ``[n]`` uncertainty scores of the same held-out answers, labels ``correct [n]``
    and question types ``groups [n]`` (None entries: no type). The certified numbers, at
    ``(risk_target, delta)``, use only the answers ``calibration [n]`` marks (None: none).
    The p-values are unadjusted; :func:`adjust_family` adds the Holm-adjusted ones across a
    report's sets. What each key holds: docs/results.md, 'Paired comparisons'.
    """
    y = np.asarray(correct, dtype=np.int64)
    g = None if groups is None else np.asarray(groups, dtype=object)
    cal = None if calibration is None else np.asarray(calibration, dtype=bool)
    scored: dict[str, _Scored] = {}
    out: dict[str, Any] = {}
    for name, raw in scores_by_scorer.items():
        s = np.asarray(raw, dtype=np.float64)
        if s.shape != y.shape or not np.all(np.isfinite(s)):
            continue
        one = scored[name] = _Scored(
            s,
            float(roc_auc_score(y, -s)),
            bootstrap_draws(s, y, ("auroc",), n_boot=n_boot, seed=seed)["auroc"],
            None if g is None else _within_draws(s, y, g, n_boot, seed),
        )
        out[name] = entry = {
            "auroc": one.auroc,
            "auroc_ci": _interval(one.draws),
            "selective": selective_risk(s, y),
        }
        if one.within is not None:
            entry["within_auroc"] = one.within[0]
            if one.within[1] is not None:
                entry["within_auroc_ci"] = _interval(one.within[1])
        if cal is not None and cal.any():
            entry["certified"] = _certified(s[cal], y[cal], risk_target, delta)
    if reference in scored:
        for name, entry in out.items():
            if name != reference:
                entry.update(_differences(scored[reference], scored[name], y, g))
    last = next(reversed(scored.values()), None)
    n_groups = 0 if last is None or last.within is None else last.within[2]
    return {
        "reference": reference,
        "n_correct": int(y.sum()),
        "n_incorrect": int(y.size - y.sum()),
        "n_groups_used": n_groups,
        "method": "intervals: paired class-stratified percentile bootstrap, same resamples for "
        "all scorers; tests: paired DeLong (within type: per-type DeLong variances added)",
        "p_value": "*_p: two-sided paired DeLong, normal approximation, unadjusted (the Holm "
        "family's); *_bootstrap_p: min(1, 2*min((k_le+1)/(B+1), (k_ge+1)/(B+1))) over the "
        "difference's B draws, for reference",
        "n_boot": int(n_boot),
        "scorers": out,
    }
