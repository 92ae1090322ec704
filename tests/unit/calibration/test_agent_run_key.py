"""The key of a cached agent run says how its tool calls were read: runs cached before tool
arguments were checked against the tool's JSON Schema (a call with invalid arguments was
then executed; now it is an invalid call, never run) are never reused — they miss and the
agent runs again (issue 45, item 4)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage

from abstain_guard.calibration.building.answering import agents
from abstain_guard.calibration.building.answering.agents import AGENT_NS, RUN_RECORD, run_agents
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.run.store import RunStore, content_key

ITEM = QAItem(id="q1", question="Capital of Peru?", answers=("Lima",))
KEY_PARTS = ["fp", "m:f"]
STEP_LIMIT = 5


def _agent(reply: str) -> Any:
    return create_agent(GenericFakeChatModel(messages=iter([AIMessage(content=reply)])), [])


def _pre_check_key() -> str:
    """The key ``run_agents`` gave this question's run before the schema check (steps-v1
    runs, the inputs as their JSON: a question alone is one human message)."""
    inputs = [{"role": "human", "content": ITEM.prompt_text()}]
    return content_key("agent", RUN_RECORD, *KEY_PARTS, STEP_LIMIT, inputs)


def _stale_row() -> dict[str, Any]:
    """A run whose tool call was executed with arguments the schema does not allow."""
    call = {"name": "lookup", "args": {"country": "Peru", "type": "capital"}, "id": "call_1"}
    return {
        "text": "Stale.",
        "finish_reason": "stop",
        "metadata": {},
        "agent": {
            "reason": "final_answer",
            "messages": [{"role": "ai", "content": "", "tool_calls": [call]}],
            "offered": [],
            "tool_calls": 1,
            "invalid_tool_calls": 0,
            "tool_errors": 0,
            "model_calls": 2,
        },
    }


def _run(store: RunStore, reply: str) -> dict[str, Any]:
    rows = run_agents(
        _agent(reply), [ITEM], store, key_parts=KEY_PARTS, step_limit=STEP_LIMIT, progress=False
    )
    return dict(rows["q1"])


def test_a_run_cached_before_the_schema_check_is_run_again(tmp_path) -> None:
    store = RunStore(tmp_path / "run.sqlite")
    store.put_many(AGENT_NS, {_pre_check_key(): _stale_row()})
    row = _run(store, "Lima.")
    assert row["text"] == "Lima." and row["key"] != _pre_check_key()
    assert store.get_many(AGENT_NS, [row["key"]])[row["key"]]["text"] == "Lima."


def test_the_run_key_carries_the_schema_check_version(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run is reused under the same check; a new version of the check misses it."""
    store = RunStore(tmp_path / "run.sqlite")
    first = _run(store, "Lima.")
    assert first["key"] == agents.run_key(ITEM, KEY_PARTS, STEP_LIMIT)
    assert _run(store, "Cusco.")["text"] == "Lima."  # reused: the agent is not run
    monkeypatch.setattr(agents, "TOOL_CALL_CHECK", agents.TOOL_CALL_CHECK + "-next")
    again = _run(store, "Cusco.")
    assert again["text"] == "Cusco." and again["key"] != first["key"]
