"""The multiple-testing procedures behind risk mode, over ranks of the calibration scores.

Risk mode certifies "among the answers the guard gives, at most ε are wrong, with
probability ≥ 1−δ over the calibration draw". Sort the n calibration answers by score
(ties: incorrect answers first); candidate *rank* k answers the k most confident ones, with
threshold ``U_(k)`` (the k-th smallest score). Rank k carries the null hypothesis
"R(U_(k)) > ε", where ``R(λ) = P(wrong | U ≤ λ)`` is the population error rate among
answered questions, and its p-value (:func:`rank_p_values`) is

    p_k = P(Binomial(k−1, ε) ≤ e_k),   e_k = errors among the k−1 answers ranked below k.

Why k−1 and not k trials: conditionally on ``U_(k) = λ``, the k−1 answers below are i.i.d.
draws from the answered region, each wrong with probability R(λ), so ``e_k`` is
Binomial(k−1, R(λ)) and ``P(p_k ≤ a, R(U_(k)) > ε) ≤ a`` for every level a. The k-th
answer itself sits *at* λ, where the error rate is the local one, not R(λ): counting it
would be anti-conservative wherever the local error rate is below the average (e.g. after
a band of confidently wrong answers). The ranks are a data-dependent grid of thresholds,
which is allowed because every statement is conditional on the order statistics; what must
not depend on the labels is *which* ranks are tested and at which level. Every procedure
here first builds a :class:`RiskPlan` from ``(method, ε, δ, n)`` only, then reads the
p-values. Assumptions: i.i.d. calibration and test questions, almost surely distinct
scores (ties: only the last rank of a tie group is a candidate and the errors are counted
first; the guarantee is proved for distinct scores).

Procedures (``method=``), each controlling the family-wise error over the rank hypotheses;
the certified rank is the largest rejected one:

* ``"fixed_sequence"`` — the original procedure: one chain at level δ from the smallest
  rank that can reject at all, ``(1−ε)^(k−1) ≤ δ`` (:func:`min_rank`). One wrong answer
  among the few most confident ends it.
* ``"fixed_sequence_late"`` — one chain at level δ from :func:`tolerant_rank`, the smallest
  rank whose test still rejects with an error rate of ε/2 (and at least one error) among
  the answers below it.
* ``"fixed_sequence_multistart"`` (the default) — s chains at level δ/s each (Bonferroni
  over chains), starting at ⌈0.3·n⌉, ⌈0.3·n/4⌉, … down to rank 12 (:func:`multistart_starts`),
  each moved up to ``min_rank(ε, δ/s)`` when below it.
* ``"bonferroni"`` — the ranks ⌈j·n/20⌉, j = 1..20 (participation 5 %, 10 %, …, 100 %),
  each tested at δ/20 (:func:`grid_ranks`).
* ``"holm"`` — Holm's step-down over the same grid.

A *chain* tests the candidate ranks start, start+1, …, n in increasing order at one level
and stops at the first non-rejection. Why a chain from any label-free start is valid, with
no assumption on the shape of R (continuous scores, so R is continuous): call a score level
*bad* if R > ε there. If ``U_(start)`` is bad, failing needs the start's own test to reject,
which has probability ≤ level given ``U_(start)``. Otherwise ``U_(start)`` lies in a maximal
good stretch [d, c] with R(d) = R(c) = ε (d the end of the bad stretch below, or the bottom
of the scores); failing needs the chain to pass c, i.e. to reject rank N(c)+1, whose test
uses exactly the N(c) answers with score ≤ c. Given the counts N(d) and N(c) — which
decide whether the start lies in [d, c] — those answers are i.i.d. within (−∞, d] (error
rate R(d) = ε) and within (d, c] (error rate (F(c)R(c) − F(d)R(d))/(F(c) − F(d)) = ε), so
their errors are Binomial(N(c), ε) and the rejection has probability ≤ level. Summing over
the disjoint cases, the chain fails with probability ≤ level. This needs consecutive ranks
(a chain that skips ranks can jump over a good stretch). Bonferroni over the chains (or over
single ranks) adds the levels. Holm is exact when R increases past its first crossing of ε
(the true nulls are then the ranks above a count M, and every p-value is valid given M); for
a general R it is an approximation, checked by ``experiments/risk_control/risk_control.py``.

Every plan except the late start is monotone: a looser ε or δ never certifies fewer
answers (:func:`plan_tests`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy import stats

from abstain_guard.errors import InvalidInputError

__all__ = [
    "DEFAULT_RISK_METHOD",
    "RISK_METHODS",
    "RiskPlan",
    "binomial_p_values",
    "candidate_ranks",
    "grid_ranks",
    "min_rank",
    "multistart_starts",
    "plan_tests",
    "rank_p_values",
    "select_rank",
    "tolerant_rank",
]

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
"""Every procedure by name, with a one-line description (all use exact binomial p-values
over ranks of the calibration scores; see the module docstring for why each is valid)."""

DEFAULT_RISK_METHOD: RiskMethod = "fixed_sequence_multistart"
"""The procedure risk mode uses unless told otherwise: the highest mean certified
participation among the valid procedures in ``experiments/risk_control/risk_control.py``
(docs/guarantees.md)."""

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
    """

    method: str
    kind: Literal["chains", "bonferroni", "holm"]
    ranks: tuple[int, ...]
    level: float

    @property
    def first_rank(self) -> int:
        """The smallest rank the plan can certify (0 when the plan tests nothing)."""
        return self.ranks[0] if self.ranks else 0


