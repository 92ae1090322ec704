"""How many answers to review: before anyone labels, simulate the certificate on the truth
(:mod:`abstain_guard.guarantee.truth`) on an artifact's own calibration scores and judge
labels, for a rough judge error rate and several review sizes.

The truth is unknown before the review, so each draw makes one that is consistent with the
stated judge quality: a share ``judge_error`` of the calibration answers have the judge's
label flipped, ``lenient_share`` of the flips on answers the judge called right (a lenient
judge: they are truly wrong) and the rest on answers it called wrong, each flip more likely
where the score is high (``where="uncertain"``: real judges err on hard answers; "uniform"
also offered). Then a review of m answers is drawn uniformly and the certificate computed as
the artifact would. The table says, per m, how often the target was certifiable and the
median participation it certified; ``abstain-guard review-size`` prints it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard.guarantee import conformal

__all__ = ["ReviewSizeRow", "review_size_table", "simulated_truth"]


@dataclass(frozen=True)
class ReviewSizeRow:
    """One review size's result over the simulated draws."""

    m: int
    certifiable: float
    median_participation: float
    draws: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def simulated_truth(
    rng: np.random.Generator,
    scores: ArrayLike,
    judge_correct: ArrayLike,
    judge_error: float,
    lenient_share: float = 0.5,
    where: Literal["uncertain", "uniform"] = "uncertain",
) -> np.ndarray:
    """A truth consistent with a judge that errs on ``judge_error`` of the answers (module
    docstring): bool ``[n]``, True = truly correct."""
    s = np.asarray(scores, dtype=np.float64)
    j = np.asarray(judge_correct).astype(bool)
    n = s.size
    flips = round(judge_error * n)
    weight = np.argsort(np.argsort(s)) + 1.0 if where == "uncertain" else np.ones(n)
    truth = j.copy()
    for pool, count in (
        (np.flatnonzero(j), round(flips * lenient_share)),
        (np.flatnonzero(~j), flips - round(flips * lenient_share)),
    ):
        count = min(count, pool.size)
        if count:
            w = weight[pool] / weight[pool].sum()
            truth[rng.choice(pool, count, replace=False, p=w)] ^= True
    return truth


def review_size_table(
    scores: ArrayLike,
    judge_correct: ArrayLike,
    risk_target: float,
    delta: float,
    judge_error: float,
    sizes: Sequence[int] = (50, 100, 200, 400, 800),
    *,
    draws: int = 100,
    lenient_share: float = 0.5,
    seed: int = 0,
    scope: float = 1.0,
) -> list[ReviewSizeRow]:
    """For each review size m (those up to n), the share of simulated draws in which
    ``risk_target`` is certifiable on the truth at ``delta`` and the median certified
    participation (module docstring). ``scope``: the review drawn among that share of the
    answers with the lowest scores (``calibrate --review-scope``)."""
    s = np.asarray(scores, dtype=np.float64)
    j = np.asarray(judge_correct).astype(bool)
    rng = np.random.default_rng(seed)
    cutoff = np.sort(s)[max(1, math.ceil(scope * s.size - 1e-9)) - 1]
    eligible = np.flatnonzero(s <= cutoff)
    rows = []
    for m in sorted(x for x in set(sizes) if 0 < x <= eligible.size):
        parts = []
        for _ in range(draws):
            truth = simulated_truth(rng, s, j, judge_error, lenient_share)
            human = np.where(s <= cutoff, -1, -2).astype(np.int8)
            picked = rng.choice(eligible, m, replace=False)
            human[picked] = truth[picked]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", conformal.ConformalWarning)
                res = conformal.risk_threshold(s, j, risk_target, delta, human=human)
            parts.append(res.participation if res.feasible else 0.0)
        arr = np.asarray(parts)
        rows.append(ReviewSizeRow(m, float((arr > 0).mean()), float(np.median(arr)), draws))
    return rows
