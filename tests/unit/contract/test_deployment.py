"""The deployment record and its checks (pure), and the participation edge cases
(infeasible rank, ties at the threshold) that the guarantee must not hide."""

from __future__ import annotations

import numpy as np
import pytest

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.contract.deployment import (
    DeploymentRecord,
    PromptRecord,
    generation_mismatches,
    model_mismatches,
    sha256_text,
    tools_sha256,
)
from abstain_guard.errors import ArtifactSchemaError, InsufficientDataError
from abstain_guard.scorers import PerplexityScorer

SYSTEM = "Answer with only the answer."
RECORD = DeploymentRecord(
    model_fingerprint="m-1",
    chat_template_sha256="t-1",
    decoding={"temperature": 0.0, "top_p": 1.0, "top_k": None, "stop": []},
    prompts={
        "open": PromptRecord(system_prompt=SYSTEM, max_new_tokens=24),
        "choice": PromptRecord(system_prompt=SYSTEM, max_new_tokens=8, rendering="letters"),
    },
)


def _generation(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "max_new_tokens": 24,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": None,
        "stop": [],
        "system_prompt_sha256": sha256_text(SYSTEM),
        "chat_template_sha256": "t-1",
    }
    base.update(changes)
    return base


def test_matching_generation_has_no_mismatch() -> None:
    assert generation_mismatches(RECORD, _generation()) == []
    # both calibrated budgets of the same system prompt are accepted
    assert generation_mismatches(RECORD, _generation(max_new_tokens=8)) == []


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"max_new_tokens": 64}, "max_new_tokens=64"),
        ({"system_prompt_sha256": sha256_text("You are an agent.")}, "system prompt"),
        ({"system_prompt_sha256": None}, "system prompt"),
        ({"temperature": 0.7}, "temperature"),
        ({"top_p": 0.9}, "top_p"),
        ({"stop": ["\n"]}, "stop"),
        ({"chat_template_sha256": "t-2"}, "chat template"),
    ],
)
def test_each_setting_that_changes_the_scores_is_a_mismatch(
    changes: dict[str, object], needle: str
) -> None:
    problems = generation_mismatches(RECORD, _generation(**changes))
    assert len(problems) == 1 and needle in problems[0]


def test_unrecorded_generation_cannot_be_verified() -> None:
    (problem,) = generation_mismatches(RECORD, None)
    assert "cannot be checked" in problem


class _Model:
    def __init__(self, fingerprint: str | None) -> None:
        self.fingerprint = fingerprint


def test_every_model_is_compared() -> None:
    assert model_mismatches("m-1", [_Model("m-1"), _Model("m-1")]) == []
    problems = model_mismatches("m-1", [_Model("m-2"), _Model("m-1"), _Model(None)])
    assert len(problems) == 2
    assert "'m-2'" in problems[0] and "no fingerprint" in problems[1]
    assert model_mismatches(None, [_Model(None)]) == []  # nothing recorded, nothing to compare


def test_record_round_trip_and_kinds() -> None:
    meta = {"deployment": RECORD.to_json()}
    assert DeploymentRecord.from_metadata(meta) == RECORD
    assert DeploymentRecord.from_metadata({}) is None
    with pytest.raises(ArtifactSchemaError, match="several question kinds"):
        RECORD.kind()
    assert RECORD.kind("choice")[1].max_new_tokens == 8
    with pytest.raises(ArtifactSchemaError, match="no question kind"):
        RECORD.kind("numeric")
    with pytest.raises(ArtifactSchemaError, match="malformed"):
        DeploymentRecord.from_metadata({"deployment": {"prompts": {"open": {}}}})


def test_tool_hash_ignores_order_but_not_content() -> None:
    a = {"type": "function", "function": {"name": "a", "parameters": {}}}
    b = {"type": "function", "function": {"name": "b", "parameters": {}}}
    assert tools_sha256([a, b]) == tools_sha256([b, a])
    assert tools_sha256([a]) != tools_sha256([b])
    assert tools_sha256([]) is None and tools_sha256(None) is None


def _artifact(scores: np.ndarray) -> GuardArtifact:
    correct = np.arange(scores.size) % 2 == 0
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(scores, correct)
    )


def test_infeasible_participation_raises_with_the_size_that_works() -> None:
    art = _artifact(np.linspace(0.0, 1.0, 8))  # n = 8 < 9 needed for 0.9
    with pytest.raises(InsufficientDataError, match="at least 9"):
        art.decision_rule(GuardConfig(participation=0.9))
    answer_all = art.decision_rule(GuardConfig(participation=0.9, on_infeasible="answer_all"))
    assert answer_all.threshold == np.inf and answer_all.answers(1e9)
    assert answer_all.guarantee.on_infeasible == "answer_all"
    abstain_all = art.decision_rule(GuardConfig(participation=0.9, on_infeasible="abstain_all"))
    assert abstain_all.threshold == -np.inf and not abstain_all.answers(-1e9)
    assert any("abstains on every" in w for w in abstain_all.guarantee.warnings)
    # the smallest size that works is enough
    _artifact(np.linspace(0.0, 1.0, 9)).decision_rule(GuardConfig(participation=0.9))


def test_ties_at_the_threshold_are_reported() -> None:
    rule = _artifact(np.array([1.0, 2.0, 2.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])).decision_rule(
        GuardConfig(participation=0.3)
    )
    assert rule.threshold == 2.0 and rule.guarantee.ties_at_threshold == 3
    assert any("3 calibration scores equal the threshold" in w for w in rule.guarantee.warnings)
    distinct = _artifact(np.arange(9.0)).decision_rule(GuardConfig(participation=0.3))
    assert distinct.guarantee.ties_at_threshold == 1
    assert not any("equal the threshold" in w for w in distinct.guarantee.warnings)
