"""``calibrate --agent`` end to end on the embedded model: the country agent of
``examples/country_agent.py`` (one lookup tool, the first call forced), calibrated as
deployed on a few probe questions with final-answer gating, then deployed with
``AbstentionMiddleware`` (step gating on the real model: tests/test_agent_steps_real.py).

What must hold: the artifact records the tools, prompt, format and what the runs did; a
killed-and-restarted calibration runs no agent again; live scores of the deployed, guarded
agent equal the stored ones (the middleware scores the same message calibration scored);
another tool list or system prompt is refused naming the calibrated one; the trace shows the
tool step and the decision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_core.tracers.base import BaseTracer
from langchain_core.tracers.schemas import Run

from abstain_guard import AbstentionMiddleware, GuardArtifact, GuardConfig
from abstain_guard.calibration.building.answering import agents as agents_module
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.building.run.store import RunStore
from abstain_guard.calibration.measure.deployment_check import live_check
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.errors import ArtifactMismatchError
from abstain_guard.guard.tracing import EVENT_NAME

pytestmark = [pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
FACTORY = "examples.country_agent:build_forced_agent"
DATA = "builtin:capital,currency,continent"
#: 7 questions: 1 reference, 1 train, 4 calibration (the fewest that certify participation
#: 0.8, which the example deploys with), 1 test; each agent run takes several seconds.
ITEMS = builtin_probe_set(relations=("capital", "currency", "continent"))[:7]
BUDGET = 32


class MemoryTracer(BaseTracer):
    def __init__(self) -> None:
        super().__init__()
        self.runs: list[Run] = []

    def _persist_run(self, run: Run) -> None:
        self.runs.append(run)


def _all(run: Run) -> list[Run]:
    return [run, *[r for child in run.child_runs for r in _all(child)]]


@pytest.fixture(scope="module")
def agent_model(default_model: Any) -> Any:
    model = default_model.model_copy(update={"max_new_tokens": BUDGET})
    model._shared = default_model._shared  # the same loaded weights
    return model


@pytest.fixture(scope="module")
def example(agent_model: Any) -> Any:
    import sys

    sys.path.insert(0, str(ROOT))
    from examples import country_agent

    return country_agent


@pytest.fixture(scope="module")
def calibrated(agent_model: Any, example: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("agent")
    config = CalibrationConfig(
        agent=FACTORY,
        agent_gating="final_answer",  # step gating: tests/test_agent_steps_real.py
        agent_step_limit=6,
        scorer="perplexity",
        max_new_tokens=BUDGET,
        ratios=(1, 1, 4, 1),
        participation=0.5,
        cache_dir=str(tmp / "run.cache"),
        limit=len(ITEMS),
    )
    summary = calibrate(DATA, tmp / "guard", config=config, model=agent_model, progress=False)
    return tmp, config, summary


def test_the_artifact_records_the_agent_as_calibrated(calibrated: Any, example: Any) -> None:
    tmp, _, summary = calibrated
    art = GuardArtifact.load(tmp / "guard")
    record = DeploymentRecord.from_metadata(art.metadata)
    assert record is not None and record.agent is not None
    assert [t["function"]["name"] for t in record.tools or []] == ["country_facts"]
    assert record.agent.factory == FACTORY and record.agent.step_limit == 6
    assert record.agent.tool_call_format == "prompted"
    assert record.agent.system_prompt == example.SYSTEM_PROMPT
    assert record.prompts["open"].system_prompt == example.SYSTEM_PROMPT
    assert record.prompts["open"].max_new_tokens == BUDGET
    runs = record.agent.runs
    assert runs["n"] == len(ITEMS)
    assert runs["final_answers"] + sum(runs["without_final_answer"].values()) == len(ITEMS)
    assert runs["tool_calls"]["runs_with_a_call"] >= len(ITEMS) // 2  # the first call is forced
    assert record.agent.final_tool_choice is None  # later calls choose freely
    assert summary.split_sizes["calibration"] == len(art.scores)


def test_a_restarted_calibration_runs_no_agent_again(
    calibrated: Any, agent_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, config, _ = calibrated
    assert RunStore(Path(config.cache_dir) / "run.sqlite").count(agents_module.AGENT_NS) == len(
        ITEMS
    )

    def no_runs(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cached agent run was run again")

    monkeypatch.setattr(agents_module, "run_agent", no_runs)
    calibrate(DATA, tmp / "again", config=config, model=agent_model, progress=False)
    first, again = GuardArtifact.load(tmp / "guard"), GuardArtifact.load(tmp / "again")
    assert again.scores.tolist() == first.scores.tolist()


def test_live_scores_of_the_guarded_agent_equal_the_stored_ones(
    calibrated: Any, agent_model: Any
) -> None:
    tmp, _, _ = calibrated
    # the unguarded runs the live ones are compared with are calibration's own, read from
    # its cache (read-only): only the guarded runs are made here
    result = live_check(
        tmp / "guard",
        model=agent_model,
        guard_config=GuardConfig(participation=0.5),
        split="calibration",
        limit=4,
        progress=False,
        out=tmp / "live",
    )
    summary = result["summary"]
    assert summary["guarded_by"] == "middleware"
    scored = [r for r in result["rows"] if r["live_score"] is not None]
    assert len(scored) + summary["runs_without_final_answer"] == 4 and scored
    assert summary["abs_score_diff_max"] <= 1e-6
    assert summary["same_tokens"] == 1.0 and summary["same_decision"] == 1.0
    assert any(r["tool_steps"] >= 1 for r in scored)  # a malformed forced call has none
    # no unguarded run was made again: calibration's runs were read from its cache
    assert RunStore(tmp / "live" / "cache" / "run.sqlite").count(agents_module.AGENT_NS) == 0


def test_another_tool_list_or_prompt_is_refused_naming_the_calibrated_one(
    calibrated: Any, agent_model: Any, example: Any
) -> None:
    tmp, _, _ = calibrated

    @tool
    def web_search(query: str) -> str:
        """Search the web."""
        return "nothing"

    guard = AbstentionMiddleware(tmp / "guard")
    question = {"messages": [HumanMessage(ITEMS[0].prompt_text())]}
    other_tools = create_agent(
        agent_model,
        tools=[example.country_facts, web_search],
        system_prompt=example.SYSTEM_PROMPT,
        middleware=[guard],
    )
    with pytest.raises(ArtifactMismatchError, match=r"country_facts.*web_search|web_search"):
        other_tools.invoke(question)
    other_prompt = create_agent(
        agent_model,
        tools=[example.country_facts],
        system_prompt="Answer in French.",
        middleware=[guard],
    )
    with pytest.raises(ArtifactMismatchError, match="Answer in French") as err:
        other_prompt.invoke(question)
    assert example.SYSTEM_PROMPT[:40] in str(err.value)


def test_the_trace_shows_the_tool_step_and_the_decision(
    calibrated: Any, agent_model: Any, example: Any
) -> None:
    tmp, _, _ = calibrated
    guard = AbstentionMiddleware(tmp / "guard", config=GuardConfig(participation=0.5))
    agent = example.build_forced_agent(agent_model, middleware=[guard])
    tracer = MemoryTracer()
    state = agent.invoke(
        {"messages": [HumanMessage(ITEMS[0].prompt_text())]}, config={"callbacks": [tracer]}
    )
    decision = state["messages"][-1].response_metadata["abstention"]
    assert decision["tool_steps"] >= 1
    mismatches = [w for w in decision["guarantee"].get("warnings", []) if "bound" not in w]
    assert mismatches == []  # tools, prompt, format and budget as calibrated
    runs = _all(tracer.runs[0])
    assert any(r.run_type == "tool" and r.name == "country_facts" for r in runs)
    (node,) = [r for r in runs if {"abstained", "answered"} & set(r.tags or [])]
    assert node.extra["metadata"][EVENT_NAME]["tool_steps"] == decision["tool_steps"]


def test_the_example_deploys_the_calibrated_agent(
    calibrated: Any, agent_model: Any, example: Any
) -> None:
    tmp, _, _ = calibrated
    (final,) = example.main(str(tmp / "guard"), model=agent_model, questions=[ITEMS[1].question])
    info = final.response_metadata["abstention"]
    assert info["tool_steps"] >= 1 and info["abstained"] == (info["score"] > info["threshold"])
