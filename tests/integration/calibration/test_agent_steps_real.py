"""Step gating on the embedded model: the three-tool lookup agent of
``examples/lookup_agent.py`` (the first call forced to call a tool, so the model picks the
tool and its argument) calibrated with ``calibrate --agent`` on eight questions with
their expected calls, then deployed with ``AbstentionMiddleware``.

What must hold: the artifact records step gating, the tool-call labelling, each call's
``tool_choice`` by position and the tool-step histogram; each calibration score is the
run's running maximum over its calls; the deployed agent's step scores equal the stored
ones and it stops a run before the tool call of a first step over τ.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.messages import HumanMessage, ToolMessage

from abstain_guard import AbstentionMiddleware, GuardArtifact, GuardConfig
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.questions.items import load_items
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.measure.deployment_check import live_check
from abstain_guard.contract.deployment import DeploymentRecord

pytestmark = [pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
FACTORY = "examples.lookup_agent:build_agent"
BUDGET = 48
N = 8  # split 1:1:4:2: 4 calibration runs, replayed live
N_CAL = 4


@pytest.fixture(scope="module")
def lookup_model(default_model: Any) -> Any:
    model = default_model.model_copy(update={"max_new_tokens": BUDGET})
    model._shared = default_model._shared  # the same loaded weights
    return model


@pytest.fixture(scope="module")
def example() -> Any:
    sys.path.insert(0, str(ROOT))
    from examples import lookup_agent

    return lookup_agent


@pytest.fixture(scope="module")
def calibrated(lookup_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("steps")
    config = CalibrationConfig(
        agent=FACTORY,
        agent_step_limit=8,  # as examples/lookup_agent.yaml
        scorer="perplexity",
        max_new_tokens=BUDGET,
        ratios=(1, 1, 4, 2),
        participation=0.5,
        cache_dir=str(tmp / "run.cache"),
        limit=N,  # the first N of the built-in lookup questions (relations mixed)
    )
    items, _ = load_items("builtin-lookup", config)
    summary = calibrate(
        "builtin-lookup", tmp / "guard", config=config, model=lookup_model, progress=False
    )
    return tmp, items, summary


def test_the_artifact_records_step_gating_and_the_runs_calls(calibrated: Any) -> None:
    tmp, items, summary = calibrated
    art = GuardArtifact.load(tmp / "guard")
    record = DeploymentRecord.from_metadata(art.metadata)
    assert record is not None and record.agent is not None
    assert record.agent.gating == "steps"
    assert record.agent.labelling == "final_answer_and_tool_calls"
    assert record.agent.call_tool_choices["0"] == ["any"]  # the forced first call
    assert (
        record.agent.tool_steps
        and sum(record.agent.tool_steps.values()) == (record.agent.runs["final_answers"])
    )
    # every calibration run is in the calibration set (runs without an answer are wrong)
    assert len(items) == N and len(art.scores) == summary.split_sizes["calibration"] == N_CAL
    # each calibration run's action statistic, for action_risk_target: its running maximum
    # at its first wrong tool call (inf: none), never above the run's own statistic
    actions = art.action_statistic
    assert actions is not None and actions.shape == art.scores.shape
    ran = np.isfinite(actions)
    assert (actions[ran] <= art.scores[ran]).all()


@pytest.fixture(scope="module")
def live(calibrated: Any, lookup_model: Any) -> dict[str, Any]:
    """The deployed, guarded agent on the calibration questions (``evaluate --live``)."""
    tmp, _, _ = calibrated
    return live_check(
        tmp / "guard",
        model=lookup_model,
        guard_config=GuardConfig(participation=0.5),
        split="calibration",
        progress=False,
        out=tmp / "live",
    )


def test_live_step_scores_equal_the_stored_ones_and_runs_score_their_maximum(
    live: dict[str, Any],
) -> None:
    summary = live["summary"]
    assert summary["gating"] == "steps" and summary["n"] == N_CAL
    assert summary["steps_compared"] >= N_CAL  # at least the forced call of every run
    assert summary["step_abs_diff_max"] <= 1e-6
    assert summary["same_decision"] == 1.0
    for row in live["rows"]:
        assert row["stored_score"] == max(row["step_scores_stored"])  # the running maximum
        if row["abstained"]:  # stopped: nothing from that step on ran
            stop = row["stopped_at_step"]
            assert row["step_scores_live"][stop] > live["threshold"]
            assert row["tool_calls_executed"] <= stop


def test_the_deployed_agent_stops_before_a_tool_call_over_tau(
    calibrated: Any, live: dict[str, Any], lookup_model: Any, example: Any
) -> None:
    tmp, _, _ = calibrated
    art = GuardArtifact.load(tmp / "guard")
    # forced first calls are confident, and the ones that are not are mostly calls whose
    # arguments fail validation (no tool would run anyway): lower τ until a run whose first
    # call is over τ withholds a valid call -- at last τ = -inf (a risk target no threshold
    # certifies, on_infeasible="abstain_all"), where every first call is over τ
    withheld_calls: list[Any] = []
    tried: set[str] = set()
    configs = [GuardConfig(participation=p) for p in (0.5, 0.3, 0.12)] + [
        GuardConfig(mode="risk", risk_target=0.01, on_infeasible="abstain_all")
    ]
    for config in configs:
        tau = art.decision_rule(config).threshold
        guard = AbstentionMiddleware(tmp / "guard", config=config)
        agent = example.build_agent(lookup_model, middleware=[guard])
        for row in live["rows"]:
            if row["step_scores_stored"][0] <= tau or row["question"] in tried:
                continue
            tried.add(row["question"])
            state = agent.invoke({"messages": [HumanMessage(row["question"])]})
            assert not any(isinstance(m, ToolMessage) for m in state["messages"])  # none ran
            final = state["messages"][-1]
            decision = final.response_metadata["abstention"]
            assert decision["step"] == 0 and decision["abstained"]
            withheld_calls = final.response_metadata["withheld_response"].get("tool_calls", [])
            if withheld_calls:
                assert decision["tool_calls"] == [c["name"] for c in withheld_calls]
                break
        if withheld_calls:
            break
    assert tau == -np.inf or withheld_calls
    assert withheld_calls, "no stopped run withheld a valid tool call"
