"""Action risk (``abstain_guard.guarantee.action_risk``): P(a wrong tool call is executed under the
step guard) certified unconditionally, alone and beside the run-level error among accepted runs.

Synthetic agent runs: 1-4 model calls; every call but the last calls a tool, wrong with a
probability that grows with its step score; the last call is the final answer, wrong with a
probability that grows with its score. The population the guard is deployed on is large
(30,000 runs), so its action risk R_a(τ) and its error among accepted runs are known to about
±0.003; each calibration draw is exchangeable with it.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.artifact.files import CALIBRATION, load_npz
from abstain_guard.calibration.building.agent_calibration import calibration_action_statistics
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.questions.tool_labels import ExpectedCall
from abstain_guard.errors import (
    ActionRiskUnavailableError,
    ArtifactMismatchError,
    ConfigError,
    InvalidInputError,
    UncertifiableTargetError,
)
from abstain_guard.guarantee import conformal
from abstain_guard.guarantee.action_risk import (
    ACTION_DELTA_SHARE,
    action_losses,
    action_risk_certificate,
    action_statistic,
    certified_action_risk,
    check_action_statistics,
    joint_risk_threshold,
)
from abstain_guard.guarantee.agent_steps import run_statistic, stopping_step
from abstain_guard.guarantee.decision import decision_rule
from abstain_guard.guarantee.risk_control import binomial_p_values
from abstain_guard.scorers import PerplexityScorer

REPS = 300


class Runs:
    """``n`` synthetic runs: step scores, wrong tool calls per call, run labels, and the
    statistics the guard and the certificate read (S: running maximum, A: action statistic)."""

    def __init__(self, rng: np.random.Generator, n: int) -> None:
        self.steps: list[list[float]] = []
        self.wrong: list[list[int]] = []
        right = []
        for t in rng.integers(1, 5, size=n):
            s = rng.beta(2.0, 5.0, size=int(t))
            wrong = (rng.uniform(size=int(t)) < 0.8 * s**1.5).astype(int)
            answer_wrong = bool(rng.uniform() < 0.9 * s[-1])
            wrong[-1] = 0  # the final answer calls no tool
            self.steps.append(s.tolist())
            self.wrong.append(wrong.tolist())
            right.append(not wrong.any() and not answer_wrong)
        self.right = np.array(right)
        self.stat = np.array([run_statistic(s) for s in self.steps])
        self.action = np.array(
            [action_statistic(s, w) for s, w in zip(self.steps, self.wrong, strict=True)]
        )


@pytest.fixture(scope="module")
def population() -> Runs:
    return Runs(np.random.default_rng(20261127), 30_000)


def _action_risk(pop: Runs, tau: float) -> float:
    """The population's action risk at τ: the share of runs with a wrong call executed."""
    return float(np.mean(pop.action <= tau))


def _accepted_error(pop: Runs, tau: float) -> float:
    through = pop.stat <= tau
    return float(1.0 - pop.right[through].mean()) if through.any() else 0.0


def _slack(delta: float) -> float:
    return 3 * math.sqrt(delta * (1 - delta) / REPS)


# --- the statistic and the loss --------------------------------------------------------------


def test_the_action_statistic_is_the_running_maximum_at_the_first_wrong_call() -> None:
    assert action_statistic([0.2, 0.7, 0.1], [0, 0, 1]) == 0.7
    assert action_statistic([0.2, 0.7, 0.1], [1, 0, 1]) == 0.2
    assert action_statistic([0.2, 0.7], [0, 0]) == math.inf
    with pytest.raises(ValueError, match="one per model call"):
        action_statistic([0.2], [0, 1])


