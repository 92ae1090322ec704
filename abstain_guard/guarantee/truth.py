"""The certificate on the truth: a judge's labels on every calibration answer plus a human
verdict on a uniformly random sample of them.

Two arms, each a Learn-then-Test certificate with its own label-free plan
(:func:`plan_truth`, from ``(method, ε, δ, n, m)`` only), and the larger of their thresholds
is certified (a union bound: δ in total):

- the *human arm*: the exact Learn-then-Test of :mod:`.risk_control` on the m reviewed
  answers alone, at ``(1 − w)·δ``; the certified threshold is therefore never below the
  human-only one at that level;
- the *judge arm*: on every ⌈n/500⌉-th rank of all n answers, at ``w·δ``, an exact test of
  the true error count from the judge's labels and the reviewed ones: the split bound
  M⁺ + G⁺ (:func:`judge_rejections`, vectorised), and where it does not reject, the same
  statistic calibrated jointly over the misses and the true errors among the judged wrong
  (:func:`.judge_test.joint_rejects`, which rejects wherever the split one does).

w (:func:`judge_share`) comes from ``(method, ε, δ, n, m)`` alone. Why each arm is valid,
for any judge, and the simulations: docs/guarantees.md, section 5. With no review the
judge's labels are certified, and the statement says so (:func:`labels_statement`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee.judge_test import (
    MISS_SHARE,
    WRONG_SHARE,
    RankCounts,
    error_upper_bound,
    hypergeom_cdf,
    joint_rejects,
    largest_rejected,
)
from abstain_guard.guarantee.risk_control import (
    RiskPlan,
    binomial_p_values,
    candidate_ranks,
    chain_tested,
    grid_targets,
    min_rank,
    multistart_starts,
    plan_tests,
    rank_p_values,
    select_rank,
)

#: Value of an answer no person reviewed in a human-label array (1 = correct, 0 = wrong).
NOT_REVIEWED = -1

#: Value of an answer outside the review's scope: a review drawn among part of the answers
#: (``review_scope``) could not have drawn it. Judge-arm ranks with such an answer below them
#: are never certified (the reviewed ones would not be a uniform sample there).
OUT_OF_SCOPE = -2

#: Value of an answer the review's planning read (its judge label chose the scope): it is in
#: neither arm of the certificate.
PLANNING = -3

JUDGE_MIN_REVIEWED = 40
"""A judge-arm chain starts no lower than the rank with this many reviewed answers below it
on average (``40·n/m``): below it the misses' bound is too wide to reject."""


JUDGE_CHAIN_RANKS = 500
"""A judge-arm chain tests every ⌈n/500⌉-th rank from its start (:attr:`RiskPlan.stride`):
its joint test is an exact sum at every rank it tests."""


SHARE_CAP = 0.7
"""The most of δ the judge arm gets (the human arm keeps at least 0.3·δ)."""


def judge_share(method: str, risk_target: float, delta: float, n: int, m: int) -> float:
    """w, the share of δ the judge arm gets, from ``(method, ε, δ, n, m)`` alone
    (docs/guarantees.md, section 5, "The share"): 0 below n/m = 10; from 10 to 25 the
    smaller of a ramp (0.1 at n/m = 10, rising with log(n/m) to 1/2 at 25) and the largest
    share at which every test the human plan starts with keeps its critical error count at
    δ; from 25 on, 1/2 moved up to the end of its plateau (the largest share, at most
    :data:`SHARE_CAP`, whose human plan starts with the same tests and critical counts as at
    δ/2)."""
    ratio = n / max(m, 1)
    if ratio < 10.0:
        return 0.0
    if ratio < 25.0:
        ramp = 0.1 + 0.4 * math.log(ratio / 10.0) / math.log(2.5)
        return min(ramp, _plateau_end(method, risk_target, delta, m, 0.0))
    return _plateau_end(method, risk_target, delta, m, 0.5)


