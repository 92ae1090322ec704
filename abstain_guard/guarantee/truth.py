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
  (:func:`joint_rejects`, which rejects wherever the split one does).

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
from scipy import stats
from scipy.special import gammaln

from abstain_guard.errors import InvalidInputError
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

MISS_SHARE = 0.8
"""Share of a judge-arm test's level spent on the bound of the judge's misses (truly wrong
answers judged right)."""

WRONG_SHARE = 0.05
"""Share spent on the bound of the true errors among the answers judged wrong (the
false-alarm bound F⁻ of a strict judge); the rest goes to the binomial step."""


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
    crit = _largest_rejected(trials, risk_target, plan.level) if trials.size else trials
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


def _log_choose(a: NDArray[np.int64], b: NDArray[np.int64]) -> NDArray[np.float64]:
    return np.asarray(gammaln(a + 1.0) - gammaln(b + 1.0) - gammaln(a - b + 1.0))


def hypergeom_cdf(
    k: ArrayLike, total: ArrayLike, successes: ArrayLike, draws: ArrayLike
) -> NDArray[np.float64]:
    """``P(X ≤ k)`` for ``X ~ Hypergeom(total, successes, draws)``, elementwise (broadcast),
    exact to rounding and much faster than scipy's: summed from whichever end of the support
    is nearer (``1 − P(draws − X ≤ draws − k − 1)`` above the middle)."""
    k, big, s, d = (
        np.asarray(x, dtype=np.int64) for x in np.broadcast_arrays(k, total, successes, draws)
    )
    flip = 2 * k > d
    out = np.empty(k.shape, dtype=np.float64)
    out[~flip] = _lower_tail(k[~flip], big[~flip], s[~flip], d[~flip])
    out[flip] = 1.0 - _lower_tail(d[flip] - k[flip] - 1, big[flip], big[flip] - s[flip], d[flip])
    return np.clip(out, 0.0, 1.0)


def _lower_tail(
    k: ArrayLike, total: ArrayLike, successes: ArrayLike, draws: ArrayLike
) -> NDArray[np.float64]:
    """:func:`hypergeom_cdf` by summing the mass upward from the support's low end in log
    space, each term from the last by the pmf's ratio (as many steps as k)."""
    k, big, s, d = (
        np.asarray(x, dtype=np.int64) for x in np.broadcast_arrays(k, total, successes, draws)
    )
    lo = np.maximum(0, d - (big - s))
    hi = np.minimum(np.minimum(k, s), d)
    out = np.where(k >= np.minimum(s, d), 1.0, 0.0)
    idx = np.flatnonzero((hi >= lo) & (out < 1.0))
    j = lo.ravel()[idx]
    bf, sf, df, hf = (x.ravel()[idx] for x in (big, s, d, hi))
    logp = _log_choose(sf, j) + _log_choose(bf - sf, df - j) - _log_choose(bf, df)
    acc = logp.copy()
    flat = out.reshape(-1)
    while idx.size:
        done = j >= hf
        flat[idx[done]] = np.exp(acc[done])
        keep = ~done
        idx, j, bf, sf, df, hf = idx[keep], j[keep], bf[keep], sf[keep], df[keep], hf[keep]
        logp, acc = logp[keep], acc[keep]
        logp = logp + np.log((sf - j) * (df - j)) - np.log((j + 1) * (bf - sf - df + j + 1))
        acc = np.logaddexp(acc, logp)
        j = j + 1
    return np.minimum(flat.reshape(out.shape), 1.0)


def error_upper_bound(
    observed: ArrayLike, sample: ArrayLike, population: ArrayLike, level: float
) -> NDArray[np.int64]:
    """Exact upper confidence bound of the count M of marked answers among ``population``,
    from ``observed`` marked among a uniformly random ``sample`` of them (elementwise):
    ``max{M : P(Hypergeom(population, M, sample) ≤ observed) ≥ level}``, so that
    ``P(M > bound) ≤ level``. Bisection over M (the tail falls as M grows)."""
    u, h, t0 = (
        np.asarray(x, dtype=np.int64) for x in np.broadcast_arrays(observed, sample, population)
    )
    lo = u.copy()  # P(X <= u | M = u) = 1
    hi = t0 - (h - u)  # the unseen ones all marked
    while True:
        active = lo < hi
        if not active.any():
            return lo
        mid = (lo + hi + 1) // 2
        ok = hypergeom_cdf(u, t0, np.where(active, mid, lo), h) >= level
        lo = np.where(active & ok, mid, lo)
        hi = np.where(active & ~ok, mid - 1, hi)


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


