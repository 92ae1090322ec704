"""The certifiable frontier: certified participation per (ε, δ), the smallest certifiable ε,
the perfect-scorer size check, and the guard's refusal of a target below the frontier."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.errors import ConfigError, UncertifiableTargetError
from abstain_guard.guarantee import conformal
from abstain_guard.guarantee.decision import decision_rule
from abstain_guard.guarantee.frontier import (
    certifiable_frontier,
    perfect_scorer_certifies,
    smallest_certifiable_risk,
)


def _calibration(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Scores where the confident half is 90 % right and the rest 30 %."""
    rng = np.random.default_rng(seed)
    scores = rng.uniform(size=n)
    p_right = np.where(scores < 0.5, 0.9, 0.3)
    return scores, rng.uniform(size=n) < p_right


def test_frontier_agrees_with_risk_threshold_point_by_point() -> None:
    scores, correct = _calibration()
    points = certifiable_frontier(scores, correct, risk_targets=(0.05, 0.15, 0.3), deltas=(0.1,))
    assert [p.risk_target for p in points] == [0.05, 0.15, 0.3]
    for p in points:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", conformal.ConformalWarning)
            res = conformal.risk_threshold(scores, correct, p.risk_target, p.delta)
        assert (p.feasible, p.participation, p.threshold) == (
            res.feasible,
            res.participation,
            res.threshold,
        )
    assert points[-1].feasible and points[-1].participation > 0.3
    assert not points[0].feasible and points[0].threshold == -math.inf


def test_smallest_certifiable_is_the_first_feasible_target() -> None:
    scores, correct = _calibration()
    smallest = smallest_certifiable_risk(scores, correct, 0.1)
    assert smallest is not None and 0.05 < smallest < 0.3
    below, at = certifiable_frontier(
        scores, correct, risk_targets=(round(smallest - 0.01, 2), smallest), deltas=(0.1,)
    )
    assert not below.feasible and at.feasible
    # a looser delta never needs a larger target
    looser = smallest_certifiable_risk(scores, correct, 0.2)
    assert looser is not None and looser <= smallest


def test_perfect_scorer_check_is_monotone_in_the_calibration_size() -> None:
    verdicts = [perfect_scorer_certifies(n, 0.05, 0.1) for n in range(2, 200)]
    first = verdicts.index(True)
    assert 10 < first + 2 < 150  # a few dozen answers, all right, are needed for ε = 0.05
    assert all(verdicts[first:]) and not any(verdicts[:first])
    assert not perfect_scorer_certifies(1, 0.5, 0.1)


def test_guard_refuses_a_target_below_the_frontier_and_names_the_smallest() -> None:
    scores, correct = _calibration()
    smallest = smallest_certifiable_risk(scores, correct, 0.1)
    assert smallest is not None
    with pytest.raises(UncertifiableTargetError, match=f"smallest risk_target .* is {smallest:g}"):
        decision_rule(scores, correct, GuardConfig(mode="risk", risk_target=0.05, delta=0.1))
    try:
        decision_rule(scores, correct, GuardConfig(mode="risk", risk_target=0.05))
    except UncertifiableTargetError as exc:
        assert exc.smallest_risk_target == smallest
    rule = decision_rule(scores, correct, GuardConfig(mode="risk", risk_target=smallest))
    assert rule.guarantee.feasible and math.isfinite(rule.threshold)
    # explicit opt-in: abstain on everything
    opted = decision_rule(
        scores,
        correct,
        GuardConfig(mode="risk", risk_target=0.05, on_infeasible="abstain_all"),
    )
    assert opted.threshold == -math.inf and not opted.guarantee.feasible


def test_risk_mode_cannot_answer_everything_when_infeasible() -> None:
    with pytest.raises(ConfigError, match="answer_all"):
        GuardConfig(mode="risk", risk_target=0.2, on_infeasible="answer_all")


def test_shipped_artifact_has_a_frontier() -> None:
    from abstain_guard import default_artifact_path

    art = GuardArtifact.load(default_artifact_path())
    smallest = smallest_certifiable_risk(art.scores, art.correct, 0.1)
    assert smallest is None or 0.0 < smallest < 1.0