def _start_tests(
    method: str, risk_target: float, level: float, m: int
) -> tuple[tuple[int, ...], tuple[int, ...], float]:
    """The human plan's first tests at ``level``: its start ranks, the largest error count
    each rejects with (-1: none), and the largest binomial tail among those counts (the
    level the plan can fall to with the same first tests)."""
    plan = plan_tests(method, risk_target, level, m)
    trials = np.asarray(plan.ranks, dtype=np.int64) - 1
    crit = largest_rejected(trials, risk_target, plan.level) if trials.size else trials
    tail = binomial_p_values(crit, trials, risk_target) if trials.size else trials
    size = float(np.where(crit >= 0, tail, 0.0).max(initial=0.0)) / plan.level
    return plan.ranks, tuple(int(c) for c in crit), size


def _plateau_end(method: str, risk_target: float, delta: float, m: int, share: float) -> float:
    """The largest w in ``[share, SHARE_CAP]`` whose human plan at ``(1 − w)δ`` starts with
    the same ranks and critical counts as at ``(1 − share)δ`` (``share`` itself when it is
    past the cap): where its first tests stay put the human arm gives up almost nothing, and
    the judge arm gets the level."""
    level = (1.0 - share) * delta
    ranks, crit, size = _start_tests(method, risk_target, level, m)
    end = min(SHARE_CAP, 1.0 - size * (1.0 - share) * (1.0 + 1e-9))
    if end <= share or _start_tests(method, risk_target, (1.0 - end) * delta, m)[:2] != (
        ranks,
        crit,
    ):
        return share
    return end


@dataclass(frozen=True)
class TruthPlan:
    """Both arms' plans, fixed before any label: ``human`` on the m reviewed answers at
    ``(1 − share)·δ``, ``judge`` on all n at ``share·δ`` (None when ``share`` is 0)."""

    human: RiskPlan
    judge: RiskPlan | None
    share: float


def plan_truth(
    method: str, risk_target: float, delta: float, n: int, m: int, eligible: int | None = None
) -> TruthPlan:
    """The certificate's plan from ``(method, ε, δ, n, m)`` (:func:`.risk_control.plan_tests`
    for each arm); ``eligible``: the answers the draw could reach (all n without a scope),
    which w and the judge chains' lowest start read in place of n."""
    reach = n if eligible is None else eligible
    w = judge_share(method, risk_target, delta, reach, m)
    human = plan_tests(method, risk_target, (1.0 - w) * delta, m)
    judge = _judge_plan(method, risk_target, w * delta, (n, reach), m) if w > 0 else None
    return TruthPlan(human, judge, w)


def _judge_plan(
    method: str, risk_target: float, level: float, sizes: tuple[int, int], m: int
) -> RiskPlan:
    """``method``'s plan on n answers (``sizes``: n and the eligible ones), its chains
    started no lower than :data:`JUDGE_MIN_REVIEWED` reviewed answers (merged starts free
    their level)."""
    n, reach = sizes
    base = plan_tests(method, risk_target, level, reach)
    floor = min(math.ceil(JUDGE_MIN_REVIEWED * reach / max(m, 1)), reach)
    stride = math.ceil(n / JUDGE_CHAIN_RANKS)
    if base.kind != "chains" or not base.ranks:
        return base
    if method != "fixed_sequence_multistart":
        return RiskPlan(base.method, "chains", (max(base.ranks[0], floor),), level, stride)
    starts = {max(k, floor) for k in multistart_starts(reach)}
    each = level / len(starts)
    low = min_rank(risk_target, each)
    ranks = tuple(sorted({max(k, low) for k in starts if max(k, low) <= n}))
    return RiskPlan(base.method, "chains", ranks, each, stride)


