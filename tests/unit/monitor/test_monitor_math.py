"""The drift monitor's sequential tests (abstain_guard.monitor.drift): against MAPIE 1.6's
``mapie.exchangeability_testing`` on the same inputs (those tests only need MAPIE), and
against their laws under the null, in tests that can fail — the p-values are independent
uniforms (Kolmogorov–Smirnov, chi-square on consecutive pairs) and the answered indicators
follow the Pólya urn (chi-square against its exact pattern frequencies), each with a check
that the same test rejects what a wrong implementation computes."""

from __future__ import annotations

import gc
import itertools
import math
import tracemalloc
import warnings
from types import ModuleType

import numpy as np
import pytest
from scipy import stats
from sortedcontainers import SortedList

from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee import groups
from abstain_guard.guarantee.intervals import wilson_interval
from abstain_guard.monitor.drift import (
    ConformalTestMartingale,
    ParticipationEProcess,
    RiskEProcess,
    smoothed_p_value,
)


@pytest.fixture(scope="module")
def mapie_x() -> ModuleType:
    """MAPIE's exchangeability tests (a dev dependency): only the comparisons need it."""
    return pytest.importorskip("mapie.exchangeability_testing")


def _three_se(a: float, reps: int) -> float:
    return a + 3 * math.sqrt(a * (1 - a) / reps)


def test_p_values_and_martingale_equal_mapie_on_the_same_scores(mapie_x: ModuleType) -> None:
    rng = np.random.default_rng(3)
    reference = rng.normal(size=200)
    live = np.concatenate([rng.normal(size=100), rng.normal(1.5, 1.0, size=100)])
    live[:5] = reference[:5]  # ties with calibration scores use the smoothing uniform
    ours = ConformalTestMartingale(reference, jump=0.05, rng=np.random.default_rng(11))
    theirs = mapie_x.OnlineMartingaleTest(jump_size=0.05, random_state=11, burn_in=1, warn=False)
    history = list(reference)
    for score in live:
        p_mapie = theirs.compute_p_value(score, np.asarray(history))
        value_mapie = theirs.update_simple_jumper_martingale(p_mapie)
        history.append(score)
        p_ours = ours.update(float(score))
        assert p_ours == pytest.approx(p_mapie, abs=1e-12)
        assert ours.value == pytest.approx(value_mapie, rel=1e-12)
    assert ours.peak > 100  # the shifted half is detected


def test_smoothed_p_value_counts_greater_and_ties() -> None:
    history = [0.1, 0.2, 0.2, 0.5]
    assert smoothed_p_value(0.2, history, 0.5) == pytest.approx((1 + 0.5 * 3) / 5)
    assert smoothed_p_value(9.0, history, 0.0) == 0.0
    assert smoothed_p_value(-1.0, history, 1.0) == pytest.approx(1.0)


def test_participation_urn_predicts_the_band_then_learns() -> None:
    reference = np.arange(1.0, 100.0)  # n = 99 distinct scores
    threshold = 80.0  # k = 80 calibration scores <= tau
    e = ParticipationEProcess(reference, threshold, rng=np.random.default_rng(0))
    assert (e.k, e.n) == (80, 99)
    assert e.predicted == pytest.approx(80 / 100)
    assert e.update(200.0) is False  # above every calibration score: not answered
    assert e.predicted == pytest.approx(80 / 101)
    assert e.update(0.5) is True
    assert e.predicted == pytest.approx(81 / 102)


def test_participation_with_infinite_threshold_never_bets() -> None:
    e = ParticipationEProcess(np.arange(5.0), math.inf, rng=np.random.default_rng(0))
    for s in (10.0, 20.0, 30.0):
        assert e.update(s) is True
    assert e.value == pytest.approx(1.0)


def test_risk_eprocess_valid_at_epsilon_and_no_slower_than_mapie(mapie_x: ModuleType) -> None:
    """Same error streams for ours and MAPIE's RiskMonitoring (threshold = ε): at the null's
    boundary (error rate = ε) both keep false alarms within a + 3 s.e.; with error rate
    ε + 0.2 ours alarms no later than MAPIE's (median first alarm)."""
    eps, a, reps, horizon = 0.3, 0.1, 80, 200
    rng = np.random.default_rng(5)

    def first_alarms(rate: float) -> tuple[list[float], list[float]]:
        ours_at, mapie_at = [], []
        for _ in range(reps):
            errors = rng.uniform(size=horizon) < rate
            ours = RiskEProcess(eps)
            at = math.inf
            for t, err in enumerate(errors, 1):
                if ours.update(bool(err)) >= 1 / a:
                    at = t
                    break
            ours_at.append(at)
            # MAPIE: y_pred = 1 (answered), y_true = 1 - error; risk "precision" = error rate
            lower = mapie_x.bounds.conjugate_mixture_empirical_bernstein_bound(
                errors.astype(float), v_opt=1, alpha=a / 2, bound_side="lower"
            )
            crossed = np.flatnonzero(lower > eps)
            mapie_at.append(float(crossed[0] + 1) if crossed.size else math.inf)
        return ours_at, mapie_at

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        null_ours, null_mapie = first_alarms(eps)
        alt_ours, alt_mapie = first_alarms(eps + 0.2)
    assert np.mean(np.isfinite(null_ours)) <= _three_se(a, reps)
    assert np.mean(np.isfinite(null_mapie)) <= _three_se(a, reps)
    assert np.median(alt_ours) <= np.median(alt_mapie)
    assert np.median(alt_ours) < horizon


