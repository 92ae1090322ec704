"""Validity of the certificate on the truth where it breaks: every fixed rank's rejection
probability by exact enumeration (no Monte Carlo) of every count of labels, judge labels and
draws, under the worst judge; and the whole procedure's family-wise error on a least-favourable
population with enough draws to see 1.2δ."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats
from scipy.special import comb

from abstain_guard.guarantee import judge_test, risk_control, truth


def _configurations(t: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (E, M, F, reviewed counts) for t answers below a rank with h of them reviewed:
    ``counts [C, 8]`` = (A, B, C, D, ra, rb, rc, rd) with A judged right and right, B missed
    (judged right, wrong), C false alarms (judged wrong, right), D judged wrong and wrong, and
    r* the reviewed ones; ``prob [C]`` the draw's probability given the counts."""
    rows = []
    for e in range(t + 1):
        for misses in range(e + 1):
            for alarms in range(t - e + 1):
                group = (t - e - alarms, misses, alarms, e - misses)
                for ra, rb, rc in itertools.product(*(range(min(g, h) + 1) for g in group[:3])):
                    rd = h - ra - rb - rc
                    if 0 <= rd <= group[3]:
                        rows.append((*group, ra, rb, rc, rd))
    counts = np.array(rows, dtype=np.int64)
    prob = np.prod(comb(counts[:, :4], counts[:, 4:]), axis=1) / comb(t, h)
    return counts, prob


