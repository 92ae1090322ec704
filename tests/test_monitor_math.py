"""The drift monitor's sequential tests (abstain_guard.drift) against MAPIE 1.6's
``mapie.exchangeability_testing`` on the same inputs, and their false-alarm bound (Ville:
``P(sup M >= 1/a) <= a``) in small simulations."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from abstain_guard.drift import (
    ConformalTestMartingale,
    ParticipationEProcess,
    RiskEProcess,
    smoothed_p_value,
    wilson_interval,
)
from abstain_guard.errors import InvalidInputError

mapie_x = pytest.importorskip("mapie.exchangeability_testing")


def _three_se(a: float, reps: int) -> float:
    return a + 3 * math.sqrt(a * (1 - a) / reps)


def test_p_values_and_martingale_equal_mapie_on_the_same_scores() -> None:
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


@pytest.mark.parametrize("n", [30, 300])
def test_label_free_false_alarms_within_ville_bound(n: int) -> None:
    """Exchangeable traffic with ties (scores rounded to 2 decimals): each test's false
    alarms at threshold 1/a stay within a + 3 s.e."""
    a, reps, horizon = 0.1, 150, 400
    rng = np.random.default_rng(n)
    alarms = {"exchangeability": 0, "participation": 0}
    for r in range(reps):
        scores = np.round(rng.beta(2, 5, size=n + horizon), 2)
        reference, live = scores[:n], scores[n:]
        tau = np.sort(reference)[math.ceil(0.8 * (n + 1)) - 1] if n >= 4 else math.inf
        m = ConformalTestMartingale(reference, rng=np.random.default_rng(r))
        e = ParticipationEProcess(reference, tau, rng=np.random.default_rng(r + 10_000))
        for s in live:
            m.update(float(s))
            e.update(float(s))
        alarms["exchangeability"] += m.peak >= 1 / a
        alarms["participation"] += e.peak >= 1 / a
    for test, count in alarms.items():
        assert count / reps <= _three_se(a, reps), (test, count)


def test_risk_eprocess_valid_at_epsilon_and_no_slower_than_mapie() -> None:
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


def test_risk_monitoring_class_agrees_with_its_bound_function() -> None:
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


def test_wilson_interval() -> None:
    assert wilson_interval(0, 0) is None
    lo, hi = wilson_interval(8, 10)  # type: ignore[misc]
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
