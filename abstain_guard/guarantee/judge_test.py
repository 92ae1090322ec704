"""The judge arm's test at one rank of the certificate on the truth (:mod:`.truth`): exact
hypergeometric bounds on a marked count from a uniform sample without replacement, the split
bound's shares of a test's level, and the joint test that calibrates the misses' and the
judged wrong's bounds together (docs/guarantees.md, section 5, "Why it holds")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats
from scipy.special import gammaln

from abstain_guard.guarantee.risk_control import binomial_p_values

MISS_SHARE = 0.8
"""Share of a judge-arm test's level spent on the bound of the judge's misses (truly wrong
answers judged right)."""

WRONG_SHARE = 0.05
"""Share spent on the bound of the true errors among the answers judged wrong (the
false-alarm bound F⁻ of a strict judge); the rest goes to the binomial step."""


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


def largest_rejected(t: NDArray[np.int64], risk_target: float, level: float) -> NDArray[np.int64]:
    """The largest error count z with ``P(Binomial(t, ε) ≤ z) ≤ level`` (-1: none), per t."""
    grid = np.arange(int(t.max()) + 1 if t.size else 1)
    z = stats.binom.ppf(level, grid, risk_target).astype(np.int64)
    z = np.where(binomial_p_values(z, grid, risk_target) <= level, z, z - 1)
    return z[t]


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
    "The joint test"). It rejects wherever :func:`.truth.judge_rejections` does. p falls in M and in
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
    return joint_rejects(counts, int(largest_rejected(t, risk_target, step)[0]), level)