def test_the_action_loss_is_what_the_step_guard_executes_and_is_monotone() -> None:
    """A ≤ τ exactly when the deployed guard (stopping before the tool calls of its first
    call over τ) executes a wrong call; so the loss only grows with τ."""
    runs = Runs(np.random.default_rng(5), 400)
    taus = np.linspace(0.0, 1.0, 41)
    previous = np.zeros(400, dtype=bool)
    for tau in taus:
        loss = action_losses(runs.action, float(tau))
        for i in range(400):
            stop = stopping_step(runs.steps[i], float(tau))
            ran = runs.wrong[i] if stop is None else runs.wrong[i][:stop]
            assert loss[i] == (sum(ran) > 0)
        assert (loss >= previous).all()
        previous = loss


def test_action_statistics_are_checked() -> None:
    assert check_action_statistics([0.1, math.inf], 2).tolist() == [0.1, math.inf]
    for bad in ([0.1, math.nan], [-math.inf, 0.2]):
        with pytest.raises(InvalidInputError):
            check_action_statistics(bad)
    with pytest.raises(InvalidInputError, match="one per run"):
        check_action_statistics([0.1], 2)


# --- the certificate -------------------------------------------------------------------------


def test_the_ceiling_is_where_the_binomial_test_stops_rejecting() -> None:
    values = np.r_[np.linspace(0.1, 0.9, 30), np.full(70, math.inf)]
    cert = action_risk_certificate(values, 0.3, 0.1)
    q = cert.max_count
    assert binomial_p_values(q, 100, 0.3) <= 0.1 < binomial_p_values(q + 1, 100, 0.3)
    assert cert.ceiling == np.sort(values)[q]  # the (q+1)-th smallest statistic
    below = float(np.nextafter(cert.ceiling, -math.inf))
    assert cert.certifies(below) and not cert.certifies(cert.ceiling)
    assert action_losses(values, below).sum() == q
    # too few runs for the target: nothing but stopping every run at its first call
    small = action_risk_certificate(np.full(10, math.inf), 0.1, 0.1)  # 0.9^10 = 0.35 > 0.1
    assert small.max_count == -1 and not small.feasible
    assert small.certifies(-math.inf) and not small.certifies(0.0)


def test_the_certified_action_risk_holds_with_probability_1_minus_delta(population: Runs) -> None:
    """Worst case: τ just below the ceiling (every τ under it is certified at once). The
    largest τ whose calibration action risk is <= ε_a, without the test, violates often.
    Measured: 5.7 % of 300 draws violate (δ = 10 %), the untested rule 45.7 %; the certified
    τ's action risk is 0.122 on average at ε_a = 0.15."""
    eps_a, delta, n = 0.15, 0.1, 300
    rng = np.random.default_rng(1)
    violations = naive = feasible = 0
    risks = []
    for _ in range(REPS):
        cal = Runs(rng, n)
        cert = action_risk_certificate(cal.action, eps_a, delta)
        if cert.feasible:
            feasible += 1
            tau = float(np.nextafter(cert.ceiling, -math.inf))
            risks.append(_action_risk(population, tau))
            violations += risks[-1] > eps_a
        k = int(eps_a * n)  # the empirical rule: k runs of n with an executed wrong call
        naive += _action_risk(population, float(np.nextafter(np.sort(cal.action)[k], -1))) > eps_a
    assert violations / REPS <= delta + _slack(delta), violations
    assert naive / REPS > 0.3, naive  # what the test protects against
    assert feasible == REPS
    assert np.mean(risks) > 0.7 * eps_a  # and it is not vacuous


# --- both targets ----------------------------------------------------------------------------


