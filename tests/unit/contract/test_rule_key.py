"""GuardConfig.rule_key: the one key of every rule cache (the artifact's decision and group
rules), made of exactly the fields that change the rule."""

from __future__ import annotations

from typing import Any

import numpy as np

from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.config import GuardConfig
from abstain_guard.scorers import PerplexityScorer

#: A base config (risk mode, per-group rules) and, for every field, another valid value.
BASE: dict[str, Any] = {"mode": "risk", "risk_target": 0.2, "group_by": "relation"}
OTHER: dict[str, Any] = {
    "mode": "participation",
    "participation": 0.7,
    "risk_target": 0.3,
    "delta": 0.05,
    "action_risk_target": 0.1,
    "partial_release_target": 0.1,
    "abstain_message": "No idea.",
    "on_error": "raise",
    "scorer": "perplexity",
    "on_mismatch": "warn",
    "on_infeasible": "abstain_all",
    "group_by": "topic",
    "group_targets": {"capital": 0.1},
    "group_delta": "union",
    "group_fallback": "pooled",
    "unknown_group": "pooled",
    "on_abstain": "fallback",
}
#: What the rule does not depend on: how the guard behaves around it.
NOT_RULE = {"abstain_message", "on_error", "scorer", "on_mismatch", "group_by", "on_abstain"}


def _changed(field: str) -> GuardConfig:
    data = {**BASE, field: OTHER[field]}
    if field in ("action_risk_target", "partial_release_target"):
        data.pop("group_by")  # certified for the pooled rule only
    return GuardConfig(**data)


def test_every_field_is_classified_and_only_rule_fields_are_marked() -> None:
    assert set(OTHER) == set(GuardConfig.model_fields)  # a new field must be listed here
    assert set(GuardConfig.rule_fields()) == set(GuardConfig.model_fields) - NOT_RULE


def test_a_rule_field_changes_the_key_and_another_field_does_not() -> None:
    base = GuardConfig(**BASE)
    hash(base.rule_key())
    for field in GuardConfig.model_fields:
        if field in ("action_risk_target", "partial_release_target"):
            reference = GuardConfig(**{k: v for k, v in BASE.items() if k != "group_by"})
        else:
            reference = base
        changed = _changed(field)
        assert getattr(changed, field) != getattr(reference, field), field
        if field in NOT_RULE:
            assert changed.rule_key() == reference.rule_key(), field
        else:
            assert changed.rule_key() != reference.rule_key(), field


def test_group_targets_key_on_their_items_not_their_order() -> None:
    a = GuardConfig(group_by="g", group_targets={"x": 0.9, "y": 0.8})
    b = GuardConfig(group_by="g", group_targets={"y": 0.8, "x": 0.9})
    assert a.rule_key() == b.rule_key()


def test_the_artifact_caches_one_rule_per_key() -> None:
    from abstain_guard.artifact.guard_artifact import GuardArtifact

    rng = np.random.default_rng(0)
    scores = rng.normal(size=200)
    correct = (scores + rng.normal(size=200) < 0.5).astype(int)
    artifact = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(scores, correct)
    )
    first = artifact.decision_rule(GuardConfig(participation=0.8))
    assert artifact.decision_rule(GuardConfig(participation=0.8, on_error="raise")) is first
    other = artifact.decision_rule(GuardConfig(participation=0.7))
    assert other is not first and other.threshold < first.threshold
