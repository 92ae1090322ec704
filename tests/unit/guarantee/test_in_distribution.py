"""The two-sample check of live against stored sampled scores: a hand case, its level on
draws from one distribution, its power on a shifted one, typed errors."""

from __future__ import annotations

import numpy as np
import pytest

from abstain_guard.errors import InsufficientDataError, InvalidInputError
from abstain_guard.guarantee.in_distribution import live_matches_stored


def test_disjoint_samples_by_hand() -> None:
    # every live score below every stored one: D = 1; exact p = 2 / C(6, 3) = 0.1
    check = live_matches_stored([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], level=0.05)
    assert check.statistic == pytest.approx(1.0)
    assert check.p_value == pytest.approx(0.1)
    assert check.passed and (check.n_live, check.n_stored) == (3, 3)
    assert not live_matches_stored([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], level=0.2).passed
    same = live_matches_stored([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert same.statistic == 0.0 and same.p_value == pytest.approx(1.0)
    assert same.to_dict()["test"] == "ks_2samp"


def test_its_level_holds_on_draws_from_one_distribution() -> None:
    rng = np.random.default_rng(0)
    rejected = [
        not live_matches_stored(rng.gamma(2.0, size=80), rng.gamma(2.0, size=200), 0.05).passed
        for _ in range(400)
    ]
    assert np.mean(rejected) <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / 400)


def test_it_sees_a_deployment_that_samples_otherwise() -> None:
    rng = np.random.default_rng(1)
    stored = rng.gamma(2.0, size=200)
    hotter = rng.gamma(2.0, size=80) * 1.6  # e.g. a higher temperature: more disagreement
    assert not live_matches_stored(hotter, stored).passed


def test_unusable_inputs_are_typed_errors() -> None:
    with pytest.raises(InvalidInputError):
        live_matches_stored([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(InsufficientDataError):
        live_matches_stored([1.0], [1.0, 2.0])
    with pytest.raises(InvalidInputError):
        live_matches_stored([1.0, 2.0], [1.0, 2.0], level=1.5)


def test_the_live_check_reports_it_for_sampled_scorers_only() -> None:
    from abstain_guard.calibration.measure.deployment_check import in_distribution
    from abstain_guard.scorers import BlackBoxScorer, PerplexityScorer

    rng = np.random.default_rng(2)
    rows = [
        {"live_score": float(a), "stored_score": float(b)}
        for a, b in zip(rng.gamma(2.0, size=30), rng.gamma(2.0, size=30), strict=True)
    ]
    rows.append({"live_score": None, "stored_score": 1.0})  # unscorable: left out
    got = in_distribution(BlackBoxScorer, rows)["in_distribution"]
    expected = live_matches_stored(
        [r["live_score"] for r in rows[:30]], [r["stored_score"] for r in rows[:30]]
    )
    assert got == expected.to_dict() and got["n_live"] == 30
    assert in_distribution(BlackBoxScorer, rows[:1]) == {"in_distribution": None}
    assert in_distribution(PerplexityScorer(), rows) == {}  # live = stored, checked bitwise
