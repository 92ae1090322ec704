"""``abstain-guard serve`` with step gating (issue 36 item 5): the documented forced agent runs
against it, each response of an agent run is decided on the run's running maximum, and the
earlier steps' scores come from the server's own record (fast: the scripted tool-calling
model of _serve_fakes, real HTTP through the ``openai`` SDK and ``ChatOpenAI``).

The fake artifact's τ is ~2.6 in perplexity: a confident call or answer is ~1.05, a call
about Chile ~1.65 (under τ, above a confident answer), a call about any other country ~55.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from _serve_fakes import (  # noqa: E402
    AGENT_PROMPT,
    TOOLS,
    ToolScriptModel,
    artifact,
)
from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from abstain_guard import GuardConfig  # noqa: E402
from abstain_guard.serve.conversation import split_turns  # noqa: E402
from abstain_guard.serve.runner import ServerThread  # noqa: E402
from abstain_guard.serve.schemas import ChatMessageIn  # noqa: E402
from abstain_guard.serve.service import GuardService  # noqa: E402
from abstain_guard.serve.step_gate import UNKNOWN_STEPS, run_so_far  # noqa: E402
from abstain_guard.serve.step_record import StepEntry, StepRecord  # noqa: E402

#: The forced agent's calibration: the first call forced, the second free; final answers
#: after one tool step.
FORCED = {"call_tool_choices": {"0": ["any"], "1": [None]}, "tool_steps": {"1": 50}}
PERU = {"role": "user", "content": "What is the capital of Peru?"}
CHILE = {"role": "user", "content": "What is the capital of Chile?"}
ATLANTIS = {"role": "user", "content": "What is the capital of Atlantis?"}
ROOT = Path(__file__).resolve().parents[3]


def _guard(
    config: GuardConfig | None = None, options: dict[str, Any] | None = None, **fields: Any
) -> GuardService:
    return GuardService.from_artifact(
        artifact(tools=True, **fields),
        config or GuardConfig(participation=0.8),
        model=ToolScriptModel(),
        **(options or {}),
    )


def _serve(service: GuardService) -> Iterator[tuple[Any, GuardService, ServerThread]]:
    with ServerThread(service) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        yield client, service, server


@pytest.fixture(scope="module")
def steps() -> Iterator[tuple[Any, GuardService, ServerThread]]:
    yield from _serve(_guard(gating="steps", **FORCED))


def _ask(client: Any, messages: list[dict[str, Any]], **extra: Any) -> Any:
    raw = client.chat.completions.with_raw_response.create(
        model="abstain-guard", messages=messages, tools=TOOLS, **extra
    )
    return raw.parse().choices[0], raw.headers


def _returned(choice: Any) -> dict[str, Any]:
    """The assistant message a client sends back with the tool result."""
    return choice.message.model_dump(exclude_none=True)


def _result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _model_calls(service: GuardService) -> int:
    return len(service.chat_model.seen)


# --- (a) the forced agent's tool_choice -----------------------------------------------------


def test_a_client_forcing_the_first_call_is_accepted_where_calibration_forced_it(
    steps: Any,
) -> None:
    client, service, _ = steps
    choice, _ = _ask(client, [PERU], tool_choice="required")
    assert choice.finish_reason == "tool_calls"
    assert service.chat_model.seen[-1][1]["tool_choice"] == "any"  # bound as calibrated
    named = {"type": "function", "function": {"name": "capital_lookup"}}
    for other in ({}, {"tool_choice": "auto"}, {"tool_choice": named}):
        with pytest.raises(openai.BadRequestError) as info:
            _ask(client, [PERU], **other)
        body = info.value.body
        assert body["code"] == "tool_choice_not_calibrated" and body["param"] == "tool_choice"
        assert "model call 1 of the run" in body["message"]
        assert "calibration's runs had 'required' there" in body["message"]
    second = [PERU, _returned(choice), _result(choice.message.tool_calls[0].id, "Lima")]
    with pytest.raises(openai.BadRequestError, match=r"model call 2 .* had 'auto' \(or none\)"):
        _ask(client, second, tool_choice="required")
    final, _ = _ask(client, second)  # free, as calibrated
    assert final.message.content == "Lima"
    assert service.describe()["call_tool_choices"] == FORCED["call_tool_choices"]


# --- (b), (c) every response decided on the running maximum ----------------------------------


def test_a_tool_call_over_tau_comes_back_as_the_abstention(steps: Any) -> None:
    client, _, _ = steps
    choice, headers = _ask(client, [ATLANTIS], tool_choice="required")
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == GuardConfig().abstain_message
    decision = choice.model_extra["abstention"]
    assert decision["abstained"] is True and decision["gating"] == "steps"
    assert decision["step"] == 0 and decision["tool_calls"] == ["capital_lookup"]
    assert decision["step_score"] == decision["run_statistic"] == decision["score"]
    assert decision["score"] > decision["threshold"]
    assert headers["x-abstain-guard-abstained"] == "true"


def test_a_confident_call_is_returned_and_its_step_recorded() -> None:
    for client, service, _ in _serve(_guard(gating="steps", **FORCED)):
        choice, headers = _ask(client, [PERU], tool_choice="required")
        (call,) = choice.message.tool_calls
        assert json.loads(call.function.arguments) == {"country": "Peru"}
        decision = choice.model_extra["abstention"]
        assert decision["abstained"] is False and decision["step"] == 0
        assert decision["score"] == decision["step_score"] < decision["threshold"]
        assert headers["x-abstain-guard-abstained"] == "false"
        assert len(service.steps) == 1
        sent = [PERU, _returned(choice), _result(call.id, "Lima")]
        turns = split_turns([ChatMessageIn.model_validate(m) for m in sent])
        run = run_so_far(service.steps, turns.question, turns.history, turns.steps)
        assert run.position == 1 and run.unknown == []
        assert run.previous == decision["step_score"]


def test_a_gated_call_streams_as_the_abstention(steps: Any) -> None:
    client, _, _ = steps
    chunks = list(
        client.chat.completions.create(
            model="abstain-guard", messages=[ATLANTIS], tools=TOOLS, tool_choice="required",
            stream=True,
        )
    )  # fmt: skip
    deltas = [ch.choices[0] for ch in chunks if ch.choices]
    assert not any(d.delta.tool_calls for d in deltas)
    assert "".join(d.delta.content or "" for d in deltas) == GuardConfig().abstain_message
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].model_extra["abstention"]["abstained"] is True


def test_the_next_request_is_decided_on_the_running_maximum(steps: Any) -> None:
    client, service, _ = steps
    call_step, _ = _ask(client, [CHILE], tool_choice="required")
    step_score = call_step.model_extra["abstention"]["step_score"]
    call_id = call_step.message.tool_calls[0].id
    peru, _ = _ask(client, [PERU], tool_choice="required")  # another run, the same call id
    assert peru.message.tool_calls[0].id == call_id
    final, _ = _ask(client, [CHILE, _returned(call_step), _result(call_id, "Santiago")])
    assert final.message.content == "Santiago" and final.finish_reason == "stop"
    decision = final.model_extra["abstention"]
    assert decision["abstained"] is False and decision["step"] == 1
    assert decision["step_score"] < step_score  # the answer is surer than the call ...
    assert decision["run_statistic"] == decision["score"] == step_score  # ... the run is not
    assert decision["tool_steps"] == 1
    # each run keeps its own record, though the model gave both calls one id
    peru_final, _ = _ask(client, [PERU, _returned(peru), _result(call_id, "Lima")])
    assert peru_final.model_extra["abstention"]["run_statistic"] < step_score
    assert service.in_flight == 0


def test_an_unknown_or_edited_tool_call_fails_closed(steps: Any) -> None:
    client, service, _ = steps
    first, _ = _ask(client, [PERU], tool_choice="required")
    sent = _returned(first)
    invented = {**sent, "tool_calls": [{**sent["tool_calls"][0], "id": "call_made_up"}]}
    edited_call = {
        **sent["tool_calls"][0],
        "function": {"name": "capital_lookup", "arguments": '{"country": "Chile"}'},
    }
    edited = {**sent, "tool_calls": [edited_call]}
    other = {"role": "user", "content": "Which city is the capital of Peru?"}
    cases = [(PERU, invented), (PERU, edited), (other, sent)]  # the last: replayed elsewhere
    for question, message in cases:
        calls = _model_calls(service)
        call_id = message["tool_calls"][0]["id"]
        choice, headers = _ask(client, [question, message, _result(call_id, "Lima")])
        assert choice.message.content == GuardConfig().abstain_message
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        decision = choice.model_extra["abstention"]
        assert decision["abstained"] is True and decision["reason"] == UNKNOWN_STEPS
        assert decision["unknown_tool_calls"] == [call_id] and decision["score"] is None
        assert "no record of its step decision" in decision["error"]
        assert _model_calls(service) == calls  # the model was not run
        assert headers["x-abstain-guard-score"] == "none"


def test_an_evicted_step_fails_closed() -> None:
    service = _guard(options={"step_record": StepRecord(max_entries=1)}, gating="steps", **FORCED)
    for client, _, _ in _serve(service):
        peru, _ = _ask(client, [PERU], tool_choice="required")
        _ask(client, [CHILE], tool_choice="required")  # evicts Peru's step
        call_id = peru.message.tool_calls[0].id
        choice, _ = _ask(client, [PERU, _returned(peru), _result(call_id, "Lima")])
        assert choice.model_extra["abstention"]["reason"] == UNKNOWN_STEPS
        assert service.describe()["step_record"]["evicted"] == 1


def test_only_run_outcomes_reach_the_monitor(steps: Any) -> None:
    client, _, server = steps

    def decisions() -> int:
        return int(httpx.get(f"{server.base_url}/monitor").json()["decisions"])

    before = decisions()
    call, _ = _ask(client, [PERU], tool_choice="required")
    assert decisions() == before  # a step that lets the run go on
    call_id = call.message.tool_calls[0].id
    _ask(client, [PERU, _returned(call), _result(call_id, "Lima")])
    _ask(client, [ATLANTIS], tool_choice="required")
    assert decisions() == before + 2  # the final answer, the stopped run


def test_the_forced_agent_runs_and_a_gated_call_never_executes(steps: Any) -> None:
    create_agent = pytest.importorskip("langchain.agents").create_agent
    langchain_openai = pytest.importorskip("langchain_openai")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.lookup_agent import ToolFirst  # the documented forced agent's middleware

    _, _, server = steps
    executed: list[str] = []

    @tool
    def capital_lookup(country: str) -> str:
        """The capital city of a country."""
        executed.append(country)
        return {"Peru": "Lima", "Chile": "Santiago"}.get(country, "unknown")

    llm = langchain_openai.ChatOpenAI(
        model="abstain-guard", base_url=server.base_url, api_key="unused", max_retries=0
    )
    runner = create_agent(
        llm, tools=[capital_lookup], system_prompt=AGENT_PROMPT, middleware=[ToolFirst()]
    )
    state = runner.invoke({"messages": [HumanMessage(PERU["content"])]})
    assert [type(m).__name__ for m in state["messages"]] == [
        "HumanMessage", "AIMessage", "ToolMessage", "AIMessage"
    ]  # fmt: skip
    assert state["messages"][-1].content == "Lima" and executed == ["Peru"]
    stopped = runner.invoke({"messages": [HumanMessage(ATLANTIS["content"])]})
    assert [type(m).__name__ for m in stopped["messages"]] == ["HumanMessage", "AIMessage"]
    assert stopped["messages"][-1].content == GuardConfig().abstain_message
    assert executed == ["Peru"]  # Atlantis's call was never run


# --- (d) tool-step counts, (e) final-answer gating ------------------------------------------


def test_an_uncalibrated_tool_step_count_is_a_warning_with_step_gating_else_refused() -> None:
    # issue 46 item 6: with step gating the run's tool already ran on the guard's word, so a
    # count outside calibration's range (here 1, calibration 2..3) is a warning, never a 400;
    # a count inside the range (1, calibration 0 and 2) is no mismatch at all
    cases = [
        ("steps", "raise", {"2": 50, "3": 4}),
        ("steps", "warn", {"2": 50, "3": 4}),
        ("steps", "raise", {"0": 30, "2": 20}),
        ("final_answer", "raise", {"2": 50, "3": 4}),
    ]
    for gating, on_mismatch, counts in cases:
        config = GuardConfig(participation=0.8, on_mismatch=on_mismatch)
        fields = {**FORCED, "tool_steps": counts}
        for client, service, _ in _serve(_guard(config, gating=gating, **fields)):
            call, _ = _ask(client, [PERU], tool_choice="required")  # a call: not checked
            messages = [PERU, _returned(call), _result(call.message.tool_calls[0].id, "Lima")]
            if gating == "final_answer":
                with pytest.raises(openai.BadRequestError) as info:
                    _ask(client, messages)
                assert info.value.body["code"] == "tool_steps_not_calibrated"
                assert "after 1 tool step(s)" in info.value.body["message"]
                assert "between 2 and 3" in info.value.body["message"]
                assert service.in_flight == 0
                continue
            final, _ = _ask(client, messages)
            decision = final.model_extra["abstention"]
            assert final.message.content == "Lima" and decision["abstained"] is False
            warnings = decision["guarantee"].get("warnings") or []
            if "0" in counts:
                assert warnings == []
                continue
            (warning,) = warnings
            assert warning.startswith("agent run: this final answer came after 1 tool step(s)")
            assert "between 2 and 3" in warning


def test_final_answer_gating_returns_tool_calls_ungated() -> None:
    for client, service, _ in _serve(_guard(gating="final_answer", **FORCED)):
        choice, headers = _ask(client, [ATLANTIS], tool_choice="required")  # forced: accepted
        assert choice.finish_reason == "tool_calls"
        assert "abstention" not in (choice.model_extra or {})
        assert not any(h.startswith("x-abstain-guard") for h in headers)
        call_id = choice.message.tool_calls[0].id
        final, _ = _ask(client, [ATLANTIS, _returned(choice), _result(call_id, "unknown")])
        decision = final.model_extra["abstention"]
        assert decision["abstained"] is True and "step" not in decision
        assert "gating" not in decision and len(service.steps) == 0
        assert service.describe()["gating"] == "final_answer"


# --- the step record ---------------------------------------------------------------------------


def test_the_step_record_is_an_lru_with_a_time_to_live() -> None:
    now = [0.0]
    record = StepRecord(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    entry = StepEntry(step=0, step_score=1.5, run_statistic=1.5)
    record.put("a", entry)
    record.put("b", entry)
    assert record.get("a") == entry  # "a" is now the most recently used
    record.put("c", entry)
    assert record.get("b") is None and record.get("a") == entry and len(record) == 2
    now[0] = 10.5
    assert record.get("a") is None and record.get("c") is None  # older than 10 s
    assert record.describe() == {
        "entries": 0, "max_entries": 2, "ttl_s": 10.0, "evicted": 1, "expired": 2
    }  # fmt: skip
    with pytest.raises(ValueError, match="max_entries >= 1"):
        StepRecord(max_entries=0)
