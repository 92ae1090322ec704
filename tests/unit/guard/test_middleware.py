"""AbstentionMiddleware in a real LangChain v1 agent (create_agent) with a scripted model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from uuid import UUID

import numpy as np
import pytest
from _core_fakes import QueueChatModel
from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from abstain_guard import AbstentionMiddleware, GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.contract.deployment import DeploymentRecord, PromptRecord
from abstain_guard.errors import ArtifactMismatchError
from abstain_guard.scorers import PerplexityScorer

CONFIDENT = [-0.01, -0.02]
UNSURE = [-2.0, -2.5]


@pytest.fixture(scope="module")
def artifact() -> GuardArtifact:
    rng = np.random.default_rng(0)
    scores = rng.uniform(1.0, 3.0, size=300)
    correct = rng.uniform(size=300) > (scores - 1.0) / 2.0
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, correct),
        model_fingerprint="m-1",
    )


class CustomEvents(BaseCallbackHandler):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_custom_event(self, name: str, data: Any, *, run_id: UUID, **kw: Any) -> None:
        self.events.append((name, data))


@tool
def capital_lookup(country: str) -> str:
    """Look up the capital of a country."""
    return {"Peru": "Lima"}.get(country, "unknown")


def _agent(model: QueueChatModel, artifact: GuardArtifact, **cfg: Any) -> Any:
    mw = AbstentionMiddleware(artifact, config=GuardConfig(**cfg))
    return create_agent(model, tools=[capital_lookup], middleware=[mw])


def test_unreliable_final_answer_is_replaced(artifact: GuardArtifact) -> None:
    call = {"name": "capital_lookup", "args": {"country": "Peru"}, "id": "call-1"}
    model = QueueChatModel(
        queue=[("", UNSURE, [call]), ("The capital is Quito.", UNSURE, [])], fingerprint="m-1"
    )
    handler = CustomEvents()
    result = _agent(model, artifact).invoke(
        {"messages": [HumanMessage("Capital of Peru?")]}, config={"callbacks": [handler]}
    )
    messages = result["messages"]
    # the tool-calling step is not judged, even though its logprobs are poor
    assert isinstance(messages[1], AIMessage) and messages[1].tool_calls
    assert isinstance(messages[2], ToolMessage) and messages[2].content == "Lima"
    final = messages[-1]
    assert len(messages) == 4  # replaced in place (same id), not appended
    assert final.content == "I don't know."
    decision = final.response_metadata["abstention"]
    assert decision["abstained"] is True and decision["score"] > decision["threshold"]
    assert final.response_metadata["withheld_response"]["content"] == "The capital is Quito."
    assert model.calls == 2
    assert [n for n, _ in handler.events] == ["abstention"]
    assert handler.events[0][1]["abstained"] is True


def test_reliable_final_answer_is_kept_and_annotated(artifact: GuardArtifact) -> None:
    model = QueueChatModel(queue=[("Lima.", CONFIDENT, [])], fingerprint="m-1")
    result = _agent(model, artifact).invoke({"messages": [HumanMessage("Capital of Peru?")]})
    final = result["messages"][-1]
    assert final.content == "Lima." and len(result["messages"]) == 2
    assert final.response_metadata["abstention"]["abstained"] is False
    assert "logprobs" in final.response_metadata


def test_async_agent(artifact: GuardArtifact) -> None:
    model = QueueChatModel(queue=[("Quito.", UNSURE, [])], fingerprint="m-1")
    agent = _agent(model, artifact, abstain_message="Unsure.")

    async def main() -> Any:
        return await agent.ainvoke({"messages": [HumanMessage("Capital of Peru?")]})

    result = asyncio.run(main())
    assert result["messages"][-1].content == "Unsure."


def test_fingerprint_checked_on_the_agent_model(artifact: GuardArtifact) -> None:
    model = QueueChatModel(queue=[("Lima.", CONFIDENT, [])], fingerprint="other")
    with pytest.raises(ArtifactMismatchError):
        _agent(model, artifact).invoke({"messages": [HumanMessage("Capital of Peru?")]})


def test_middleware_from_artifact_path(artifact: GuardArtifact, tmp_path: Path) -> None:
    path = artifact.save(tmp_path / "guard")
    mw = AbstentionMiddleware(path)
    assert mw.artifact.n == artifact.n and mw.config == GuardConfig()


AGENT_PROMPT = "You answer questions about capitals."


def _recorded_artifact(artifact: GuardArtifact, system_prompt: str) -> GuardArtifact:
    record = DeploymentRecord(
        model_fingerprint="m-1",
        prompts={"open": PromptRecord(system_prompt=system_prompt, max_new_tokens=24)},
    )
    meta = {**artifact.metadata, "deployment": record.to_json()}
    return GuardArtifact(
        artifact.scorer,
        CalibrationSet(artifact.scores, artifact.correct),
        model_fingerprint="m-1",
        metadata=meta,
    )


def _agent_with(artifact: GuardArtifact, model: QueueChatModel, tools: list, **cfg: Any) -> Any:
    mw = AbstentionMiddleware(artifact, config=GuardConfig(**cfg))
    return create_agent(model, tools=tools, system_prompt=AGENT_PROMPT, middleware=[mw])


def test_agent_system_prompt_and_tools_must_match_calibration(artifact: GuardArtifact) -> None:
    ask = {"messages": [HumanMessage("Capital of Peru?")]}
    other_prompt = _recorded_artifact(artifact, "Answer with only the answer.")
    model = QueueChatModel(queue=[("Lima.", CONFIDENT, [])], fingerprint="m-1")
    with pytest.raises(ArtifactMismatchError, match="system prompt"):
        _agent_with(other_prompt, model, []).invoke(ask)
    assert model.calls == 0  # refused before the model ran
    same_prompt = _recorded_artifact(artifact, AGENT_PROMPT)
    with pytest.raises(ArtifactMismatchError, match="capital_lookup"):
        _agent_with(same_prompt, model, [capital_lookup]).invoke(ask)


def test_agent_mismatch_opt_in_is_recorded(artifact: GuardArtifact) -> None:
    ask = {"messages": [HumanMessage("Capital of Peru?")]}
    model = QueueChatModel(queue=[("Lima.", CONFIDENT, [])], fingerprint="m-1")
    art = _recorded_artifact(artifact, AGENT_PROMPT)
    handler = CustomEvents()
    result = _agent_with(art, model, [capital_lookup], on_mismatch="warn").invoke(
        ask, config={"callbacks": [handler]}
    )
    warnings = result["messages"][-1].response_metadata["abstention"]["guarantee"]["warnings"]
    assert any("agent request" in w and "capital_lookup" in w for w in warnings)
    # the scripted model records no generation settings: that is reported too
    assert any("cannot be checked" in w for w in warnings)
    assert any("capital_lookup" in w for w in handler.events[0][1]["guarantee"]["warnings"])
