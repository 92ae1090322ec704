"""The certifiable frontier of a calibration set: which risk targets it can certify.

Per δ, the certified calibration participation for each ε and the smallest ε certified at
all (:func:`~.conformal.risk_threshold`); the guard refuses a target below it
(:class:`~abstain_guard.errors.UncertifiableTargetError`) unless told to abstain on
everything.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.guarantee import conformal

FRONTIER_DELTAS: tuple[float, ...] = (0.05, 0.1, 0.2)
"""δ values the report and ``evaluate`` show."""

FRONTIER_TARGETS: tuple[float, ...] = (*(round(0.05 * i, 2) for i in range(1, 13)), 0.7, 0.8, 0.9)
"""ε values the frontier table shows: 0.05, 0.10, …, 0.60, 0.7, 0.8, 0.9."""

_SEARCH_TARGETS: tuple[float, ...] = tuple(round(0.01 * i, 2) for i in range(1, 100))


@dataclass(frozen=True)
class FrontierPoint:
    """One (ε, δ) of the frontier: the certified threshold and the fraction of calibration
    answers under it (``-inf`` and 0 when infeasible)."""

    risk_target: float
    delta: float
    feasible: bool
    participation: float
    threshold: float


def _point(
    scores: np.ndarray,
    correct: np.ndarray,
    eps: float,
    delta: float,
    human: ArrayLike | None = None,
) -> FrontierPoint:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        res = conformal.risk_threshold(scores, correct, eps, delta, human=human)
    return FrontierPoint(eps, delta, res.feasible, res.participation, res.threshold)


def certifiable_frontier(
    scores: ArrayLike,
    correct: ArrayLike,
    risk_targets: Sequence[float] = FRONTIER_TARGETS,
    deltas: Sequence[float] = FRONTIER_DELTAS,
) -> list[FrontierPoint]:
    """Certified calibration participation for every ``(ε, δ)``, δ-major order, from scores
    and labels ``[n]`` (both classes)."""
    s = np.asarray(scores, dtype=np.float64)
    c = np.asarray(correct)
    return [_point(s, c, float(e), float(d)) for d in deltas for e in risk_targets]


def smallest_certifiable_risk(
    scores: ArrayLike, correct: ArrayLike, delta: float, human: ArrayLike | None = None
) -> float | None:
    """The smallest ε on a 0.01 grid that ``(scores, correct)`` certifies at ``delta`` (on the
    truth with ``human``, as :func:`~.conformal.risk_threshold`), or ``None`` when no ε < 1
    is certified."""
    s = np.asarray(scores, dtype=np.float64)
    c = np.asarray(correct)
    for eps in _SEARCH_TARGETS:
        if _point(s, c, eps, delta, human).feasible:
            return eps
    return None


def perfect_scorer_certifies(n: int, risk_target: float, delta: float) -> bool:
    """Whether ``n`` calibration answers can certify ``risk_target`` at ``delta`` even in the
    best case: every answer but the least confident one is right, and the scorer ranks them
    perfectly. ``False`` means no scorer and no model can make this calibration size work.
    """
    if n < 2:
        return False
    correct = np.ones(n, dtype=bool)
    correct[-1] = False
    return _point(np.arange(n, dtype=np.float64), correct, risk_target, delta).feasible


def frontier_document(
    scores: ArrayLike,
    correct: ArrayLike,
    risk_targets: Sequence[float] = FRONTIER_TARGETS,
    deltas: Sequence[float] = FRONTIER_DELTAS,
    candidates: int = 1,
) -> dict[str, Any]:
    """The frontier as JSON: ``{"n", "risk_targets", "deltas", "participation": {δ: [p per
    ε]}, "smallest": {δ: ε or None}, "method", "candidates"}`` (δ keys as strings;
    participation 0 where nothing is certified).

    ``candidates``: K, the scorers this one was chosen among on these answers
    (:mod:`abstain_guard.guarantee.selection`); every δ is then certified at δ/K, as the guard does.
    """
    s = np.asarray(scores, dtype=np.float64)
    c = np.asarray(correct)
    k = max(1, int(candidates))
    levels = [float(d) / k for d in deltas]
    points = certifiable_frontier(s, c, risk_targets, levels)
    by_delta: dict[str, list[float]] = {f"{d:g}": [] for d in deltas}
    for i, p in enumerate(points):
        by_delta[f"{deltas[i // len(risk_targets)]:g}"].append(
            p.participation if p.feasible else 0.0
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        method = conformal.risk_threshold(s, c, float(risk_targets[-1]), float(deltas[0])).method
    return {
        "n": int(s.size),
        "risk_targets": [float(e) for e in risk_targets],
        "deltas": [float(d) for d in deltas],
        "participation": by_delta,
        "smallest": {f"{d:g}": smallest_certifiable_risk(s, c, float(d) / k) for d in deltas},
        "method": method,
        "candidates": k,
    }
