"""Agent runs for calibration (calibration/building/answering/agents.py): how a run ends, what is
recorded of it, and what the artifact's agent record summarises. A scripted LangChain chat
model drives a real ``create_agent`` graph through each ending; the real model runs the
same code in tests/test_agent_calibration.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool

from abstain_guard.calibration.building.answering.agents import (
    FINAL_ANSWER,
    AgentRun,
    load_agent_factory,
    offered_once,
    run_agent,
    run_agents,
    run_row,
    runs_summary,
)
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.run.store import RunStore
from abstain_guard.errors import CalibrationError, ConfigError


class Scripted(GenericFakeChatModel):
    """Replies from a script; accepts tools as a tool-calling chat model does."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        from langchain_core.utils.function_calling import convert_to_openai_tool

        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)


@tool
def lookup(country: str) -> str:
    """Facts about a country."""
    return f"{country}: capital Lima"


@tool
def broken(country: str) -> str:
    """A tool that always fails."""
    raise ValueError("the facts service is down")


def _call(name: str, n: int = 1, **args: Any) -> AIMessage:
    return AIMessage(content="", tool_calls=[{"name": name, "args": args, "id": f"call_{n}"}])


def _agent(script: list[AIMessage], tools: list[Any], **kw: Any) -> Any:
    return create_agent(Scripted(messages=iter(script)), tools=tools, **kw)


def test_a_run_with_a_tool_call_ends_in_a_final_answer_and_records_its_steps():
    agent = _agent(
        [_call("lookup", country="Peru"), AIMessage(content="Lima.")],
        [lookup],
        system_prompt="Answer briefly.",
    )
    run = run_agent(agent, [HumanMessage("Capital of Peru?")], 10)
    assert run.reason == FINAL_ANSWER and run.final is not None and run.final.text == "Lima."
    assert (run.tool_calls, run.tool_errors, run.model_calls) == (1, 0, 2)
    assert [m["role"] for m in run.messages] == ["ai", "tool", "ai"]
    assert run.messages[1]["content"] == "Peru: capital Lima"
    assert len(run.offered) == 2
    assert {c["system_prompt"] for c in run.offered} == {"Answer briefly."}
    assert run.offered[0]["tools"][0]["function"]["name"] == "lookup"


def test_a_run_that_keeps_calling_tools_stops_at_the_step_limit():
    agent = _agent([_call("lookup", n, country="Peru") for n in range(20)], [lookup])
    run = run_agent(agent, [HumanMessage("Capital of Peru?")], 4)
    assert run.final is None and run.reason == "step_limit"
    # the steps it made before the limit are kept: a step guard decides on each of them
    assert run.model_calls >= 1 and run.tool_calls >= 1
    assert [m["role"] for m in run.messages][:2] == ["ai", "tool"]


def test_a_tool_that_raises_is_recorded_not_raised():
    agent = _agent([_call("broken", country="Peru"), AIMessage(content="Lima.")], [broken])
    run = run_agent(agent, [HumanMessage("Capital of Peru?")], 10)
    # LangChain either hands the error back to the model (a tool message with status
    # "error") or ends the run: both are recorded, neither raises
    if run.final is not None:
        assert run.tool_errors == 1
    else:
        assert run.reason.startswith("error: ") and "facts service is down" in run.reason


def test_runs_are_cached_per_question_and_not_run_again(tmp_path):
    store = RunStore(tmp_path / "run.sqlite")
    items = [QAItem(id="q1", question="Capital of Peru?", answers=("Lima",))]
    first = run_agents(
        _agent([AIMessage(content="Lima.")], []),
        items,
        store,
        key_parts=["fp", "m:f"],
        step_limit=5,
        progress=False,
    )
    # a model with nothing left to say would raise if it were called again
    again = run_agents(
        _agent([], []), items, store, key_parts=["fp", "m:f"], step_limit=5, progress=False
    )
    assert again["q1"]["text"] == first["q1"]["text"] == "Lima."
    other = run_agents(
        _agent([AIMessage(content="Cusco.")], []),
        items,
        store,
        key_parts=["fp", "m:g"],
        step_limit=5,
        progress=False,
    )
    assert other["q1"]["text"] == "Cusco."