def _arrays(counts: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted arrays ``[C, t + 1]`` whose last rank reads exactly these counts below it:
    positions by category (A, B, C, D), the first r* of each category reviewed."""
    ends = np.cumsum(counts[:, :4], axis=1)  # [C, 4]
    i = np.arange(t + 1)[None, :]
    cat = (i[..., None] >= ends[:, None, :]).sum(axis=2)  # [C, t + 1], 4 at the rank itself
    start = np.concatenate([np.zeros((counts.shape[0], 1), np.int64), ends], axis=1)
    within = i - np.take_along_axis(start, np.minimum(cat, 4), axis=1)
    reviewed = within < np.take_along_axis(
        np.concatenate([counts[:, 4:], np.zeros((counts.shape[0], 1), np.int64)], 1),
        np.minimum(cat, 4),
        axis=1,
    )
    j = np.isin(cat, (2, 3)).astype(np.int64)
    y = np.where(reviewed & (cat < 4), np.isin(cat, (1, 3)), -1).astype(np.int64)
    return j, y


def _joint(counts: np.ndarray, eps: float, level: float) -> np.ndarray:
    """The joint test at the rank of each configuration ``[C]``, once per observed counts
    (t0, t1, h0, h1, u, g): the test reads nothing else."""
    seen = np.stack(
        [
            counts[:, 0] + counts[:, 1],
            counts[:, 2] + counts[:, 3],
            counts[:, 4] + counts[:, 5],
            counts[:, 6] + counts[:, 7],
            counts[:, 5],
            counts[:, 7],
        ],
        axis=1,
    )
    keys, where = np.unique(seen, axis=0, return_inverse=True)
    got = [
        judge_test.judge_rank_rejects(judge_test.RankCounts(*map(int, k)), eps, level) for k in keys
    ]
    return np.asarray(got, dtype=bool)[where.ravel()]


def _rejection(
    t: int, h: int, eps: float, risk: float, level: float, judge: str = "worst"
) -> float:
    """P(the rank is rejected, by the split test or the joint one) when the true errors below
    it are Binomial(t, ``risk``): under
    the judge that maximises it (``"worst"``: for each true error count E the worst misses
    and false alarms (M, F), exactly) or a perfect one; ``"naive"``: the worst judge against
    a test that trusts the misses it sees (no bound on the unseen ones)."""
    counts, prob = _configurations(t, h)
    if judge == "naive":
        z = counts[:, 5] + counts[:, 2] + counts[:, 3] - counts[:, 6]
        rejected = stats.binom.cdf(z, t, eps) <= level
    else:
        j, y = _arrays(counts, t)
        rejected = truth.judge_rejections(j, y, eps, level)[:, t] | _joint(counts, eps, level)
    given = np.zeros((t + 1, t + 1, t + 1))
    np.add.at(given, (counts[:, 1] + counts[:, 3], counts[:, 1], counts[:, 2]), prob * rejected)
    each = given[:, 0, 0] if judge == "perfect" else given.reshape(t + 1, -1).max(axis=1)
    return float(np.dot(stats.binom.pmf(np.arange(t + 1), t, risk), each))


@pytest.mark.parametrize(
    ("t", "h", "level"), [(12, 12, 0.1), (12, 12, 0.4), (14, 7, 0.4), (16, 8, 0.1), (16, 8, 0.4)]
)
def test_each_rank_of_the_judge_arm_rejects_a_true_null_at_most_at_its_level(
    t: int, h: int, level: float
) -> None:
    """Exact: every count of true errors, misses, false alarms and reviewed answers of each
    kind, weighted by its probability, the judge choosing the worst (M, F) for each E."""
    eps = 0.5
    for risk in (eps, eps + 0.1):
        assert _rejection(t, h, eps, risk, level) <= level
    # not vacuous: with a perfect judge and a low true risk the rank is rejected
    assert _rejection(t, h, eps, 0.05, level, judge="perfect") > 0.3


def test_the_enumeration_sees_a_broken_test() -> None:
    """The same enumeration on a test that trusts the misses it sees finds a rejection
    probability far above the level."""
    assert _rejection(16, 8, 0.5, 0.5, 0.1, judge="naive") > 0.3


@pytest.mark.parametrize(("h", "level"), [(12, 0.05), (30, 0.1)])
def test_each_rank_of_the_human_arm_rejects_a_true_null_at_most_at_its_level(
    h: int, level: float
) -> None:
    eps = 0.35
    y = np.arange(h + 1)
    for risk in (eps, eps + 0.05):
        # the arm's p-value at a rank with h reviewed answers below and y of them wrong
        errors = np.zeros((h + 1, h + 1), dtype=np.int64)
        for k in y:
            errors[k, :k] = 1
        p = risk_control.rank_p_values(np.concatenate([errors, np.zeros((h + 1, 1), int)], 1), eps)
        assert float(np.dot(stats.binom.pmf(y, h, risk), p[:, h] <= level)) <= level


def _least_favourable(
    rng: np.random.Generator, draws: int, n: int, m: int, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat true risk ε + 0.002 (every certificate is wrong); a judge with no false alarm
    that misses 4 % of the answers, all among the lowest scores."""
    s = np.sort(rng.random((draws, n)), axis=1)
    wrong = rng.random((draws, n)) < eps + 0.002
    missed = wrong & (s < 0.2) & (rng.random((draws, n)) < 0.04 / 0.2 / (eps + 0.002))
    y = np.full((draws, n), -1, dtype=np.int64)
    pick = np.argsort(rng.random((draws, n)), axis=1)[:, :m]
    np.put_along_axis(y, pick, np.take_along_axis(wrong, pick, axis=1).astype(np.int64), 1)
    return s, (wrong & ~missed).astype(np.int64), y


def test_the_family_wise_error_stays_within_delta_on_a_flat_risk() -> None:
    """Each arm and the certificate certify a wrong threshold with probability ≤ its level;
    3,000 draws: the bound δ + 3 s.e. = 0.222 at δ = 0.2 is below 1.2δ."""
    eps, delta, n, m, draws = 0.5, 0.2, 400, 20, 3000
    plan = truth.plan_truth("fixed_sequence_multistart", eps, delta, n, m)
    assert 0.0 < plan.share < 1.0 and plan.judge is not None
    got = truth.arm_ranks(plan, *_least_favourable(np.random.default_rng(0), draws, n, m, eps), eps)
    se = np.sqrt(delta * (1 - delta) / draws)
    assert delta + 3 * se < 1.2 * delta
    human, judge, both = (np.mean(x > 0) for x in (got.human, got.judge, got.rank))
    assert human <= (1 - plan.share) * delta + 3 * se
    assert judge <= plan.share * delta + 3 * se
    assert both <= delta + 3 * se
    assert human > 0  # the judge arm certifies on a favourable population: test_truth_certificate


def _p_value(counts: tuple[int, ...], truth_counts: tuple[int, int], level: float) -> float:
    """The joint test's p(M, G) = P(T(u', g') ≤ T(u, g) | M, G), summed over every (u', g')
    with scipy's hypergeometric law, T = M⁺ + G⁺ at the split test's levels."""
    t0, t1, h0, h1, u, g = counts
    a = judge_test.error_upper_bound(np.arange(h0 + 1), h0, t0, judge_test.MISS_SHARE * level)
    b = judge_test.error_upper_bound(np.arange(h1 + 1), h1, t1, judge_test.WRONG_SHARE * level)
    pu = stats.hypergeom.pmf(np.arange(h0 + 1), t0, truth_counts[0], h0)
    pg = stats.hypergeom.pmf(np.arange(h1 + 1), t1, truth_counts[1], h1)
    below = a[:, None] + b[None, :] <= a[u] + b[g] + 1e-9
    return float((pu[:, None] * pg[None, :] * below).sum())


def _shapes(seed: int, count: int):
    """Small ranks: (t0, t1, h0, h1), a truth (M, G) and a level."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        t0, t1 = (int(x) for x in rng.integers(1, 9, 2))
        h0, h1 = int(rng.integers(0, t0 + 1)), int(rng.integers(0, t1 + 1))
        m, big_g = int(rng.integers(0, t0 + 1)), int(rng.integers(0, t1 + 1))
        yield (t0, t1, h0, h1), (m, big_g), float(rng.choice([0.02, 0.1, 0.3]))


def _outcomes(shape: tuple[int, int, int, int], truth_counts: tuple[int, int]):
    """Every (u, g) the truth can give, with its probability (independent given h0, h1)."""
    t0, t1, h0, h1 = shape
    for u, g in itertools.product(range(h0 + 1), range(h1 + 1)):
        w = stats.hypergeom.pmf(u, t0, truth_counts[0], h0)
        w *= stats.hypergeom.pmf(g, t1, truth_counts[1], h1)
        if w > 0:
            yield (*shape, u, g), float(w)


def test_the_joint_p_value_is_valid_and_a_rejection_excludes_the_truth() -> None:
    """Exact on 150 small ranks: P(p(M, G) ≤ 0.85a) ≤ 0.85a for the true (M, G), and
    whenever the joint test rejects at c = M + G − 1 the truth's p is at most 0.85a."""
    for shape, truth_counts, level in _shapes(0, 150):
        beta = (judge_test.MISS_SHARE + judge_test.WRONG_SHARE) * level
        size = 0.0
        for counts, w in _outcomes(shape, truth_counts):
            p = _p_value(counts, truth_counts, level)
            size += w * (p <= beta)
            if judge_test.joint_rejects(
                judge_test.RankCounts(*counts), sum(truth_counts) - 1, level
            ):
                assert p <= beta + 1e-12, (counts, truth_counts, level)
        assert size <= beta + 1e-12, (shape, truth_counts, level, size)


def test_the_joint_test_rejects_wherever_the_split_test_does() -> None:
    """M⁺ + G⁺ ≤ c implies the joint rejection, on every count of 150 small ranks and every
    c; and the joint test rejects where the split one does not (a strict judge's ranks)."""
    split = joint_only = 0
    for shape, truth_counts, level in _shapes(1, 150):
        for counts, _ in _outcomes(shape, truth_counts):
            t0, t1, h0, h1, u, g = counts
            misses = int(judge_test.error_upper_bound(u, h0, t0, judge_test.MISS_SHARE * level))
            wrong = int(judge_test.error_upper_bound(g, h1, t1, judge_test.WRONG_SHARE * level))
            for c in range(t0 + t1 + 1):
                rejects = judge_test.joint_rejects(judge_test.RankCounts(*counts), c, level)
                if misses + wrong <= c:
                    split += 1
                    assert rejects, (counts, c, level)
                joint_only += rejects and misses + wrong > c
    assert split > 1000 and joint_only > 50