def check_human_labels(
    values: ArrayLike, n: int, *, require_reviewed: bool = True
) -> NDArray[np.int8]:
    """The human labels as int8 ``[n]``: 1 correct, 0 wrong, :data:`NOT_REVIEWED` (-1),
    :data:`OUT_OF_SCOPE` (-2), :data:`PLANNING` (-3).

    Raises:
        InvalidInputError: another shape, another value, or (``require_reviewed``) no
            reviewed answer at all.
    """
    arr = np.asarray(values)
    if arr.shape != (n,):
        raise InvalidInputError(
            f"human labels must have one entry per calibration answer, shape ({n},); got "
            f"{arr.shape}."
        )
    codes = (PLANNING, OUT_OF_SCOPE, NOT_REVIEWED, 0, 1)
    if arr.dtype.kind not in "biu" or not np.isin(arr, codes).all():
        raise InvalidInputError(
            "human labels must be 1 (correct), 0 (wrong), -1 (not reviewed), -2 (outside "
            "the review's scope) or -3 (read by the review's planning), as integers."
        )
    out = arr.astype(np.int8)
    if require_reviewed and not (out >= 0).any():
        raise InvalidInputError("human labels hold no reviewed answer (all -1).")
    return out


def _below(x: NDArray[Any]) -> NDArray[np.int64]:
    """Counts strictly before each position along the last axis."""
    x = np.asarray(x, dtype=np.int64)
    return np.cumsum(x, axis=-1) - x


@dataclass(frozen=True)
class _Counts:
    """What the judge arm reads below every rank, ``[..., n]`` each: t answers, t1 of them
    judged wrong; h0 / h1 reviewed among the judged right / wrong, u misses and g true errors
    among those."""

    t: NDArray[np.int64]
    t1: NDArray[np.int64]
    h0: NDArray[np.int64]
    u: NDArray[np.int64]
    h1: NDArray[np.int64]
    g: NDArray[np.int64]
    outside: NDArray[np.bool_]


def _counts(sorted_judge_errors: ArrayLike, sorted_truth: ArrayLike) -> _Counts:
    j = np.asarray(sorted_judge_errors, dtype=np.int64)
    y = np.asarray(sorted_truth, dtype=np.int64)
    rev = y >= 0
    t = np.broadcast_to(np.arange(j.shape[-1], dtype=np.int64), j.shape)
    return _Counts(
        t=t,
        t1=_below(j),
        h0=_below(rev & (j == 0)),
        u=_below(rev & (j == 0) & (y == 1)),
        h1=_below(rev & (j == 1)),
        g=_below(rev & (j == 1) & (y == 1)),
        outside=_below(y == OUT_OF_SCOPE) > 0,
    )


def _wrong_bound(c: _Counts, level: float) -> NDArray[np.int64]:
    """G⁺: the bound on the true errors among the t1 judged wrong (t1 where a false alarm was
    never seen, or with no level for it)."""
    out = c.t1.copy()
    seen = (c.g < c.h1) & (level > 0)
    if seen.any():
        out[seen] = error_upper_bound(c.g[seen], c.h1[seen], c.t1[seen], level)
    return out


def judge_rejections(
    sorted_judge_errors: ArrayLike, sorted_truth: ArrayLike, risk_target: float, level: float
) -> NDArray[np.bool_]:
    """The judge arm's test of "the true error rate at U_(k) is > ε" at ``level`` for every
    rank, ``[..., n]`` → ``[..., n]`` bool: the true errors of the t answers below are at
    most ``z = M⁺ + G⁺`` (the misses' bound at :data:`MISS_SHARE` of ``level``, the judged
    wrong's at :data:`WRONG_SHARE`), and the rank is rejected when ``P(Binomial(t, ε) ≤ z)``
    is at most the rest of ``level``. ``sorted_judge_errors``: 1 where the judge called the
    answer wrong; ``sorted_truth``: 1 wrong, 0 correct, -1 not reviewed, -2 out of scope;
    both by score. One hypergeometric tail a rank: ``M⁺ ≤ A`` iff the tail at ``A + 1`` is
    below its level."""
    c = _counts(sorted_judge_errors, sorted_truth)
    binomial = (1.0 - MISS_SHARE - WRONG_SHARE) * level
    allowed = largest_rejected(c.t, risk_target, binomial) - _wrong_bound(c, WRONG_SHARE * level)
    t0 = c.t - c.t1
    most = t0 - (c.h0 - c.u)  # every unreviewed judged-right answer missed
    tail = hypergeom_cdf(c.u, t0, np.clip(allowed + 1, 0, most), c.h0)
    ok = (allowed >= most) | ((allowed >= c.u) & (tail < MISS_SHARE * level))
    return np.asarray(ok & ~c.outside & (c.t > 0))