# --- label-free ingredients ---------------------------------------------------------------


def min_rank(risk_target: float, level: float) -> int:
    """Smallest rank k whose test (k−1 trials, 0 errors) can reject: (1−ε)^(k−1) ≤ level."""
    x = math.log(level) / math.log1p(-risk_target)
    return 1 + max(0, math.ceil(x - 1e-12 * abs(x)))


def tolerant_rank(risk_target: float, level: float, n: int, tolerance: float = _TOLERANCE) -> int:
    """Smallest rank k ≤ n whose test rejects at ``level`` with ⌈tolerance·ε·(k−1)⌉ errors
    (at least one) among the k−1 answers below it; ``n + 1`` when no rank ≤ n does.

    Starting a chain here instead of at :func:`min_rank` means one early error does not end
    it: the test at the start already tolerates an error rate of ``tolerance · ε``.
    """
    trials = np.arange(1, max(int(n), 1))
    if trials.size == 0:
        return int(n) + 1
    errors = np.ceil(tolerance * risk_target * trials - 1e-9)
    ok = np.flatnonzero(stats.binom.cdf(errors, trials, risk_target) <= level)
    return int(trials[ok[0]]) + 1 if ok.size else int(n) + 1


def multistart_starts(n: int) -> tuple[int, ...]:
    """Chain starts for ``"fixed_sequence_multistart"``, from n alone: ⌈0.3·n⌉, then each
    previous start divided by 4 (rounded up) while it stays ≥ 12; at least one start.

    Why these: for a risk that grows linearly with the participation, a single test is most
    likely to reject about a third of the way to the participation q* where the risk
    reaches ε (maximise (ε − R(q))·√q), and q* is unknown. So the starts are spaced
    geometrically up to q*/3 for q* ≈ 1; the chain from a start then walks up to where its
    tests stop rejecting. The starts depend on n alone (not on ε or δ) so that a looser ε
    or δ never certifies fewer answers (see :func:`plan_tests`).
    """
    starts = [max(1, math.ceil(_TOP_START * n))]
    while math.ceil(starts[-1] / _START_RATIO) >= _MIN_START:
        starts.append(math.ceil(starts[-1] / _START_RATIO))
    return tuple(sorted(starts))


def grid_ranks(n: int, size: int = _GRID_SIZE) -> tuple[int, ...]:
    """The ranks Bonferroni and Holm test: ⌈j·n/size⌉ for j = 1..size (participation levels
    1/size, 2/size, …, 1), distinct; from n alone."""
    return tuple(sorted({math.ceil(j * n / size - 1e-9) for j in range(1, size + 1)}))


