"""How many labels to collect: the participation ``n`` calibration answers certify.

Before anyone labels, a team knows (or guesses) three things: the accuracy of its model on
its questions, how well the scorer ranks right answers first (an AUROC, or an existing
artifact's stored scores) and the risk target it wants (ε, δ). :func:`label_plan` draws
calibration sets of each size from that scenario, runs the guard's own risk procedure
(:func:`abstain_guard.guarantee.conformal.risk_threshold`) on each, and reports the
participation it certifies: the median and the 10th / 90th percentiles over draws, and how
often anything at all is certified.

Binormal scores (the usual ROC model; Hanley & McNeil, 1982): right answers' scores are
``N(0, 1)``, wrong answers' ``N(d, 1)`` with ``d = √2 Φ⁻¹(AUROC)``, so lower is more
confident, as for every scorer of the library. With an artifact, each draw resamples its
stored calibration (score, label) pairs with replacement.

The plan is a simulation of the scenario, not a guarantee: the certificate a real
calibration set gets is computed on that set; the plan only says how large it should be.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.special import ndtr, ndtri

from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee import conformal, risk_control

__all__ = [
    "DEFAULT_PLAN_SIZES",
    "LabelPlan",
    "PlanRow",
    "PlanScenario",
    "binormal_limit",
    "binormal_separation",
    "label_plan",
]

DEFAULT_PLAN_SIZES: tuple[int, ...] = (100, 200, 300, 500, 1000, 2000, 5000)
"""Calibration sizes a plan reports when none are given."""

Draw = Callable[[np.random.Generator, int], tuple[NDArray[np.float64], NDArray[np.bool_]]]
"""``draw(rng, n) -> (scores [n], correct [n])``: one simulated calibration set."""


@dataclass(frozen=True)
class PlanScenario:
    """What the plan assumes: the risk target, and either a binormal scorer (``accuracy``,
    ``auroc``) or an artifact's stored calibration (``source``)."""

    risk_target: float
    delta: float
    accuracy: float
    auroc: float | None = None
    source: str = "binormal"
    method: str = risk_control.DEFAULT_RISK_METHOD


@dataclass(frozen=True)
class PlanRow:
    """The participation certified at one calibration size, over the plan's draws."""

    n: int
    median: float
    low: float  # 10th percentile
    high: float  # 90th percentile
    certified: float  # share of draws that certify any threshold


@dataclass(frozen=True)
class LabelPlan:
    """Result of :func:`label_plan`: one row a calibration size, smallest first."""

    scenario: PlanScenario
    rows: tuple[PlanRow, ...]
    draws: int
    seed: int
    limit: float | None  # the participation an unlimited binormal calibration certifies

    def n_for(self, participation: float) -> int | None:
        """The smallest planned size whose median certified participation reaches
        ``participation`` (None: none of the planned sizes does)."""
        return next((r.n for r in self.rows if r.median >= participation), None)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def binormal_separation(auroc: float) -> float:
    """``d`` with ``P(wrong score > right score) = auroc`` for ``N(0,1)`` vs ``N(d,1)``."""
    if not 0.5 <= auroc < 1.0:
        raise InvalidInputError(
            f"auroc={auroc} is outside [0.5, 1): give the scorer's AUROC on held-out answers "
            "(0.5 ranks at random), or --artifact to resample its stored scores"
        )
    return float(math.sqrt(2.0) * ndtri(auroc))


def binormal_limit(accuracy: float, auroc: float, risk_target: float) -> float:
    """The population participation at the largest threshold whose error rate among
    answered is ε: what calibration certifies as ``n`` grows (0 when none is)."""
    d = binormal_separation(auroc)
    grid = np.linspace(-8.0, 8.0 + d, 20001)
    right = accuracy * ndtr(grid)
    wrong = (1.0 - accuracy) * ndtr(grid - d)
    answered = right + wrong
    risk = np.divide(wrong, answered, out=np.ones_like(answered), where=answered > 0)
    ok = np.flatnonzero(risk <= risk_target)
    return float(answered[ok[-1]]) if ok.size else 0.0


def _binormal_draw(accuracy: float, auroc: float) -> Draw:
    d = binormal_separation(auroc)

    def draw(rng: np.random.Generator, n: int) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
        correct = rng.random(n) < accuracy
        return rng.normal(size=n) + np.where(correct, 0.0, d), correct

    return draw


def _resample_draw(scores: NDArray[np.float64], correct: NDArray[np.bool_]) -> Draw:
    def draw(rng: np.random.Generator, n: int) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
        pick = rng.integers(0, scores.size, size=n)
        return scores[pick], correct[pick]

    return draw


def _certified(
    scenario: PlanScenario, scores: NDArray[np.float64], correct: NDArray[np.bool_]
) -> float:
    if correct.all() or not correct.any():  # one class: calibration refuses such a set
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        res = conformal.risk_threshold(
            scores, correct, scenario.risk_target, scenario.delta, scenario.method
        )
    return res.participation if res.feasible else 0.0


def _row(
    scenario: PlanScenario, draw: Draw, n: int, draws: int, rng: np.random.Generator
) -> PlanRow:
    got = np.array([_certified(scenario, *draw(rng, n)) for _ in range(draws)])
    low, median, high = np.quantile(got, [0.1, 0.5, 0.9])
    return PlanRow(n, float(median), float(low), float(high), float(np.mean(got > 0)))


def label_plan(
    scenario: PlanScenario,
    sizes: Sequence[int] = DEFAULT_PLAN_SIZES,
    draws: int = 200,
    seed: int = 0,
    stored: tuple[NDArray[np.float64], NDArray[np.bool_]] | None = None,
) -> LabelPlan:
    """Simulate the participation each calibration size in ``sizes`` certifies.

    Args:
        scenario: the risk target and the scorer's quality (``auroc`` for binormal scores).
        sizes: calibration sizes to plan for (labelled answers, judge or human).
        draws: simulated calibration sets a size.
        seed: the simulation's seed (the plan is reproducible).
        stored: an artifact's calibration ``(scores [N], correct [N])`` to resample
            instead of binormal scores (``scenario.auroc`` is then ignored).
    """
    if draws < 1 or not sizes or min(sizes) < 1:
        raise InvalidInputError("a plan needs draws >= 1 and calibration sizes >= 1")
    if not 0.0 < scenario.accuracy < 1.0 and stored is None:
        raise InvalidInputError(
            f"accuracy={scenario.accuracy} is outside (0, 1): give the share of right answers "
            "you expect on your questions (a judged pilot of a few dozen answers tells)"
        )
    if stored is not None:
        draw = _resample_draw(np.asarray(stored[0], float), np.asarray(stored[1], bool))
        limit = None
    elif scenario.auroc is None:
        raise InvalidInputError("give the scorer's AUROC (--auroc) or an artifact (--artifact)")
    else:
        draw = _binormal_draw(scenario.accuracy, scenario.auroc)
        limit = binormal_limit(scenario.accuracy, scenario.auroc, scenario.risk_target)
    rng = np.random.default_rng(seed)
    rows = tuple(_row(scenario, draw, int(n), draws, rng) for n in sorted(set(sizes)))
    return LabelPlan(scenario, rows, draws, seed, limit)