def rank_counts(c: _Counts, index: tuple[int, ...]) -> RankCounts:
    """The counts of ``c`` at one position (``index`` into its ``[..., n]`` arrays)."""
    t1 = int(c.t1[index])
    return RankCounts(
        int(c.t[index]) - t1,
        t1,
        int(c.h0[index]),
        int(c.h1[index]),
        int(c.u[index]),
        int(c.g[index]),
    )


def judge_errors_bound(
    sorted_judge_errors: ArrayLike, sorted_truth: ArrayLike, rank: int, level: float
) -> int:
    """E⁺, the judge arm's bound on the true errors below ``rank`` at ``level`` (1-D inputs;
    for the reported Clopper-Pearson bound): the smaller of the split bound M⁺ + G⁺ and
    the smallest c at which :func:`joint_rejects` excludes every truth above c."""
    c = _counts(np.asarray(sorted_judge_errors)[:rank], np.asarray(sorted_truth)[:rank])
    k = rank - 1
    t0 = int(c.t[k] - c.t1[k])
    misses = error_upper_bound(c.u[k], c.h0[k], t0, MISS_SHARE * level)
    hi = int(misses) + int(_wrong_bound(c, WRONG_SHARE * level)[k])
    counts = rank_counts(c, (k,))
    lo = counts.u + counts.g - 1  # a truth with c errors is never excluded below it
    while hi - lo > 1:  # joint_rejects(hi) holds; rejection only grows with c
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if joint_rejects(counts, mid, level) else (mid, hi)
    return hi


def judge_p_values(
    sorted_judge_errors: ArrayLike, sorted_truth: ArrayLike, risk_target: float, levels: list[float]
) -> NDArray[np.float64]:
    """For every rank, the smallest of ``levels`` at which :func:`judge_rejections` rejects
    (1 where none does): a p-value valid at each of ``levels``, the only ones a plan of
    :mod:`.risk_control` compares it with."""
    p = np.ones(np.shape(sorted_judge_errors), dtype=np.float64)
    for a in sorted(set(levels), reverse=True):
        p = np.where(judge_rejections(sorted_judge_errors, sorted_truth, risk_target, a), a, p)
    return p


def plan_levels(plan: RiskPlan) -> list[float]:
    """Every level ``plan`` compares a p-value with: its one level, or Holm's δ/m … δ."""
    if plan.kind != "holm":
        return [plan.level]
    m = len(plan.ranks)
    return [plan.level * m / (m - j) for j in range(m)]


@dataclass(frozen=True)
class ArmRanks:
    """Each arm's certified rank among all n answers (0: none), ``[...]`` each, and the
    level of its certifying test; ``human_reviewed``: the human arm's rank among the m
    reviewed answers."""

    human: NDArray[np.int64]
    human_level: NDArray[np.float64]
    human_reviewed: NDArray[np.int64]
    judge: NDArray[np.int64]
    judge_level: NDArray[np.float64]

    @property
    def rank(self) -> NDArray[np.int64]:
        """The certified rank: the larger arm's."""
        return np.maximum(self.human, self.judge)


def reviewed_order(sorted_scores: ArrayLike, sorted_truth: ArrayLike, m: int) -> NDArray[np.int64]:
    """Positions of the m reviewed answers in the full order, ``[..., n]`` → ``[..., m]``,
    by score and, within ties, truly wrong first (every row holds m reviewed answers)."""
    s = np.asarray(sorted_scores, dtype=np.float64)
    y = np.asarray(sorted_truth)
    order = np.lexsort((y != 1, s, y < 0), axis=-1)
    return np.asarray(order[..., :m], dtype=np.int64)


def _tie_ends(candidate: NDArray[np.bool_]) -> NDArray[np.int64]:
    """For every position, the rank that ends its tie group (the next candidate)."""
    n = candidate.shape[-1]
    marked = np.where(candidate, np.arange(1, n + 1), n + 1)
    return np.asarray(np.minimum.accumulate(marked[..., ::-1], axis=-1)[..., ::-1])