def plan_tests(method: str, risk_target: float, delta: float, n: int) -> RiskPlan:
    """The label-free plan of ``method`` for ε = ``risk_target``, δ and n answers.

    Monotone by construction (except ``"fixed_sequence_late"``): a looser ε or δ never
    certifies fewer answers. The grid ranks and the chain starts depend on n alone, the
    levels grow with δ and every p-value falls as ε grows; a start moved up to
    :func:`min_rank` L(ε, level) only moves down for a looser target, and a chain that
    passed L(ε, level) had no error below it (one error already fails there), so the
    looser chain passes the ranks between its new start and L(ε, level) too. The late
    start moves with ε and δ in a way a looser target can pay for. The multi-start level
    δ/s depends on n (s grows at n = 157 and 627), so with a perfect scorer and ε below
    about 2 % slightly more answers can be needed just above those sizes than just below.

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


# --- the tests and the selection (batched over leading axes) --------------------------------


def candidate_ranks(sorted_scores: NDArray[np.float64]) -> NDArray[np.bool_]:
    """``[..., n]`` bool: rank k (position k−1) ends a tie group, so a threshold at its score
    answers exactly the k most confident answers. Input sorted along the last axis."""
    out = np.ones(sorted_scores.shape, dtype=bool)
    out[..., :-1] = sorted_scores[..., 1:] > sorted_scores[..., :-1]
    return out


def rank_p_values(sorted_errors: NDArray[np.integer], risk_target: float) -> NDArray[np.float64]:
    """Exact binomial p-values of "R(U_(k)) > ε" for every rank, ``[..., n]`` → ``[..., n]``.

    Args:
        sorted_errors: 1 where the answer at that position (sorted by score, incorrect first
            within ties) is wrong, shape ``[..., n]``.
        risk_target: ε.

    Returns:
        ``P(Binomial(k−1, ε) ≤ e_k)`` at position k−1, with e_k the errors among the first
        k−1 positions; 1 for rank 1 (no trials).
    """
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
    is > ε" from ``errors`` losses among ``trials`` i.i.d. draws (1 for no trials). The one
    binomial tail of the package: :func:`rank_p_values` (conditional risk over ranks) and
    :mod:`abstain_guard.guarantee.action_risk` (the unconditional action risk) both use it."""
    return np.asarray(stats.binom.cdf(errors, trials, risk_target), dtype=np.float64)


def _chain(
    p_values: NDArray[np.float64], candidate: NDArray[np.bool_], start: int, level: float
) -> NDArray[np.int64]:
    """Largest rank a fixed-sequence chain from ``start`` rejects, ``[..., n]`` → ``[...]``
    (0: none). Candidates ``start, start+1, …`` are tested in order; the first p > level
    stops the chain."""
    ranks = np.arange(1, p_values.shape[-1] + 1)
    tested = candidate & (ranks >= start)
    fails = tested & (p_values > level)
    first_fail = np.where(fails.any(axis=-1), fails.argmax(axis=-1) + 1, ranks.size + 1)
    passed = tested & (ranks < first_fail[..., None])
    return np.asarray(np.where(passed, ranks, 0).max(axis=-1), dtype=np.int64)


def _grid_targets(candidate: NDArray[np.bool_], grid: tuple[int, ...]) -> NDArray[np.int64]:
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
    """Run ``plan`` on the rank p-values: the certified rank and the level of its test.

    Args:
        plan: from :func:`plan_tests` (label-free).
        p_values: :func:`rank_p_values`, shape ``[..., n]``.
        candidate: :func:`candidate_ranks`, shape ``[..., n]``.

    Returns:
        ``(rank [...], level [...])``: the largest rejected rank (0 when none) and the level
        its test was run at (0.0 when none).
    """
    batch = p_values.shape[:-1]
    best = np.zeros(batch, dtype=np.int64)
    level = np.zeros(batch, dtype=np.float64)
    if not plan.ranks:
        return best, level
    if plan.kind == "chains":
        for start in plan.ranks:
            best = np.maximum(best, _chain(p_values, candidate, start, plan.level))
        return best, np.where(best > 0, plan.level, 0.0)
    targets = _grid_targets(candidate, plan.ranks)  # [..., m]
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