def _largest_rejected(t: NDArray[np.int64], risk_target: float, level: float) -> NDArray[np.int64]:
    """The largest error count z with ``P(Binomial(t, ε) ≤ z) ≤ level`` (-1: none), per t."""
    grid = np.arange(int(t.max()) + 1 if t.size else 1)
    z = stats.binom.ppf(level, grid, risk_target).astype(np.int64)
    z = np.where(binomial_p_values(z, grid, risk_target) <= level, z, z - 1)
    return z[t]


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
    allowed = _largest_rejected(c.t, risk_target, binomial) - _wrong_bound(c, WRONG_SHARE * level)
    t0 = c.t - c.t1
    most = t0 - (c.h0 - c.u)  # every unreviewed judged-right answer missed
    tail = hypergeom_cdf(c.u, t0, np.clip(allowed + 1, 0, most), c.h0)
    ok = (allowed >= most) | ((allowed >= c.u) & (tail < MISS_SHARE * level))
    return np.asarray(ok & ~c.outside & (c.t > 0))


@dataclass(frozen=True)
class RankCounts:
    """What the judge arm's joint test reads below one rank: t0 answers judged right and t1
    judged wrong, h0 / h1 of them reviewed, u misses and g true errors among those."""

    t0: int
    t1: int
    h0: int
    h1: int
    u: int
    g: int


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


def _pmf_rows(
    total: int, marked: NDArray[np.int64], h: int, upto: int | None = None
) -> NDArray[np.float64]:
    """``P(X = x)`` for x = 0..``upto`` (h), X ~ Hypergeom(total, K, h), one row per K of
    ``marked``: ``[len(marked), upto + 1]``."""
    x = np.arange((h if upto is None else upto) + 1)[None, :]
    k = np.asarray(marked, dtype=np.int64)[:, None]
    ok = (x <= k) & (h - x <= total - k) & (x <= h)
    xs, rest = np.where(ok, x, 0), np.where(ok, h - x, 0)
    whole = _log_choose(np.array([total]), np.array([h]))
    logp = _log_choose(k + 0 * x, xs) + _log_choose(total - k + 0 * x, rest) - whole
    return np.where(ok, np.exp(np.where(ok, logp, 0.0)), 0.0)


def _cdf_rows(
    total: int, marked: NDArray[np.int64], h: int, upto: int | None = None
) -> NDArray[np.float64]:
    """``P(X ≤ x)`` over the same grid as :func:`_pmf_rows`."""
    return np.minimum(np.cumsum(_pmf_rows(total, marked, h, upto), axis=1), 1.0)


def _upper_bound(x: int, h: int, total: int, level: float) -> int:
    """The largest K with ``P(Hypergeom(total, K, h) ≤ x) ≥ level`` (:func:`error_upper_bound`
    of one count; ``total`` when h = 0, -1 when x < 0)."""
    if x < 0:
        return -1
    lo, hi = x, total - (h - x)  # the tail is 1 at K = x and falls in K
    while lo < hi:  # a 64-way search: two or three rounds
        ks = np.unique(np.linspace(lo, hi, 65).round().astype(np.int64))
        ok = _cdf_rows(total, ks, h, x)[:, x] >= level
        last = int(np.flatnonzero(ok)[-1])
        lo, hi = int(ks[last]), (int(ks[last + 1]) - 1 if last + 1 < ks.size else hi)
    return lo


