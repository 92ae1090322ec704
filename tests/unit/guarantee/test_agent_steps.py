"""Step gating (``abstain_guard.guarantee.agent_steps``): the running maximum, the first step that
stops a run, and by simulation the run-level guarantee of the early-stopping guard.

Synthetic agent runs: 1-4 model calls, each call wrong with a probability that grows with
its step score; a run is wrong when one of its calls is wrong. τ is calibrated on whole
runs' statistics (the maximum step score) with the library's own decision rule; the guard
is then *deployed step by step* on fresh runs (stopping at the first call whose running
maximum crosses τ) and the realized error among the runs it let through is compared with ε.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from abstain_guard.config import GuardConfig
from abstain_guard.guarantee.agent_steps import run_statistic, running_statistic, stopping_step
from abstain_guard.guarantee.decision import decision_rule


def test_the_running_maximum_only_grows_and_ends_at_the_run_statistic() -> None:
    scores = [0.2, 0.7, 0.1, 0.5]
    value = None
    seen = []
    for s in scores:
        value = running_statistic(value, s)
        seen.append(value)
    assert seen == [0.2, 0.7, 0.7, 0.7]
    assert run_statistic(scores) == 0.7
    with pytest.raises(ValueError, match="without model calls"):
        run_statistic([])
    with pytest.raises(ValueError, match="NaN"):
        running_statistic(0.1, math.nan)


def test_a_run_stops_at_the_first_call_that_crosses_tau_exactly_when_its_statistic_does() -> None:
    assert stopping_step([0.2, 0.7, 0.1], 0.5) == 1  # call 2's tool calls never run
    assert stopping_step([0.2, 0.5, 0.1], 0.5) is None  # <= τ answers, as DecisionRule
    assert stopping_step([0.9], 0.5) == 0
    rng = np.random.default_rng(7)
    for _ in range(2000):
        steps = rng.uniform(size=int(rng.integers(1, 6))).tolist()
        tau = float(rng.uniform())
        stop = stopping_step(steps, tau)
        assert (stop is None) == (run_statistic(steps) <= tau)
        if stop is not None:  # every earlier call was under τ
            assert max(steps[:stop], default=-1.0) <= tau < steps[stop]


def _runs(rng: np.random.Generator, n: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """``n`` runs: step scores ``[T]`` each; whether the run is right (every call right) and
    whether its final call (the answer) is right, ``[n]`` each."""
    lengths = rng.integers(1, 5, size=n)
    steps = [rng.beta(2.0, 5.0, size=t) for t in lengths]
    wrong = [rng.uniform(size=s.size) < 0.6 * s**1.5 for s in steps]
    return steps, np.array([not w.any() for w in wrong]), np.array([not w[-1] for w in wrong])


def _deploy(steps: list[np.ndarray], tau: float) -> np.ndarray:
    """Whether the step-by-step guard lets each run through (never sees a whole run)."""
    return np.array([stopping_step(s.tolist(), tau) is None for s in steps])


@pytest.mark.parametrize(("eps", "delta"), [(0.15, 0.1), (0.2, 0.2)])
def test_the_early_stopping_guard_keeps_run_error_under_epsilon_with_probability_1_minus_delta(
    eps: float, delta: float
) -> None:
    rng = np.random.default_rng(20261126)
    test_steps, test_right, _ = _runs(rng, 10_000)  # the population the guard is deployed on
    reps, n = 300, 300
    violations = feasible = 0
    for _ in range(reps):
        cal_steps, cal_right, _ = _runs(rng, n)
        stats = np.array([run_statistic(s.tolist()) for s in cal_steps])
        config = GuardConfig(mode="risk", risk_target=eps, delta=delta, on_infeasible="abstain_all")
        rule = decision_rule(stats, cal_right, config)
        feasible += bool(rule.guarantee.feasible)
        through = _deploy(test_steps, rule.threshold)
        if through.any():
            violations += float(1.0 - test_right[through].mean()) > eps
    assert feasible >= 2 * reps // 3  # most draws deploy a guard: the check is not vacuous
    # the guarantee: P(violation) <= δ; allow 3 binomial standard errors over the reps.
    # (Measured: 0.023 at ε=0.15, δ=0.1 and 0.073 at ε=0.2, δ=0.2; the largest τ whose
    # calibration error is <= ε, without the correction, violates in 48 % and 52 % of draws.)
    slack = 3 * math.sqrt(delta * (1 - delta) / reps)
    assert violations / reps <= delta + slack, (violations, reps)


def test_the_early_stopping_guard_lets_through_the_calibrated_share_of_runs() -> None:
    rng = np.random.default_rng(11)
    test_steps, _, _ = _runs(rng, 5_000)
    test_stats = np.array([run_statistic(s.tolist()) for s in test_steps])
    shares = []
    for _ in range(200):
        cal_steps, cal_right, _ = _runs(rng, 199)
        stats = np.array([run_statistic(s.tolist()) for s in cal_steps])
        rule = decision_rule(stats, cal_right, GuardConfig(participation=0.8))
        through = _deploy(test_steps, rule.threshold)
        assert (through == (test_stats <= rule.threshold)).all()  # early stop = whole run
        shares.append(through.mean())
    mean = float(np.mean(shares))
    se = float(np.std(shares, ddof=1) / math.sqrt(len(shares)))
    assert 0.8 - 3 * se <= mean <= 0.8 + 1 / 200 + 3 * se, (mean, se)


def test_gating_the_final_answer_only_lets_wrong_actions_through() -> None:
    """Why step gating: calibrated on final answers (their scores and labels), the guard
    certifies the answers' error but lets through runs whose earlier tool calls were wrong,
    so the run error among accepted runs exceeds ε; calibrated on runs it does not."""
    rng = np.random.default_rng(3)
    eps, delta = 0.12, 0.1
    test_steps, test_right, test_final = _runs(rng, 20_000)
    cal_steps, cal_right, cal_final = _runs(rng, 2_000)
    risk = GuardConfig(mode="risk", risk_target=eps, delta=delta)
    last = np.array([s[-1] for s in cal_steps])
    final_rule = decision_rule(last, cal_final, risk)
    through = np.array([s[-1] <= final_rule.threshold for s in test_steps])
    assert 1.0 - test_final[through].mean() <= eps  # what final-answer gating certifies
    assert 1.0 - test_right[through].mean() > eps  # ... not the runs' actions
    stats = np.array([run_statistic(s.tolist()) for s in cal_steps])
    stepped = _deploy(test_steps, decision_rule(stats, cal_right, risk).threshold)
    assert 1.0 - test_right[stepped].mean() <= eps
