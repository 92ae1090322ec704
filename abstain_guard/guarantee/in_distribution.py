"""Sampled scores hold in distribution: the two-sample check of live against stored scores.

A scorer that samples answers (semantic entropy, EigV, verbalized confidence at a
temperature above 0) gives a question a fresh score each time it is asked: a deployment that
samples as calibration did reproduces the scores' *distribution*, not their bits. The
guarantee needs no more (the new pair is exchangeable with the calibration pairs, sampling
included), and the live check tests exactly that: the null hypothesis that the live scores
and the stored ones are draws from one distribution, by a two-sample Kolmogorov–Smirnov test
(:func:`scipy.stats.ks_2samp`).

When the live scores re-ask the stored questions, the two samples are paired and positively
correlated: the test is then conservative (fewer alarms than its level), never liberal.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from abstain_guard.errors import InsufficientDataError, InvalidInputError

__all__ = ["LIVE_CHECK_LEVEL", "SAMPLED_FAMILIES", "DistributionCheck", "live_matches_stored"]

LIVE_CHECK_LEVEL = 0.01
"""The p-value below which a deployment is said to sample otherwise than calibration."""

SAMPLED_FAMILIES = ("sampling", "blackbox")
"""Scorer families whose scores are sampled: checked in distribution, not one by one."""


@dataclass(frozen=True)
class DistributionCheck:
    """The outcome of :func:`live_matches_stored`.

    Attributes:
        test: the test run (``"ks_2samp"``, two-sided).
        statistic: its statistic (the largest gap between the two empirical CDFs).
        p_value: its p-value under "one distribution".
        n_live, n_stored: the sample sizes.
        level: the level the check was made at.
        passed: ``p_value >= level``.
    """

    test: str
    statistic: float
    p_value: float
    n_live: int
    n_stored: int
    level: float
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the live report's ``summary["in_distribution"]``)."""
        return asdict(self)


def _sample(values: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)):
        raise InvalidInputError(f"The {name} scores hold NaN or infinite values.")
    if arr.size < 2:
        raise InsufficientDataError(f"A two-sample check needs at least 2 {name} scores.")
    return arr


def live_matches_stored(
    live: ArrayLike, stored: ArrayLike, level: float = LIVE_CHECK_LEVEL
) -> DistributionCheck:
    """Whether live scores look like draws from the stored scores' distribution.

    Args:
        live: ``[m]`` scores the deployed guard computed.
        stored: ``[n]`` scores calibration stored (of the same questions, or of others from
            the same distribution).
        level: the test's level, in (0, 1).

    Raises:
        InvalidInputError: a NaN or infinite score, or ``level`` outside (0, 1).
        InsufficientDataError: fewer than 2 scores on a side.
    """
    if not 0.0 < level < 1.0:
        raise InvalidInputError(f"level must be in (0, 1), got {level}.")
    a, b = _sample(live, "live"), _sample(stored, "stored")
    result = stats.ks_2samp(a, b, alternative="two-sided")
    p = float(result.pvalue)
    return DistributionCheck(
        "ks_2samp", float(result.statistic), p, a.size, b.size, level, p >= level
    )
