"""Property tests (hypothesis) and input validation for abstain_guard.guarantee.conformal."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy import stats

from abstain_guard.errors import InsufficientDataError, InvalidInputError
from abstain_guard.guarantee import conformal
from abstain_guard.guarantee.risk_control import RISK_METHODS, min_rank

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
alphas = st.floats(min_value=0.001, max_value=0.999)
score_lists = st.lists(finite, min_size=1, max_size=200)


@st.composite
def labelled(draw: st.DrawFn, min_size: int = 2, max_size: int = 150) -> tuple:
    n = draw(st.integers(min_value=min_size, max_value=max_size))
    scores = draw(st.lists(finite, min_size=n, max_size=n))
    correct = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    assume(0 < sum(correct) < n)
    return np.asarray(scores), np.asarray(correct)


# --- participation threshold -------------------------------------------------------------


@given(score_lists, alphas)
@settings(max_examples=80, deadline=None)
def test_threshold_is_the_conformal_order_statistic(scores: list[float], alpha: float) -> None:
    n = len(scores)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        res = conformal.participation_threshold(scores, alpha)
    k = res.rank
    # k is the smallest integer with k >= (1-alpha)(n+1) (up to float noise)
    assert k >= (1 - alpha) * (n + 1) - 1e-9 * (n + 1)
    assert k - 1 < (1 - alpha) * (n + 1)
    assert res.n == n and res.alpha == alpha
    if k > n:
        assert res.infinite and res.threshold == math.inf and res.warnings
    else:
        assert not res.infinite and not res.warnings
        assert res.threshold == sorted(scores)[k - 1]
        # at least k calibration scores are <= tau, fewer than k are < tau
        s = np.asarray(scores)
        assert (s <= res.threshold).sum() >= k
        assert (s < res.threshold).sum() < k
    assert res.interval == conformal.participation_interval(alpha, n)


def test_threshold_known_values_and_float_rounding() -> None:
    scores = np.arange(1.0, 10.0)  # n = 9
    # (1 - 0.2) * 10 = 8.000000000000002 in floating point: the rank must still be 8
    res = conformal.participation_threshold(scores, 0.2)
    assert res.rank == 8 and res.threshold == 8.0
    assert conformal.conformal_rank(0.1, 99) == 90
    assert conformal.participation_threshold(scores, 0.5).threshold == 5.0


def test_conformal_rank_handles_float_noise() -> None:
    # alpha from a participation level, as the resplit simulation passes it
    assert conformal.conformal_rank(1 - 0.7, 9) == 7  # 0.7 * 10 = 7.000000000000001 in binary
    assert conformal.conformal_rank(1 - 0.9, 250) == 226
    assert conformal.conformal_rank(1 - 0.9, 5) == 6  # > n: threshold +inf


def test_threshold_infinite_warns_and_flags() -> None:
    with pytest.warns(conformal.ConformalWarning, match="exceeds n"):
        res = conformal.participation_threshold([0.1, 0.2, 0.3], 0.1)
    assert res.infinite and res.threshold == math.inf and res.rank == 4
    assert "calibration scores" in res.warnings[0]


@given(alphas, st.integers(min_value=1, max_value=10_000))
def test_participation_interval(alpha: float, n: int) -> None:
    lo, hi = conformal.participation_interval(alpha, n)
    assert lo == pytest.approx(1 - alpha)
    assert hi - lo == pytest.approx(1 / (n + 1))


# --- conditional correctness bound -------------------------------------------------------


def _brute_force_coverage(scores: np.ndarray, correct: np.ndarray, tau: float) -> float:
    """sup{q in (0,1): Quantile(ceil(q(c+1))/c, U) <= tau} by scanning the rank intervals."""
    u = np.sort(scores[correct])
    c = u.size
    best = 0.0
    # for q in ((j-1)/(c+1), j/(c+1)] the quantile is the j-th smallest (j <= c)
    for j in range(1, c + 1):
        if u[j - 1] <= tau:
            best = max(best, j / (c + 1))
    return best


@given(labelled(), alphas)
@settings(max_examples=80, deadline=None)
def test_conditional_bound_matches_definition(data: tuple, alpha: float) -> None:
    scores, correct = data
    n = scores.size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        res = conformal.conditional_correctness_bound(scores, correct, alpha)
        tau = conformal.participation_threshold(scores, alpha).threshold
    c = int(correct.sum())
    assert res.threshold == tau and res.n == n and res.c == c
    assert res.coverage_correct == pytest.approx(_brute_force_coverage(scores, correct, tau))
    assert res.beta == pytest.approx(1 - res.coverage_correct)
    assert res.accuracy == pytest.approx(c / n)
    assert res.participation_upper == pytest.approx(1 - alpha + 1 / (n + 1))
    expected = res.coverage_correct / (1 - alpha + 1 / (n + 1)) * c / n
    assert res.bound == pytest.approx(expected)
    assert res.bound >= 0.0
    assert res.sigma <= tau
    if res.retained_correct > 0:
        assert res.sigma in set(scores[correct].tolist())
        m = res.retained_correct
        assert res.sigma == np.sort(scores[correct])[m - 1]
    else:
        assert res.sigma == -math.inf and res.bound == 0.0 and res.warnings


# --- risk threshold ------------------------------------------------------------------------


@given(
    labelled(min_size=5, max_size=200),
    st.floats(min_value=0.02, max_value=0.6),
    st.floats(min_value=0.01, max_value=0.5),
)
@settings(max_examples=80, deadline=None)
def test_fixed_sequence_certificate(data: tuple, eps: float, delta: float) -> None:
    """The original procedure, pinned by name: one chain from the first rank that can reject."""
    scores, correct = data
    n = scores.size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        res = conformal.risk_threshold(scores, correct, eps, delta, method="fixed_sequence")
    assert res.n == n and res.method == "fixed_sequence"
    k_min = min_rank(eps, delta)
    assert (1 - eps) ** (k_min - 1) <= delta + 1e-12
    assert (1 - eps) ** max(k_min - 2, 0) > delta or k_min == 1
    assert res.min_rank == (k_min if k_min <= n else 0)
    if not res.feasible:
        assert res.threshold == -math.inf and res.rank == 0 and res.participation == 0.0
        assert res.warnings
        return
    assert res.rank >= res.min_rank and res.level == delta


@pytest.mark.parametrize("method", list(RISK_METHODS))
@given(
    data=labelled(min_size=5, max_size=200),
    eps=st.floats(min_value=0.02, max_value=0.6),
    delta=st.floats(min_value=0.01, max_value=0.5),
)
@settings(max_examples=40, deadline=None)
def test_risk_threshold_certificate(method: str, data: tuple, eps: float, delta: float) -> None:
    """Every procedure: the certified rank's exact binomial test rejects at the level it was
    run at (≤ δ), and the Clopper-Pearson bound at that level is ≤ ε."""
    scores, correct = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        res = conformal.risk_threshold(scores, correct, eps, delta, method=method)
    assert res.method == method and res.n == scores.size
    if not res.feasible:
        assert res.threshold == -math.inf and res.rank == 0 and res.participation == 0.0
        assert res.warnings and res.level == 0.0 and res.certified_bound == 1.0
        return
    tau = res.threshold
    assert tau in set(scores.tolist())
    answered = scores <= tau
    assert res.rank == int(answered.sum()) >= res.min_rank >= 1
    assert res.participation == pytest.approx(answered.mean())
    assert res.empirical_risk == pytest.approx(1 - correct[answered].mean())
    assert 0.0 < res.level <= delta
    assert res.p_value <= res.level
    assert res.certified_bound <= eps + 1e-9
    # the certificate is an exact binomial test on the k-1 samples below the k-th
    order = np.lexsort((correct.astype(int), scores))  # ties: incorrect first
    errors_below = int((~correct[order])[: res.rank - 1].sum())
    assert res.p_value == pytest.approx(stats.binom.cdf(errors_below, res.rank - 1, eps))


@pytest.mark.parametrize("method", [m for m in RISK_METHODS if m != "fixed_sequence_late"])
@given(
    data=labelled(min_size=20, max_size=200),
    eps=st.floats(0.05, 0.4),
    delta=st.floats(0.01, 0.3),
)
@settings(max_examples=30, deadline=None)
def test_risk_threshold_monotone_in_targets(
    method: str, data: tuple, eps: float, delta: float
) -> None:
    """A looser ε or δ never certifies fewer answers (the late start is the exception)."""
    scores, correct = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        base = conformal.risk_threshold(scores, correct, eps, delta, method=method)
        looser_eps = conformal.risk_threshold(
            scores, correct, min(eps * 1.5, 0.99), delta, method=method
        )
        looser_delta = conformal.risk_threshold(
            scores, correct, eps, min(delta * 2, 0.99), method=method
        )
    assert looser_eps.rank >= base.rank
    assert looser_delta.rank >= base.rank


def test_risk_threshold_separable_data_answers_the_correct_ones() -> None:
    scores = np.arange(100.0)
    correct = scores < 60  # the 60 most confident are right, the rest wrong
    res = conformal.risk_threshold(scores, correct, 0.1, 0.1)
    assert res.feasible
    # everything up to the 60 correct ones plus a few errors is certifiable at 10 %
    assert 60 <= res.rank < 70
    assert res.empirical_risk <= 0.1


def test_risk_threshold_infeasible_abstains_on_everything() -> None:
    rng = np.random.default_rng(1)
    scores = rng.normal(size=30)
    correct = rng.uniform(size=30) < 0.5  # coin-flip accuracy, nothing certifiable at 5 %
    with pytest.warns(conformal.ConformalWarning, match="abstain on everything"):
        res = conformal.risk_threshold(scores, correct, 0.05, 0.05)
    assert not res.feasible and res.threshold == -math.inf
    assert res.certified_bound == 1.0


def test_risk_threshold_ties_are_handled_conservatively() -> None:
    # all scores tied: one candidate (answer all), tested on n-1 samples with the errors first
    scores = np.zeros(50)
    correct = np.array([True] * 45 + [False] * 5)
    res = conformal.risk_threshold(scores, correct, 0.3, 0.1)
    assert res.feasible and res.rank == 50 and res.threshold == 0.0
    # the excluded top-ranked sample is a correct one: 5 errors among 49 trials
    assert res.p_value == pytest.approx(stats.binom.cdf(5, 49, 0.3))


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 1.5, float("nan"), "x"])
def test_alpha_out_of_range(alpha: object) -> None:
    with pytest.raises(InvalidInputError, match="alpha"):
        conformal.participation_threshold([1.0, 2.0], alpha)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="alpha"):
        conformal.participation_interval(alpha, 10)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [[1.0, float("nan")], [float("inf"), 1.0], [[1.0, 2.0]]])
def test_bad_scores(bad: list) -> None:
    with pytest.raises(InvalidInputError, match="scores"):
        conformal.participation_threshold(bad, 0.1)


def test_empty_and_mismatched_inputs() -> None:
    with pytest.raises(InsufficientDataError, match="empty"):
        conformal.participation_threshold([], 0.1)
    with pytest.raises(InvalidInputError, match="same length"):
        conformal.conditional_correctness_bound([1.0, 2.0], [1], 0.1)
    with pytest.raises(InvalidInputError, match="same length"):
        conformal.risk_threshold([1.0, 2.0, 3.0], [1, 0], 0.1, 0.1)
    with pytest.raises(InvalidInputError, match="0/1"):
        conformal.risk_threshold([1.0, 2.0], [1, 2], 0.1, 0.1)


@pytest.mark.parametrize("labels", [[1, 1, 1], [0, 0, 0]])
def test_one_class_labels(labels: list[int]) -> None:
    with pytest.raises(InsufficientDataError, match="both correct and incorrect"):
        conformal.conditional_correctness_bound([1.0, 2.0, 3.0], labels, 0.1)
    with pytest.raises(InsufficientDataError, match="both correct and incorrect"):
        conformal.risk_threshold([1.0, 2.0, 3.0], labels, 0.1, 0.1)


@pytest.mark.parametrize(("eps", "delta"), [(0.0, 0.1), (1.0, 0.1), (0.1, 0.0), (0.1, 1.0)])
def test_risk_targets_out_of_range(eps: float, delta: float) -> None:
    with pytest.raises(InvalidInputError, match=r"risk_target|delta"):
        conformal.risk_threshold([1.0, 2.0], [1, 0], eps, delta)


def test_results_are_frozen() -> None:
    res = conformal.participation_threshold([1.0, 2.0, 3.0], 0.5)
    with pytest.raises(AttributeError):
        res.threshold = 0.0  # type: ignore[misc]