def _human_arm(
    plan: RiskPlan, s: NDArray[np.float64], y: NDArray[Any], eps: float, ceiling: float
) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.int64]]:
    """(full rank, level, reviewed rank) of the human-only certificate."""
    m = int(np.count_nonzero(y.reshape(-1, y.shape[-1])[0] >= 0))
    pos = reviewed_order(s, y, m)
    rs = np.take_along_axis(s, pos, axis=-1)
    errors = np.take_along_axis(y, pos, axis=-1).astype(np.int64)
    cand = candidate_ranks(rs) & (rs < ceiling)
    r, level = select_rank(plan, rank_p_values(errors, eps), cand)
    full = np.take_along_axis(_tie_ends(candidate_ranks(s)), pos, axis=-1)
    padded = np.concatenate([np.zeros((*full.shape[:-1], 1), np.int64), full], axis=-1)
    rank = np.take_along_axis(padded, np.asarray(r)[..., None], axis=-1)[..., 0]
    return np.asarray(rank), np.asarray(level), np.asarray(r)


def arm_ranks(
    plan: TruthPlan,
    sorted_scores: ArrayLike,
    sorted_judge_errors: ArrayLike,
    sorted_truth: ArrayLike,
    risk_target: float,
    ceiling: float = math.inf,
) -> ArmRanks:
    """Run both arms of ``plan`` on calibration sets sorted by score, ``[..., n]`` each (ties:
    judged wrong first; every row with the same m reviewed answers): scores, the judge's
    errors (1 wrong), the truth (1 wrong, 0 correct, -1 / -2 as in
    :func:`check_human_labels`). Only thresholds below ``ceiling`` are candidates."""
    s = np.asarray(sorted_scores, dtype=np.float64)
    j = np.asarray(sorted_judge_errors, dtype=np.int64)
    y = np.asarray(sorted_truth, dtype=np.int64)
    human, h_level, h_rev = _human_arm(plan.human, s, y, risk_target, ceiling)
    batch = s.shape[:-1]
    judge, j_level = np.zeros(batch, np.int64), np.zeros(batch, np.float64)
    if plan.judge is not None:
        cand = candidate_ranks(s) & (s < ceiling)
        p = _judge_arm_p_values(plan.judge, j, y, cand, risk_target)
        judge, j_level = select_rank(plan.judge, p, cand)
    return ArmRanks(human, h_level, h_rev, np.asarray(judge), np.asarray(j_level))


def _judge_arm_p_values(
    plan: RiskPlan,
    j: NDArray[np.int64],
    y: NDArray[np.int64],
    candidate: NDArray[np.bool_],
    risk_target: float,
) -> NDArray[np.float64]:
    """The judge arm's p-values ``[..., n]`` where ``plan`` reads them: the split test's
    (:func:`judge_p_values`), lowered to a level wherever :func:`.judge_test.joint_rejects` rejects
    there. The joint test runs only where the split one does not reject and the plan tests
    next: along each chain past its last split rejection, on each grid rank (for Holm, from
    the highest level down while it rejects, so that the p-value is at most a only where the
    rank is rejected at a)."""
    levels = sorted(set(plan_levels(plan)), reverse=True)
    p = judge_p_values(j, y, risk_target, levels)
    n = p.shape[-1]
    step = 1.0 - MISS_SHARE - WRONG_SHARE
    crit = {a: largest_rejected(np.arange(n), risk_target, step * a) for a in levels}
    flat, cand = p.reshape(-1, n).copy(), candidate.reshape(-1, n)
    c = _counts(j.reshape(-1, n), y.reshape(-1, n))
    for row in range(flat.shape[0]):
        test = _JointRow(c, row, crit)
        if plan.kind == "chains":
            _extend_chains(flat[row], cand[row], plan, test.rejects)
            continue
        targets = grid_targets(cand[row], plan.ranks)
        for pos in targets[targets <= n] - 1:
            flat[row, pos] = _lowered(float(flat[row, pos]), levels, test.at(int(pos)))
    return flat.reshape(p.shape)