@functools.lru_cache(maxsize=1 << 14)
def _bound_vector(h: int, total: int, level: float) -> NDArray[np.float64]:
    """:func:`_upper_bound` for x = 0..h at once, ``[h + 1]`` (``total`` at x = h), by
    bisection of every x together."""
    x = np.arange(h + 1)
    lo, hi = x.copy(), total - (h - x)
    while (active := lo < hi).any():
        mid = np.where(active, (lo + hi + 1) // 2, lo)
        ok = _cdf_rows(total, mid, h)[x, x] >= level
        lo, hi = np.where(active & ok, mid, lo), np.where(active & ~ok, mid - 1, hi)
    out = lo.astype(np.float64)
    out.flags.writeable = False
    return out


def _largest_at_most(v: NDArray[np.float64], h: int, total: int, level: float) -> NDArray[np.int64]:
    """For each v, the largest x in 0..h with ``_upper_bound(x, h, total, level) ≤ v`` (-1:
    none), ``[len(v)]``, without the bounds themselves: the bound is ≤ v exactly when
    ``P(Hypergeom(total, ⌊v⌋ + 1, h) ≤ x) < level`` (or ⌊v⌋ ≥ total), a prefix of x."""
    k = np.floor(np.asarray(v, dtype=np.float64)).astype(np.int64) + 1
    count = (_cdf_rows(total, np.clip(k, 0, total), h) < level).sum(axis=1)
    return np.where(k > total, h, count - 1)


def joint_rejects(counts: RankCounts, critical: int, level: float) -> bool:
    """The judge arm's joint test at one rank at ``level`` a: True when every feasible
    (M, G) with M + G > ``critical`` (c, the binomial step's count at (1 − 0.85)·a) has
    ``p(M, G) = P(T(u', g') ≤ T(u, g) | M, G) ≤ 0.85·a``, T = M⁺ + G⁺ the split test's own
    bound (:data:`MISS_SHARE`·a, :data:`WRONG_SHARE`·a) and u' ~ Hypergeom(t0, M, h0),
    g' ~ Hypergeom(t1, G, h1) independent given h0 / h1 (docs/guarantees.md, section 5,
    "The joint test"). It rejects wherever :func:`judge_rejections` does. p falls in M and in
    G, so its largest value over M + G > c lies on M = max(u, c + 1 − G)."""
    t0, t1, h0, h1, u, g = (counts.t0, counts.t1, counts.h0, counts.h1, counts.u, counts.g)
    beta, a_miss = (MISS_SHARE + WRONG_SHARE) * level, MISS_SHARE * level
    if critical < 0 or t0 + t1 == 0:
        return False
    b = _bound_vector(h1, t1, WRONG_SHARE * level)
    obs = _upper_bound(u, h0, t0, a_miss) + b[g] + 1e-9
    # p(M, G) ≤ each marginal tail: (M, G) where one of them is ≤ beta need no sum
    a_0 = _upper_bound(0, h0, t0, a_miss)
    g_top = _upper_bound(int(np.searchsorted(b, obs - a_0, "right")) - 1, h1, t1, beta)
    u_top = int(_largest_at_most(np.array([obs - b[0]]), h0, t0, a_miss)[0])
    gs = np.arange(g, min(t1 - h1 + g, g_top) + 1, dtype=np.int64)
    ms = np.maximum(u, critical + 1 - gs)
    keep = ms <= min(t0 - h0 + u, _upper_bound(u_top, h0, t0, beta))
    if not keep.any():
        return True  # every truth with more than c errors is infeasible or excluded
    # largest u' with A[u'] ≤ obs − B[g'], for the g' where one is (it falls in g')
    largest_u = _largest_at_most(obs - b, h0, t0, a_miss)
    largest_u = largest_u[largest_u >= 0]
    cdf_u = _cdf_rows(t0, ms[keep], h0, int(largest_u[0]))  # [nG, largest_u[0] + 1]
    p = (_pmf_rows(t1, gs[keep], h1, largest_u.size - 1) * cdf_u[:, largest_u]).sum(axis=1)
    return bool(p.max() <= beta)


def judge_rank_rejects(counts: RankCounts, risk_target: float, level: float) -> bool:
    """The judge arm's test of one rank at ``level`` from its counts alone: the joint test
    (:func:`joint_rejects`) at the binomial step's critical count."""
    t = np.array([counts.t0 + counts.t1])
    step = (1.0 - MISS_SHARE - WRONG_SHARE) * level
    return joint_rejects(counts, int(_largest_rejected(t, risk_target, step)[0]), level)


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
    (:func:`judge_p_values`), lowered to a level wherever :func:`joint_rejects` rejects
    there. The joint test runs only where the split one does not reject and the plan tests
    next: along each chain past its last split rejection, on each grid rank (for Holm, from
    the highest level down while it rejects, so that the p-value is at most a only where the
    rank is rejected at a)."""
    levels = sorted(set(plan_levels(plan)), reverse=True)
    p = judge_p_values(j, y, risk_target, levels)
    n = p.shape[-1]
    step = 1.0 - MISS_SHARE - WRONG_SHARE
    crit = {a: _largest_rejected(np.arange(n), risk_target, step * a) for a in levels}
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


@dataclass(frozen=True)
class JudgeQuality:
    """How the judge agrees with the people on the reviewed answers (all of them, answered
    or not), with exact 95 % Clopper-Pearson intervals and a bootstrap interval for κ.

    ``lenient_rate``: among truly wrong answers, the share the judge called right (the error
    that inflates a judge-only certificate); ``strict_rate``: among truly right answers,
    the share it called wrong."""

    m: int
    agreement: float
    agreement_ci: tuple[float, float]
    kappa: float
    kappa_ci: tuple[float, float]
    lenient_rate: float | None
    lenient_ci: tuple[float, float] | None
    strict_rate: float | None
    strict_ci: tuple[float, float] | None
    wrong: int
    right: int

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (intervals as lists; None where a class was not reviewed)."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            out[k] = list(v) if isinstance(v, tuple) else v
        return out


def _cp(k: int, n: int) -> tuple[float, float] | None:
    if n == 0:
        return None
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return (float(ci.low), float(ci.high))


def _kappas(j: NDArray[np.int64], y: NDArray[np.int64]) -> NDArray[np.float64]:
    """Cohen's κ of binary labels along the last axis (``[..., m]`` → ``[...]``; 1 where
    both raters give one class only and agree, 0 where chance agreement is total); the core
    needs no scikit-learn."""
    po = (j == y).mean(axis=-1)
    pj, py = j.mean(axis=-1), y.mean(axis=-1)
    pe = pj * py + (1 - pj) * (1 - py)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = (po - pe) / (1 - pe)
    return np.where(pe >= 1.0, np.where(po >= 1.0, 1.0, 0.0), k)


def judge_quality(
    judge_correct: ArrayLike, human: ArrayLike, *, resamples: int = 1000, seed: int = 0
) -> JudgeQuality:
    """The judge's agreement with the human labels ``[n]`` (:func:`check_human_labels`) of
    the reviewed answers, from its labels ``[n]`` (1 correct); κ's percentile interval from
    ``resamples`` seeded bootstrap draws."""
    jc = np.asarray(judge_correct).astype(np.int64)
    hl = check_human_labels(human, jc.size)
    keep = hl >= 0
    j, y = jc[keep], hl[keep].astype(np.int64)
    m = int(keep.sum())
    agree = int((j == y).sum())
    wrong = int((y == 0).sum())
    right = m - wrong
    lenient = int(((y == 0) & (j == 1)).sum())
    strict = int(((y == 1) & (j == 0)).sum())
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, m, size=(resamples, m))
    boot = _kappas(j[draws], y[draws])
    return JudgeQuality(
        m=m,
        agreement=agree / m,
        agreement_ci=_cp(agree, m) or (0.0, 1.0),
        kappa=float(_kappas(j, y)),
        kappa_ci=(float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))),
        lenient_rate=lenient / wrong if wrong else None,
        lenient_ci=_cp(lenient, wrong),
        strict_rate=strict / right if right else None,
        strict_ci=_cp(strict, right),
        wrong=wrong,
        right=right,
    )


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
