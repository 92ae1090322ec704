"""Sampled scores hold in distribution: the two-sample Kolmogorov–Smirnov check of live
against stored scores (a scorer that samples reproduces its scores' distribution, not their
bits; docs/guarantees.md, "Sampled scores hold in distribution").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from abstain_guard.errors import InsufficientDataError, InvalidInputError

LIVE_CHECK_LEVEL = 0.01
"""The p-value below which a deployment is said to sample otherwise than calibration."""

SAMPLED_FAMILIES = ("sampling", "blackbox")
"""Scorer families whose scores are sampled: checked in distribution, not one by one."""


@dataclass(frozen=True)
class DistributionCheck:
    """The outcome of :func:`live_matches_stored` (``test`` ``"ks_2samp"``, two-sided;
    ``passed``: ``p_value >= level``)."""

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
    """Whether the deployed guard's scores ``[m]`` look like draws from the distribution of
    the ``[n]`` scores calibration stored, at ``level`` in (0, 1).

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