@dataclass(frozen=True)
class _JointRow:
    """:func:`joint_rejects` on one row of the counts ``[B, n]``, at the critical counts
    ``crit[level]`` ``[n]`` (never at a rank with no answer or an out-of-scope one below)."""

    counts: _Counts
    row: int
    crit: dict[float, NDArray[np.int64]]

    def rejects(self, pos: int, level: float) -> bool:
        c, r = self.counts, self.row
        if c.outside[r, pos] or c.t[r, pos] == 0:
            return False
        return joint_rejects(rank_counts(c, (r, pos)), int(self.crit[level][pos]), level)

    def at(self, pos: int) -> Callable[[float], bool]:
        return functools.partial(self.rejects, pos)


def _extend_chains(
    p: NDArray[np.float64],
    candidate: NDArray[np.bool_],
    plan: RiskPlan,
    joint: Callable[[int, float], bool],
) -> None:
    """Walk each chain of ``plan`` (one row ``[n]``, in place) past its split failures while
    ``joint(position, level)`` rejects there: a rejected position gets the plan's level."""
    decided: dict[int, bool] = {}
    for start in plan.ranks:
        tested = chain_tested(candidate, start, plan.stride)
        for pos in np.flatnonzero(tested & (p > plan.level)).tolist():
            if pos not in decided:
                decided[pos] = joint(pos, plan.level)
                if decided[pos]:
                    p[pos] = plan.level
            if not decided[pos]:
                break


def _lowered(p: float, levels: list[float], rejects: Callable[[float], bool]) -> float:
    """The smallest of ``levels`` (descending) down to which every level is rejected, by the
    split p-value ``p`` or by ``rejects(level)``; ``p`` when the first level is not."""
    out = p
    for a in levels:
        if p > a and not rejects(a):
            break
        out = min(out, a)
    return out


@dataclass(frozen=True)
class CertifyingTest:
    """The test that certified a rank, for the reported Clopper-Pearson bound: ``errors``
    among ``trials`` at ``level``; ``arm``: ``"human"`` or ``"judge"``; ``p_value`` its
    binomial p-value."""

    arm: str
    errors: int
    trials: int
    level: float
    p_value: float


def certifying_test(
    arms: ArmRanks,
    sorted_scores: ArrayLike,
    sorted_judge_errors: ArrayLike,
    sorted_truth: ArrayLike,
    risk_target: float,
) -> CertifyingTest:
    """The test behind ``arms.rank`` (1-D inputs, a certified rank): the judge arm's
    bounded error count at its binomial step, else the reviewed answers' own test."""
    rank = int(arms.rank)
    if int(arms.judge) >= int(arms.human):
        level = float(arms.judge_level)
        z = judge_errors_bound(sorted_judge_errors, sorted_truth, rank, level)
        step = (1.0 - MISS_SHARE - WRONG_SHARE) * level
        return CertifyingTest("judge", z, rank - 1, step, _p(z, rank - 1, risk_target))
    r = int(arms.human_reviewed)
    y = np.asarray(sorted_truth)
    below = y[reviewed_order(sorted_scores, y, r - 1)]
    errors = int((below == 1).sum())
    level = float(arms.human_level)
    return CertifyingTest("human", errors, r - 1, level, _p(errors, r - 1, risk_target))


def _p(errors: int, trials: int, eps: float) -> float:
    return float(binomial_p_values(errors, trials, eps))


def labels_statement(m: int, judge: str | None = None, eligible: int | None = None) -> str:
    """What "wrong" means in a certificate: the people's verdicts (with ``m`` reviewed,
    drawn among ``eligible`` answers when the review had a scope) or the judge's (m = 0)."""
    if m > 0:
        among = (
            f" among the {eligible} calibration answers below the review's score cutoff"
            if eligible is not None
            else ""
        )
        return (
            f"certified on human labels (m = {m} reviewed answers, a uniformly random sample"
            f"{among} drawn by the tool; the larger of the human-only threshold and the "
            "judge-assisted one)"
        )
    who = f" ({judge})" if judge else ""
    return (
        f"certified on the judge's labels{who}, not on the truth: no answer was reviewed by a "
        "person, so the judge's errors pass into the certificate"
    )
