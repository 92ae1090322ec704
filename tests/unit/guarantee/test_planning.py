"""The label plan (abstain_guard.guarantee.planning): binormal scores as the ROC model says,
the guard's own procedure on each draw, and agreement with an independent simulation."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy.special import ndtr

from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee import conformal
from abstain_guard.guarantee.planning import (
    PlanScenario,
    binormal_limit,
    binormal_separation,
    label_plan,
)


def test_the_separation_gives_the_asked_auroc() -> None:
    rng = np.random.default_rng(0)
    d = binormal_separation(0.8)
    right, wrong = rng.normal(size=200_000), rng.normal(size=200_000) + d
    assert np.mean(wrong > right) == pytest.approx(0.8, abs=0.005)
    assert binormal_separation(0.5) == 0.0


def test_the_limit_is_where_the_population_risk_reaches_the_target() -> None:
    a, r, eps = 0.6, 0.8, 0.3
    p = binormal_limit(a, r, eps)
    d = binormal_separation(r)
    # invert participation -> threshold and check the risk there is eps
    grid = np.linspace(-6, 8, 200_001)
    answered = a * ndtr(grid) + (1 - a) * ndtr(grid - d)
    t = grid[np.searchsorted(answered, p)]
    risk = (1 - a) * ndtr(t - d) / (a * ndtr(t) + (1 - a) * ndtr(t - d))
    assert risk == pytest.approx(eps, abs=1e-3)
    assert binormal_limit(0.9, 0.5, 0.3) == pytest.approx(1.0)  # 10 % wrong everywhere: all
    assert binormal_limit(0.5, 0.5, 0.3) == 0.0  # 50 % wrong everywhere: answer none


def test_participation_grows_with_n_towards_the_limit() -> None:
    scenario = PlanScenario(risk_target=0.3, delta=0.1, accuracy=0.6, auroc=0.8)
    plan = label_plan(scenario, sizes=(100, 400, 4000), draws=60, seed=1)
    medians = [r.median for r in plan.rows]
    assert medians == sorted(medians)
    assert plan.limit is not None
    assert plan.limit - 0.05 < medians[-1] < plan.limit + 0.02
    assert plan.rows[-1].certified == 1.0
    assert plan.n_for(medians[1]) == 400 and plan.n_for(1.0) is None


def test_the_plan_is_the_guards_procedure_on_fresh_draws() -> None:
    """An independent simulation (its own draws, the guard's risk_threshold) agrees with
    the plan within Monte Carlo error, and the certificate holds on the population."""
    scenario = PlanScenario(risk_target=0.35, delta=0.1, accuracy=0.55, auroc=0.75)
    n, draws = 300, 200
    plan = label_plan(scenario, sizes=(n,), draws=draws, seed=2)
    rng = np.random.default_rng(99)
    d = binormal_separation(0.75)
    got, violated = [], 0
    for _ in range(draws):
        correct = rng.random(n) < 0.55
        scores = rng.normal(size=n) + np.where(correct, 0.0, d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", conformal.ConformalWarning)
            res = conformal.risk_threshold(scores, correct, 0.35, 0.1)
        got.append(res.participation if res.feasible else 0.0)
        if res.feasible:
            t = res.threshold
            risk = 0.45 * ndtr(t - d) / (0.55 * ndtr(t) + 0.45 * ndtr(t - d))
            violated += risk > 0.35
    assert np.median(got) == pytest.approx(plan.rows[0].median, abs=0.03)
    assert np.mean(np.array(got) > 0) == pytest.approx(plan.rows[0].certified, abs=0.08)
    assert violated / draws <= 0.1 + 0.05  # δ plus three binomial standard errors


def test_an_artifacts_scores_are_resampled() -> None:
    rng = np.random.default_rng(3)
    correct = rng.random(2000) < 0.7
    scores = rng.normal(size=2000) + np.where(correct, 0.0, 1.5)
    scenario = PlanScenario(risk_target=0.2, delta=0.1, accuracy=0.7, source="artifact")
    plan = label_plan(scenario, sizes=(200, 1000), draws=40, stored=(scores, correct))
    assert plan.limit is None and plan.rows[1].median >= plan.rows[0].median > 0


@pytest.mark.parametrize(
    ("scenario", "match"),
    [
        (PlanScenario(0.3, 0.1, 0.6, auroc=1.2), "auroc"),
        (PlanScenario(0.3, 0.1, 0.6), "AUROC"),
        (PlanScenario(0.3, 0.1, 1.0, auroc=0.8), "accuracy"),
    ],
)
def test_bad_scenarios_say_what_to_give(scenario: PlanScenario, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        label_plan(scenario, draws=2)
