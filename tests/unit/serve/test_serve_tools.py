"""``abstain-guard serve`` with tools and conversations, driven by the ``openai`` SDK and
``ChatOpenAI`` against the server on a free loopback port, around a scripted tool-calling
chat model (fast; the artifacts' deployment records are built by hand, see _serve_fakes).

What is accepted follows what the artifact was calibrated on: a conversation only by a
guard calibrated on conversations, the calibrated tools only (their calls come back as
OpenAI ``tool_calls``, ungated), tool turns only by a guard calibrated on an agent; the
passthrough server (``serve --no-guard``) takes any tools."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from _serve_fakes import (  # noqa: E402
    AGENT_PROMPT,
    QA_PROMPT,
    TOOLS,
    ToolScriptModel,
    artifact,
    capital_lookup,
)
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402

from abstain_guard import GuardConfig  # noqa: E402
from abstain_guard.serve.passthrough import ModelService  # noqa: E402
from abstain_guard.serve.runner import ServerThread  # noqa: E402
from abstain_guard.serve.service import GuardService  # noqa: E402

QUESTION = {"role": "user", "content": "What is the capital of Peru?"}
EARLIER = [
    {"role": "user", "content": "Tell me about Peru."},
    {"role": "assistant", "content": "Peru is a country in South America."},
]
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "capital_lookup", "arguments": '{"country": "Peru"}'},
        }
    ],
}


def _result(text: str = "Lima") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": "call_1", "content": text}


def _serve(service: Any) -> Iterator[tuple[Any, Any, ServerThread]]:
    with ServerThread(service) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        yield client, service, server


def _guard(**kind: bool) -> GuardService:
    return GuardService.from_artifact(
        artifact(**kind), GuardConfig(participation=0.8), model=ToolScriptModel()
    )


@pytest.fixture(scope="module")
def single() -> Iterator[tuple[Any, Any, ServerThread]]:
    yield from _serve(_guard())


@pytest.fixture(scope="module")
def conversations() -> Iterator[tuple[Any, Any, ServerThread]]:
    yield from _serve(_guard(conversations=True))


@pytest.fixture(scope="module")
def agent() -> Iterator[tuple[Any, Any, ServerThread]]:
    yield from _serve(_guard(tools=True))


@pytest.fixture(scope="module")
def passthrough() -> Iterator[tuple[Any, Any, ServerThread]]:
    yield from _serve(ModelService(ToolScriptModel(), model_name="raw", max_tokens=64))


def _ask(client: Any, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(model="abstain-guard", messages=messages, **extra)


def _last_call(service: Any) -> tuple[list[Any], dict[str, Any]]:
    model = service.chat_model
    return model.seen[-1]  # type: ignore[no-any-return]


# --- conversations ---------------------------------------------------------------------------


def test_a_guard_calibrated_on_single_questions_refuses_a_conversation(single: Any) -> None:
    client, service, _ = single
    assert _ask(client, [QUESTION]).choices[0].model_extra["abstention"]["abstained"] is False
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, [*EARLIER, QUESTION])
    message = info.value.body["message"]
    assert "calibrated on single questions" in message and "2 earlier messages" in message
    assert "calibrate on conversations" in message and "'history'" in message
    with pytest.raises(openai.BadRequestError, match="calibrated without tools"):
        _ask(client, [QUESTION], tools=TOOLS)
    with pytest.raises(openai.BadRequestError, match="calibrated on an agent"):
        _ask(client, [QUESTION, CALL, _result()])
    assert service.in_flight == 0


def test_a_guard_calibrated_on_conversations_answers_one(conversations: Any) -> None:
    client, service, _ = conversations
    completion = _ask(client, [*EARLIER, QUESTION])
    choice = completion.choices[0]
    assert choice.message.content == "Lima" and choice.finish_reason == "stop"
    decision = choice.model_extra["abstention"]
    assert decision["abstained"] is False and not decision["guarantee"].get("warnings")
    messages, _ = _last_call(service)
    assert [type(m) for m in messages] == [SystemMessage, HumanMessage, AIMessage, HumanMessage]
    assert [m.content for m in messages] == [
        QA_PROMPT,
        *[t["content"] for t in EARLIER],
        QUESTION["content"],
    ]
    history = messages[1:3]
    in_process = service.chain.invoke({"question": QUESTION["content"], "history": history})
    assert decision["score"] == in_process.response_metadata["abstention"]["score"]
    assert _ask(client, [QUESTION]).choices[0].message.content == "Lima"  # single: still fine


def test_earlier_turns_must_have_the_calibrated_shape(conversations: Any) -> None:
    client, _, _ = conversations
    with pytest.raises(openai.BadRequestError, match="alternate"):
        _ask(client, [EARLIER[1], QUESTION])
    with pytest.raises(openai.BadRequestError, match="system message differs"):
        _ask(client, [{"role": "system", "content": "Be verbose."}, *EARLIER, QUESTION])
    with pytest.raises(openai.BadRequestError, match="ending with a tool result"):
        _ask(client, [QUESTION, {"role": "assistant", "content": "Lima"}])


# --- tools -----------------------------------------------------------------------------------


def test_the_calibrated_tools_come_back_as_openai_tool_calls_ungated(agent: Any) -> None:
    client, service, _ = agent
    raw = client.chat.completions.with_raw_response.create(
        model="abstain-guard", messages=[QUESTION], tools=TOOLS, logprobs=True
    )
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id == "call_1"
    assert call.function.name == "capital_lookup"
    assert json.loads(call.function.arguments) == {"country": "Peru"}
    assert "abstention" not in (choice.model_extra or {})  # not a final answer: not gated
    assert not any(h.startswith("x-abstain-guard") for h in raw.headers)
    assert choice.logprobs is not None and choice.logprobs.content
    messages, options = _last_call(service)
    assert isinstance(messages[0], SystemMessage) and messages[0].content == AGENT_PROMPT
    assert options["tools"] == TOOLS and options["max_new_tokens"] == 24


def test_a_final_answer_after_tool_results_is_gated(agent: Any) -> None:
    client, service, _ = agent
    answered = _ask(client, [QUESTION, CALL, _result("Lima")], tools=TOOLS).choices[0]
    assert answered.message.content == "Lima" and answered.finish_reason == "stop"
    decision = answered.model_extra["abstention"]
    assert decision["abstained"] is False and not decision["guarantee"].get("warnings")
    assert decision["tool_steps"] == 1
    messages, _ = _last_call(service)
    assert [type(m) for m in messages] == [SystemMessage, HumanMessage, AIMessage, ToolMessage]
    assert messages[2].tool_calls[0]["args"] == {"country": "Peru"}
    withheld = _ask(client, [QUESTION, CALL, _result("unknown")], tools=TOOLS).choices[0]
    assert withheld.model_extra["abstention"]["abstained"] is True
    assert withheld.message.content == GuardConfig().abstain_message
    assert withheld.message.tool_calls is None and withheld.logprobs is None


def test_the_stream_carries_tool_calls(agent: Any) -> None:
    client, _, _ = agent
    chunks = list(_ask(client, [QUESTION], tools=TOOLS, stream=True))
    calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
    assert [(c.index, c.function.name) for c in calls] == [(0, "capital_lookup")]
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == "tool_calls"


def test_other_tools_or_choices_are_refused_naming_the_calibrated_ones(agent: Any) -> None:
    client, service, _ = agent
    other = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "weather"}}]
    with pytest.raises(openai.BadRequestError, match=r"calibrated with: \['capital_lookup'\]"):
        _ask(client, [QUESTION], tools=other)
    with pytest.raises(openai.BadRequestError, match=r"with the tools \['capital_lookup'\]"):
        _ask(client, [QUESTION])
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        _ask(client, [QUESTION], tools=TOOLS, tool_choice="required")
    assert _ask(client, [QUESTION], tools=TOOLS, tool_choice="auto").choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="calibrated on single questions"):
        _ask(client, [*EARLIER, QUESTION], tools=TOOLS)
    with pytest.raises(openai.BadRequestError, match="no earlier assistant message made"):
        _ask(client, [QUESTION, _result()], tools=TOOLS)
    with pytest.raises(openai.BadRequestError, match="not JSON"):
        bad = {
            **CALL,
            "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "f", "arguments": "{"}}],
        }
        _ask(client, [QUESTION, bad, _result()], tools=TOOLS)
    assert service.in_flight == 0


def test_a_chat_openai_agent_runs_against_the_guard(agent: Any) -> None:
    create_agent = pytest.importorskip("langchain.agents").create_agent
    langchain_openai = pytest.importorskip("langchain_openai")
    _, _, server = agent
    llm = langchain_openai.ChatOpenAI(
        model="abstain-guard", base_url=server.base_url, api_key="unused", max_retries=0
    )
    runner = create_agent(llm, tools=[capital_lookup], system_prompt=AGENT_PROMPT)
    state = runner.invoke({"messages": [HumanMessage(QUESTION["content"])]})
    kinds = [type(m).__name__ for m in state["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert state["messages"][1].tool_calls[0]["name"] == "capital_lookup"
    assert state["messages"][-1].content == "Lima"


# --- serve --no-guard -------------------------------------------------------------------------


def test_the_passthrough_takes_tools_and_returns_tool_calls(passthrough: Any) -> None:
    client, service, server = passthrough
    choice = _ask(client, [QUESTION], tools=TOOLS, logprobs=True, top_logprobs=0).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "capital_lookup"
    assert choice.logprobs is not None
    final = _ask(client, [QUESTION, CALL, _result("Lima")], tools=TOOLS, logprobs=True)
    assert final.choices[0].message.content == "Lima"
    assert final.choices[0].logprobs.content[0].logprob < 0
    messages, options = _last_call(service)
    assert isinstance(messages[-1], ToolMessage) and options["tools"] == TOOLS
    create_agent = pytest.importorskip("langchain.agents").create_agent
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model="raw", base_url=server.base_url, api_key="unused", max_retries=0, logprobs=True
    )
    state = create_agent(llm, tools=[capital_lookup]).invoke(
        {"messages": [HumanMessage(QUESTION["content"])]}
    )
    last = state["messages"][-1]
    assert last.content == "Lima" and last.response_metadata["logprobs"]["content"]
    with pytest.raises(openai.BadRequestError, match="no earlier assistant message made"):
        _ask(client, [QUESTION, _result()])


def test_an_agent_calibrated_on_conversations_takes_earlier_tool_turns() -> None:
    earlier_run = [
        {"role": "user", "content": "What is the capital of Chile?"},
        {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "id": "call_0"}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "Santiago"},
        {"role": "assistant", "content": "Santiago"},
    ]
    for client, service, _ in _serve(_guard(tools=True, conversations=True)):
        reply = _ask(client, [*earlier_run, QUESTION], tools=TOOLS).choices[0]
        assert reply.finish_reason == "tool_calls"
        final = _ask(client, [*earlier_run, QUESTION, CALL, _result()], tools=TOOLS).choices[0]
        decision = final.model_extra["abstention"]
        assert decision["abstained"] is False and not decision["guarantee"].get("warnings")
        messages, _ = _last_call(service)
        assert len(messages) == 1 + len(earlier_run) + 3
        assert service.describe()["conversations"] is True
        assert service.describe()["tools"] == ["capital_lookup"]