def test_both_certificates_hold_together_with_probability_1_minus_delta(
    population: Runs,
) -> None:
    """Measured: 1 draw of 300 violates one of the two statements (δ = 10 %, each at 5 %)."""
    eps, eps_a, delta, n = 0.3, 0.06, 0.1, 300
    rng = np.random.default_rng(2)
    violations = binding = feasible = 0
    for _ in range(REPS):
        cal = Runs(rng, n)
        res, cert = joint_risk_threshold(cal.stat, cal.right, cal.action, eps, eps_a, delta)
        assert res.delta == pytest.approx(delta * (1 - ACTION_DELTA_SHARE))
        assert cert.level == pytest.approx(delta * ACTION_DELTA_SHARE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", conformal.ConformalWarning)
            alone = conformal.risk_threshold(cal.stat, cal.right, eps, res.delta)
        tau = res.threshold
        assert tau <= alone.threshold  # the action ceiling only removes thresholds
        assert cert.certifies(tau)
        binding += tau < alone.threshold
        feasible += res.feasible
        violations += (
            _accepted_error(population, tau) > eps or _action_risk(population, tau) > eps_a
        )
    assert violations / REPS <= delta + _slack(delta), violations
    # each target decides τ in some draws (measured: the action target in 131 of 300)
    assert REPS // 4 < binding < REPS, binding
    assert feasible > 0.6 * REPS  # measured: 214 of 300


def test_the_action_risk_read_off_the_data_at_a_chosen_tau_keeps_delta(population: Runs) -> None:
    """``certified_action_risk``: τ chosen by the run-level rule on the same runs and the
    smallest grid ε_a read off them (each grid value at δ/99). Measured: no violation in 300
    draws, the reading 0.088 on average against a realised 0.042."""
    eps, delta, n = 0.3, 0.1, 300
    rng = np.random.default_rng(3)
    violations = feasible = 0
    read = []
    config = GuardConfig(mode="risk", risk_target=eps, delta=delta, on_infeasible="abstain_all")
    for _ in range(REPS):
        cal = Runs(rng, n)
        tau = decision_rule(cal.stat, cal.right, config).threshold
        feasible += tau > -math.inf
        certified = certified_action_risk(cal.action, tau, delta)
        assert certified is not None
        read.append(certified)
        violations += _action_risk(population, tau) > certified
    assert violations / REPS <= delta + _slack(delta), violations
    assert feasible > 0.6 * REPS  # measured: 238 of 300
    assert np.mean(read) < 0.15  # informative: the population's risk reaches 0.18


# --- config, decision rule, artifact ---------------------------------------------------------


def test_the_config_asks_for_risk_mode_and_the_pooled_rule() -> None:
    cfg = GuardConfig(mode="risk", risk_target=0.3, action_risk_target=0.1)
    assert cfg.action_risk_target == 0.1
    with pytest.raises(ConfigError, match="mode='risk'"):
        GuardConfig(action_risk_target=0.1)
    with pytest.raises(ConfigError, match="pooled"):
        GuardConfig(mode="risk", risk_target=0.3, action_risk_target=0.1, group_by="kind")
    env = {"ABSTAIN_GUARD_MODE": "risk", "ABSTAIN_GUARD_RISK_TARGET": "0.3"}
    assert (
        GuardConfig.from_env({**env, "ABSTAIN_GUARD_ACTION_RISK_TARGET": "0.05"}).action_risk_target
        == 0.05
    )
    assert (
        GuardConfig.from_env({**env, "ABSTAIN_GUARD_ACTION_RISK_TARGET": ""}).action_risk_target
        is None
    )


def _calibration(seed: int = 4, n: int = 400) -> Runs:
    return Runs(np.random.default_rng(seed), n)


def test_the_decision_rule_states_both_certificates() -> None:
    cal = _calibration()
    cfg = GuardConfig(mode="risk", risk_target=0.3, delta=0.1, action_risk_target=0.06)
    rule = decision_rule(cal.stat, cal.right, cfg, action_statistic=cal.action)
    block = rule.guarantee.action_risk
    assert block["certified"] and block["action_risk_target"] == 0.06
    assert block["level"] == pytest.approx(0.05) and block["run_level_level"] == pytest.approx(0.05)
    assert block["calibration_runs_with_wrong_call_executed"] <= block["max_count"]
    assert "stopped ones included" in block["statement"]
    assert rule.threshold < float(block["ceiling"])
    run_only = decision_rule(cal.stat, cal.right, cfg.with_overrides(action_risk_target=None))
    assert rule.threshold < run_only.threshold  # here the action target decides τ
    with pytest.raises(ActionRiskUnavailableError, match="calibrate --agent"):
        decision_rule(cal.stat, cal.right, cfg)
    with pytest.raises(UncertifiableTargetError, match="together"):
        decision_rule(
            cal.stat,
            cal.right,
            cfg.with_overrides(action_risk_target=0.001),
            action_statistic=cal.action,
        )
    none = decision_rule(
        cal.stat,
        cal.right,
        cfg.with_overrides(action_risk_target=0.001, on_infeasible="abstain_all"),
        action_statistic=cal.action,
    )
    assert none.threshold == -math.inf and none.guarantee.action_risk["certified"]


def test_the_artifact_stores_the_action_statistics_in_a_file_of_their_own(tmp_path: Path) -> None:
    cal = _calibration()
    cfg = GuardConfig(mode="risk", risk_target=0.3, action_risk_target=0.06)
    art = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(cal.stat, cal.right, action_statistic=cal.action),
    )
    root = art.save(tmp_path / "agent")
    calibration = load_npz((root / CALIBRATION).read_bytes(), CALIBRATION)
    assert set(calibration) == {"scores", "correct"}  # what earlier loaders accept
    stored = load_npz((root / "action_risk.npz").read_bytes(), "action_risk.npz")
    assert np.array_equal(stored["statistic"], cal.action)
    loaded = GuardArtifact.load(root)
    assert loaded.action_statistic is not None
    assert np.array_equal(loaded.action_statistic, cal.action)
    assert loaded.decision_rule(cfg).threshold == art.decision_rule(cfg).threshold
    # an artifact without them (calibrated before action risk): a typed refusal that says
    # what to do; the run-level rule alone still works
    old = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(cal.stat, cal.right)
    )
    old_root = old.save(tmp_path / "old")
    assert not (old_root / "action_risk.npz").exists()
    reloaded = GuardArtifact.load(old_root)
    with pytest.raises(ActionRiskUnavailableError, match="calibrate --agent") as info:
        reloaded.decision_rule(cfg)
    assert isinstance(info.value, ArtifactMismatchError)
    assert reloaded.decision_rule(cfg.with_overrides(action_risk_target=None)).mode == "risk"
    # the action statistic needs only the tool-call verdicts: runs whose final answer the
    # judge could not label are in it too (here the last 40: their scores are not), so it
    # may hold more runs than the run-level scores; the action certificate counts them all
    every = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(cal.stat[:-40], cal.right[:-40], action_statistic=cal.action),
    )
    block = every.decision_rule(cfg).guarantee.action_risk
    assert block["n"] == cal.action.size == every.n + 40
    with pytest.raises(InvalidInputError, match="finite"):
        GuardArtifact.from_calibration(
            scorer=PerplexityScorer(),
            calibration=CalibrationSet(
                cal.stat, cal.right, action_statistic=np.r_[cal.action[:-1], np.nan]
            ),
        )


def test_calibration_computes_the_statistics_only_where_wrong_calls_can_be_told() -> None:
    peru = ExpectedCall.of("country_facts", {"country": "Peru"})

    def row(country: str) -> dict[str, object]:
        return {
            "agent": {
                "reason": "final_answer",
                "messages": [
                    {"role": "human", "content": "q"},
                    {
                        "role": "ai",
                        "tool_calls": [{"name": "country_facts", "args": {"country": country}}],
                    },
                    {"role": "tool", "content": "r"},
                    {"role": "ai", "content": "Lima.", "tool_calls": []},
                ],
            }
        }

    items = [
        QAItem(id=f"q{i}", question="q", answers=("Lima",), expected_tool_calls=(peru,))
        for i in range(2)
    ]
    rows = {"q0": row("Peru"), "q1": row("Lima")}
    steps = [[0.3, 0.1], [0.2, 0.6]]
    out = calibration_action_statistics(items, rows, steps, None)  # type: ignore[arg-type]
    assert out is not None and out.tolist() == [math.inf, 0.2]
    plain = [QAItem(id="q0", question="q", answers=("Lima",)), items[1]]
    assert calibration_action_statistics(plain, rows, steps, None) is None  # type: ignore[arg-type]