def test_risk_monitoring_class_agrees_with_its_bound_function(mapie_x: ModuleType) -> None:
    """The bound used above is what RiskMonitoring(threshold=ε) computes online."""
    rng = np.random.default_rng(1)
    errors = (rng.uniform(size=120) < 0.6).astype(int)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rm = mapie_x.RiskMonitoring(risk="precision", threshold=0.3, test_level=0.1, warn=False)
        rm.update(1 - errors, np.ones_like(errors))
    lower = mapie_x.bounds.conjugate_mixture_empirical_bernstein_bound(
        errors.astype(float), v_opt=1, alpha=0.05, bound_side="lower"
    )
    assert rm.online_risk_lower_bound_latest == pytest.approx(lower[-1])


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="epsilon"):
        RiskEProcess(0.0)
    with pytest.raises(InvalidInputError, match="jump"):
        ConformalTestMartingale([1.0, 2.0], jump=1.5)


def test_one_wilson_interval_equal_to_scipys() -> None:
    """One Wilson interval in the project (groups imports drift's), equal to scipy's
    ``binomtest(...).proportion_ci(method="wilson")``."""
    assert groups.wilson_interval is wilson_interval
    assert wilson_interval(0, 0) is None
    lo, hi = wilson_interval(8, 10)  # type: ignore[misc]
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    for n, confidence in itertools.product((1, 7, 50, 961), (0.9, 0.95, 0.99)):
        for k in sorted({0, 1, n // 3, n - 1, n}):
            ci = stats.binomtest(k, n).proportion_ci(confidence_level=confidence, method="wilson")
            ours = wilson_interval(k, n, confidence)
            assert ours == pytest.approx((ci.low, ci.high), abs=1e-12), (k, n, confidence)


# --- the laws under the null: tests that can fail --------------------------------------


def _live_p_values(n: int, horizon: int, seed: int, grow: bool = True) -> np.ndarray:
    """The p-values of ``horizon`` live scores after ``n`` calibration scores, one
    exchangeable stream with ties (Beta(2, 5) rounded to 2 decimals). ``grow=False``: each
    ranked among the calibration scores alone (the wrong p-values)."""
    rng = np.random.default_rng(seed)
    scores = np.round(rng.beta(2, 5, size=n + horizon), 2)
    m = ConformalTestMartingale(scores[:n], rng=np.random.default_rng(seed + 1))
    if grow:
        return np.array([m.update(float(s)) for s in scores[n:]])
    fixed = sorted(scores[:n].tolist())
    u = np.random.default_rng(seed + 2).uniform(size=horizon)
    return np.array(
        [smoothed_p_value(float(s), fixed, float(v)) for s, v in zip(scores[n:], u, strict=True)]
    )


def _pairs_chi2(p: np.ndarray, bins: int = 4) -> float:
    """Chi-square p-value of consecutive non-overlapping pairs ``(p_2i, p_2i+1)`` on a
    ``bins × bins`` grid against independent uniforms (each cell 1/bins²)."""
    pairs = np.floor(np.minimum(p, 1 - 1e-12) * bins).astype(int)[: p.size // 2 * 2].reshape(-1, 2)
    counts = np.bincount(pairs[:, 0] * bins + pairs[:, 1], minlength=bins * bins)
    return float(stats.chisquare(counts).pvalue)


def test_p_values_are_independent_uniforms_under_exchangeability() -> None:
    """One long exchangeable stream with ties after a small calibration set (where ranks
    among the calibration set alone are far from uniform): the smoothed p-values among all
    earlier scores pass a KS test of uniformity and a chi-square test of independent pairs
    (fixed seeds, level 0.01)."""
    for seed in (0, 1):
        p = _live_p_values(n=20, horizon=3000, seed=seed)
        assert stats.kstest(p, "uniform").pvalue > 0.01, seed
        assert _pairs_chi2(p) > 0.01, seed


def test_the_uniformity_tests_reject_p_values_among_the_calibration_set_alone() -> None:
    """The tests above can fail: p-values ranked among the fixed calibration set (given it,
    not uniform) are rejected on the same streams."""
    for seed in (0, 1):
        p = _live_p_values(n=20, horizon=3000, seed=seed, grow=False)
        assert stats.kstest(p, "uniform").pvalue < 1e-6, seed


def _urn_probability(pattern: tuple[int, ...], k: int, n: int) -> float:
    """The Pólya urn's probability of the answered ``pattern``: P(A_t = 1 | past) =
    (k + answered so far) / (n + t), t = 1, 2, ..."""
    prob, answered = 1.0, 0
    for t, a in enumerate(pattern):
        q = (k + answered) / (n + 1 + t)
        prob *= q if a else 1.0 - q
        answered += a
    return prob


def _urn_patterns(
    runs: int, n: int, horizon: int, rank: int, rank_fixed: bool, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Observed counts of each answered pattern ``[2**horizon]`` over ``runs`` exchangeable
    streams with heavy ties (Beta(2, 5) rounded to 1 decimal), τ the ``rank``-th smallest of
    ``n`` calibration scores, and their expected counts under the urn of each run's k
    (``rank_fixed``: k = rank; else k = #{calibration <= τ}); ``itertools.product`` order."""
    rng = np.random.default_rng(seed)
    patterns = list(itertools.product((0, 1), repeat=horizon))
    observed, expected = np.zeros(len(patterns)), np.zeros(len(patterns))
    weights = 2 ** np.arange(horizon)[::-1]
    for _ in range(runs):
        scores = np.round(rng.beta(2, 5, size=n + horizon), 1)
        tau = float(np.sort(scores[:n])[rank - 1])
        e = ParticipationEProcess(scores[:n], tau, rng=rng, rank=rank if rank_fixed else None)
        expected += [_urn_probability(p, e.k, n) for p in patterns]
        observed[int(np.dot([e.update(float(s)) for s in scores[n:]], weights))] += 1
    return observed, expected


def test_answered_indicators_follow_the_polya_urn() -> None:
    """3000 streams (9 calibration scores, rank 7, 4 live scores, heavy ties): the 16
    answered patterns' counts against the urn's exact frequencies (chi-square, fixed seed).
    The same test rejects k = #{calibration <= τ} (what the urn used before: with ties at τ
    it depends on the draw), so it can fail."""
    exact = _urn_patterns(3000, 9, 4, 7, rank_fixed=True, seed=0)
    assert stats.chisquare(*exact).pvalue > 0.01
    counted = _urn_patterns(3000, 9, 4, 7, rank_fixed=False, seed=0)
    assert stats.chisquare(*counted).pvalue < 1e-6


def test_the_urn_counts_ties_by_the_rank_not_by_the_threshold() -> None:
    """With scores tied at τ, k = #{calibration <= τ} depends on the calibration draw and
    the urn is off; the rule's rank keeps it exact."""
    reference = np.array([0.1, 0.2, 0.3, 0.3, 0.3, 0.4])
    by_rank = ParticipationEProcess(reference, 0.3, rng=np.random.default_rng(0), rank=3)
    by_count = ParticipationEProcess(reference, 0.3, rng=np.random.default_rng(0))
    assert (by_rank.k, by_count.k) == (3, 5)
    never = ParticipationEProcess(reference, -math.inf, rng=np.random.default_rng(0), rank=3)
    assert never.k == 0 and never.update(0.0) is False
    assert never.value == pytest.approx(1.0)  # q = 0: the urn never bets


# --- the history: O(log N) per update, its memory measured ------------------------------


def test_an_update_ranks_and_inserts_in_a_sorted_list() -> None:
    """The history stays a SortedList (O(log N) to rank and to insert), sorted after every
    update. What that costs at a million earlier scores against a thousand is measured by
    experiments/drift/monitor_memory.py (update_us_at_history), not timed here."""
    rng = np.random.default_rng(0)
    ref = rng.normal(size=1000)
    m = ConformalTestMartingale(ref, rng=rng)
    live = rng.normal(size=50)
    for s in live:
        m.update(float(s))
        assert isinstance(m.history, SortedList)
    assert list(m.history) == sorted([*ref.tolist(), *live.tolist()])


def test_the_history_keeps_about_one_float_per_live_score() -> None:
    """The figure in docs/guarantees.md: the history grows by ~33 bytes per live score
    (a float and its slot in a SortedList), nothing else per score."""
    rng = np.random.default_rng(0)
    m = ConformalTestMartingale(rng.normal(size=1000), rng=rng)
    live = rng.normal(size=5_000)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for s in live:
        m.update(float(s))
    gc.collect()
    grown = (tracemalloc.get_traced_memory()[0] - before) / live.size
    tracemalloc.stop()
    assert 24 <= grown <= 48, grown
