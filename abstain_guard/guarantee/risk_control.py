"""The multiple-testing procedures behind risk mode, over ranks of the calibration scores.

Rank k (the k most confident answers, threshold ``U_(k)``) carries the null "R(U_(k)) > ε",
tested with ``p_k = P(Binomial(k−1, ε) ≤ e_k)`` (e_k: errors among the k−1 answers below it,
:func:`rank_p_values`). Each procedure first builds a :class:`RiskPlan` from ``(method, ε, δ,
n)`` only (:func:`plan_tests`: which ranks, at which level), then reads the p-values and
certifies the largest rejected rank (:func:`select_rank`). The procedures, why each controls
the family-wise error, and the simulation that chose the default: docs/guarantees.md,
section 3 ("The tests", "The procedures").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from abstain_guard.errors import InvalidInputError

RiskMethod = Literal[
    "fixed_sequence",
    "fixed_sequence_late",
    "fixed_sequence_multistart",
    "bonferroni",
    "holm",
]

RISK_METHODS: dict[str, str] = {
    "fixed_sequence": "one fixed-sequence chain from the smallest rank that can reject, level δ",
    "fixed_sequence_late": "one fixed-sequence chain from the rank that tolerates ε/2 errors, "
    "level δ",
    "fixed_sequence_multistart": "fixed-sequence chains from geometrically spaced starts, "
    "Bonferroni over chains",
    "bonferroni": "Bonferroni over 20 evenly spaced participation levels",
    "holm": "Holm step-down over 20 evenly spaced participation levels",
}
"""Every procedure by name, with a one-line description."""

DEFAULT_RISK_METHOD: RiskMethod = "fixed_sequence_multistart"
"""The procedure risk mode uses unless told otherwise (docs/guarantees.md, "Choosing the
default")."""

_TOLERANCE = 0.5
"""A late start tolerates an error rate of ``_TOLERANCE · ε`` among the answers below it."""
_START_RATIO = 4.0
"""Consecutive multi-start starts differ by about this factor."""
_TOP_START = 0.3
"""The largest multi-start start, as a fraction of n."""
_MIN_START = 12
"""The smallest multi-start start (before moving it up to :func:`min_rank`): below it a
test rejects for ε ≤ 0.2 only with no error at all, which the moved-up start covers."""
_GRID_SIZE = 20
"""Number of participation levels Bonferroni and Holm test (5 %, 10 %, …, 100 %)."""


@dataclass(frozen=True)
class RiskPlan:
    """What a procedure tests, fixed before any label is read: built from
    ``(method, ε, δ, n)`` only (:func:`plan_tests`).

    Attributes:
        method: the procedure's name (a key of :data:`RISK_METHODS`).
        kind: ``"chains"`` (fixed-sequence chains), ``"bonferroni"`` or ``"holm"``.
        ranks: chain starts, or the grid of tested ranks (1-based, increasing, ≤ n; empty
            when nothing can be certified with n answers).
        level: the level of each chain or grid test (δ/s, δ/m); Holm's first step.
        stride: a chain tests the ranks start, start + stride, … (each moved up to the end
            of its tie group); 1: every candidate from its start.
    """

    method: str
    kind: Literal["chains", "bonferroni", "holm"]
    ranks: tuple[int, ...]
    level: float
    stride: int = 1

    @property
    def first_rank(self) -> int:
        """The smallest rank the plan can certify (0 when the plan tests nothing)."""
        return self.ranks[0] if self.ranks else 0


def min_rank(risk_target: float, level: float) -> int:
    """Smallest rank k whose test (k−1 trials, 0 errors) can reject: (1−ε)^(k−1) ≤ level."""
    x = math.log(level) / math.log1p(-risk_target)
    return 1 + max(0, math.ceil(x - 1e-12 * abs(x)))


def tolerant_rank(risk_target: float, level: float, n: int, tolerance: float = _TOLERANCE) -> int:
    """Smallest rank k ≤ n whose test rejects at ``level`` with ⌈tolerance·ε·(k−1)⌉ errors
    (at least one) among the k−1 answers below it; ``n + 1`` when no rank ≤ n does."""
    trials = np.arange(1, max(int(n), 1))
    if trials.size == 0:
        return int(n) + 1
    errors = np.ceil(tolerance * risk_target * trials - 1e-9)
    ok = np.flatnonzero(stats.binom.cdf(errors, trials, risk_target) <= level)
    return int(trials[ok[0]]) + 1 if ok.size else int(n) + 1


def multistart_starts(n: int) -> tuple[int, ...]:
    """Chain starts for ``"fixed_sequence_multistart"``, from n alone: ⌈0.3·n⌉, then each
    previous start divided by 4 (rounded up) while it stays ≥ 12; at least one start
    (docs/guarantees.md, "Which start")."""
    starts = [max(1, math.ceil(_TOP_START * n))]
    while math.ceil(starts[-1] / _START_RATIO) >= _MIN_START:
        starts.append(math.ceil(starts[-1] / _START_RATIO))
    return tuple(sorted(starts))


def grid_ranks(n: int, size: int = _GRID_SIZE) -> tuple[int, ...]:
    """The ranks Bonferroni and Holm test: ⌈j·n/size⌉ for j = 1..size (participation levels
    1/size, 2/size, …, 1), distinct; from n alone."""
    return tuple(sorted({math.ceil(j * n / size - 1e-9) for j in range(1, size + 1)}))


def plan_tests(method: str, risk_target: float, delta: float, n: int) -> RiskPlan:
    """The label-free plan of ``method`` for ε = ``risk_target``, δ and n answers; monotone
    except ``"fixed_sequence_late"`` (docs/guarantees.md, "Monotone").

    Raises:
        InvalidInputError: an unknown method (the message lists the known ones).
    """
    if method == "fixed_sequence":
        return _single_chain(method, min_rank(risk_target, delta), delta, n)
    if method == "fixed_sequence_late":
        k = tolerant_rank(risk_target, delta, n)
        return _single_chain(method, k if k <= n else min_rank(risk_target, delta), delta, n)
    if method == "fixed_sequence_multistart":
        starts = multistart_starts(n)
        level = delta / len(starts)
        low = min_rank(risk_target, level)
        if low > n:
            return RiskPlan(method, "chains", (), level)
        return RiskPlan(method, "chains", tuple(sorted({max(k, low) for k in starts})), level)
    if method in ("bonferroni", "holm"):
        ranks = grid_ranks(n)
        kind: Literal["bonferroni", "holm"] = "bonferroni" if method == "bonferroni" else "holm"
        return RiskPlan(method, kind, ranks, delta / len(ranks))
    raise InvalidInputError(
        f"Unknown risk-control method {method!r}; choose one of {', '.join(RISK_METHODS)} "
        f"(default {DEFAULT_RISK_METHOD!r})."
    )


def _single_chain(method: str, start: int, level: float, n: int) -> RiskPlan:
    return RiskPlan(method, "chains", (start,) if start <= n else (), level)


def candidate_ranks(sorted_scores: NDArray[np.float64]) -> NDArray[np.bool_]:
    """``[..., n]`` bool: rank k (position k−1) ends a tie group, so a threshold at its score
    answers exactly the k most confident answers. Input sorted along the last axis."""
    out = np.ones(sorted_scores.shape, dtype=bool)
    out[..., :-1] = sorted_scores[..., 1:] > sorted_scores[..., :-1]
    return out


def rank_p_values(sorted_errors: NDArray[np.integer], risk_target: float) -> NDArray[np.float64]:
    """Exact binomial p-values of "R(U_(k)) > ε" for every rank, ``[..., n]`` → ``[..., n]``:
    ``P(Binomial(k−1, ε) ≤ e_k)`` at position k−1 of ``sorted_errors`` (1 where wrong; by
    score, incorrect first within ties); 1 for rank 1 (no trials)."""
    err = np.asarray(sorted_errors, dtype=np.int64)
    below = np.cumsum(err, axis=-1) - err  # errors strictly before each position
    trials = np.arange(err.shape[-1])
    p = binomial_p_values(below, trials, risk_target)
    p[..., 0] = 1.0
    return p


def binomial_p_values(
    errors: NDArray[np.integer] | int, trials: NDArray[np.integer] | int, risk_target: float
) -> NDArray[np.float64]:
    """``P(Binomial(trials, ε) ≤ errors)`` elementwise: the exact p-value of "the loss rate
    is > ε" from ``errors`` losses among ``trials`` i.i.d. draws (1 for no trials)."""
    return np.asarray(stats.binom.cdf(errors, trials, risk_target), dtype=np.float64)


def chain_tested(candidate: NDArray[np.bool_], start: int, stride: int = 1) -> NDArray[np.bool_]:
    """``[..., n]`` bool: the ranks a chain from ``start`` tests, in increasing order: every
    candidate from ``start`` on (``stride`` 1), or ranks start, start + stride, … each moved
    up to its tie group's end (:func:`grid_targets`)."""
    n = candidate.shape[-1]
    ranks = np.arange(1, n + 1)
    if stride == 1:
        return candidate & (ranks >= start)
    targets = grid_targets(candidate, tuple(range(start, n + 1, stride)))
    out = np.zeros((*candidate.shape[:-1], n + 1), dtype=bool)
    np.put_along_axis(out, np.minimum(targets, n + 1) - 1, True, axis=-1)
    return out[..., :n]


def _chain(
    p_values: NDArray[np.float64], tested: NDArray[np.bool_], level: float
) -> NDArray[np.int64]:
    """Largest rank a fixed-sequence chain rejects, ``[..., n]`` → ``[...]`` (0: none): the
    ``tested`` ranks (:func:`chain_tested`) in order, the first p > level stopping it."""
    ranks = np.arange(1, p_values.shape[-1] + 1)
    fails = tested & (p_values > level)
    first_fail = np.where(fails.any(axis=-1), fails.argmax(axis=-1) + 1, ranks.size + 1)
    passed = tested & (ranks < first_fail[..., None])
    return np.asarray(np.where(passed, ranks, 0).max(axis=-1), dtype=np.int64)


def grid_targets(candidate: NDArray[np.bool_], grid: tuple[int, ...]) -> NDArray[np.int64]:
    """Each grid rank moved up to the next candidate (the end of its tie group),
    ``[..., n]`` → ``[..., m]``; n + 1 where there is none (never with distinct scores)."""
    n = candidate.shape[-1]
    ranks = np.arange(1, n + 1)
    marked = np.where(candidate, ranks, n + 1)
    next_candidate = np.minimum.accumulate(marked[..., ::-1], axis=-1)[..., ::-1]
    return np.asarray(next_candidate[..., np.asarray(grid) - 1], dtype=np.int64)


def _p_at(p_values: NDArray[np.float64], targets: NDArray[np.int64]) -> NDArray[np.float64]:
    n = p_values.shape[-1]
    padded = np.concatenate([p_values, np.ones((*p_values.shape[:-1], 1))], axis=-1)
    return np.take_along_axis(padded, np.minimum(targets, n + 1) - 1, axis=-1)


def select_rank(
    plan: RiskPlan, p_values: NDArray[np.float64], candidate: NDArray[np.bool_]
) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
    """Run ``plan`` on the rank p-values and candidates ``[..., n]``: ``(rank [...], level
    [...])``, the largest rejected rank and its test's level (0 and 0.0 when none)."""
    batch = p_values.shape[:-1]
    best = np.zeros(batch, dtype=np.int64)
    level = np.zeros(batch, dtype=np.float64)
    if not plan.ranks:
        return best, level
    if plan.kind == "chains":
        for start in plan.ranks:
            tested = chain_tested(candidate, start, plan.stride)
            best = np.maximum(best, _chain(p_values, tested, plan.level))
        return best, np.where(best > 0, plan.level, 0.0)
    targets = grid_targets(candidate, plan.ranks)  # [..., m]
    p = _p_at(p_values, targets)
    m = len(plan.ranks)
    if plan.kind == "bonferroni":
        rejected = p <= plan.level
        steps = np.full(p.shape, plan.level)
    else:  # Holm: the j-th smallest p-value (0-based) is tested at δ/(m−j) while all pass
        delta = plan.level * m
        order = np.argsort(p, axis=-1, kind="stable")
        thresholds = delta / (m - np.arange(m))
        ok = np.take_along_axis(p, order, axis=-1) <= thresholds
        n_rejected = np.where(ok.all(axis=-1), m, (~ok).argmax(axis=-1))
        position = np.argsort(order, axis=-1, kind="stable")  # step at which each is tested
        rejected = position < n_rejected[..., None]
        steps = thresholds[position]
    chosen = np.where(rejected, targets, 0)
    best = chosen.max(axis=-1)
    pick = np.take_along_axis(steps, chosen.argmax(axis=-1)[..., None], axis=-1)[..., 0]
    return np.asarray(best, dtype=np.int64), np.where(best > 0, pick, 0.0)