class _Together(BaseChatModel):
    """Answers each question with itself only once ``barrier.parties`` calls wait at once:
    runs made one after another break the barrier (each run then ends in an error)."""

    barrier: Any

    @property
    def _llm_type(self) -> str:
        return "together"

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any):
        self.barrier.wait()
        question = next(m.content for m in messages if isinstance(m, HumanMessage))
        return ChatResult(generations=[ChatGeneration(message=AIMessage(f"re: {question}"))])


def test_runs_go_concurrently_and_each_row_is_its_own_questions(tmp_path):
    # calibration passes config.batch_size: a local model's scheduler then decodes the runs'
    # steps together (bitwise what each gets alone, tests/test_scheduler.py)
    items = [QAItem(id=f"q{i}", question=f"Question {i}?", answers=("x",)) for i in range(3)]
    agent = create_agent(_Together(barrier=threading.Barrier(3, timeout=10)), tools=[])
    rows = run_agents(
        agent,
        items,
        RunStore(tmp_path / "run.sqlite"),
        key_parts=["fp", "m:f"],
        step_limit=5,
        progress=False,
        concurrency=3,
    )
    assert {k: r["text"] for k, r in rows.items()} == {
        f"q{i}": f"re: Question {i}?" for i in range(3)
    }


def _row(reason: str, calls: int = 0, system: str | None = "S", tools: Any = None) -> dict:
    offered = [{"system_prompt": system, "tools": tools, "tool_choice": "auto"}]
    return {
        "agent": {
            "reason": reason,
            "tool_calls": calls,
            "offered": offered,
            "tool_errors": 0,
            "invalid_tool_calls": 0,
            "model_calls": calls + 1,
        }
    }


def test_runs_summary_counts_endings_and_calls():
    rows = [
        _row(FINAL_ANSWER, 1),
        _row(FINAL_ANSWER, 0),
        _row("step_limit", 5),
        _row("error: ValueError: down", 1),
    ]
    summary = runs_summary(rows)
    assert summary["n"] == 4 and summary["final_answers"] == 2
    assert summary["without_final_answer"] == {"step_limit": 1, "error: ValueError": 1}
    assert summary["tool_calls"]["histogram"] == {"0": 1, "1": 2, "5": 1}
    assert summary["tool_calls"]["runs_with_a_call"] == 3


def test_offered_once_refuses_an_agent_whose_prompt_or_tools_vary():
    schema = [{"type": "function", "function": {"name": "lookup"}}]
    same = offered_once([_row(FINAL_ANSWER, tools=schema), _row(FINAL_ANSWER, tools=schema)])
    assert same["system_prompt"] == "S" and same["tools"] == schema
    assert same["final_tool_choice"] == "auto"
    with pytest.raises(CalibrationError, match="system prompts"):
        offered_once([_row(FINAL_ANSWER, system="A"), _row(FINAL_ANSWER, system="B")])
    with pytest.raises(CalibrationError, match="tool lists"):
        offered_once([_row(FINAL_ANSWER, tools=schema), _row(FINAL_ANSWER, tools=None)])


def test_run_row_keeps_what_scorers_read():
    msg = AIMessage(content="Lima.", response_metadata={"token_ids": [1, 2], "other": 1})
    row = run_row(AgentRun(msg, FINAL_ANSWER, [], []))
    assert row["text"] == "Lima." and row["metadata"] == {"token_ids": [1, 2]}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_colon", "package.module:factory"),
        ("not_a_module_xyz:f", "cannot import"),
        ("json:no_such_function", "has no attribute"),
        ("json:__doc__", "not callable"),
    ],
)
def test_load_agent_factory_errors_say_what_to_do(spec, match):
    with pytest.raises(ConfigError, match=match):
        load_agent_factory(spec)


def test_load_agent_factory_finds_the_example_from_the_project_root(monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    factory = load_agent_factory("examples.country_agent:build_agent")
    assert factory.__name__ == "build_agent"
