"""``abstain-guard serve`` on the real embedded model, driven by real OpenAI clients: the
``openai`` SDK and ``langchain_openai.ChatOpenAI`` against the server on a free loopback
port (uvicorn on a thread, the session's shared model)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from _kernel_notes import assert_only_kernel_notes
from langchain_core.messages import AIMessage, HumanMessage

from abstain_guard import GuardArtifact, GuardConfig, default_artifact_path
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.errors import ArtifactMismatchError
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.runner import ServerThread
from abstain_guard.serve.service import GuardService

pytestmark = [pytest.mark.model, pytest.mark.slow]

openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")

QUESTION = "What is the capital of France?"
OTHER = "What is the currency of Japan?"


@pytest.fixture(scope="module")
def service(default_model: Any) -> GuardService:
    return GuardService.from_artifact(
        default_artifact_path(), GuardConfig(participation=0.8), model=default_model
    )


@pytest.fixture(scope="module")
def server(service: GuardService) -> Any:
    with ServerThread(service) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def in_process(service: GuardService) -> Any:
    """The deployed chain's own answer to QUESTION (what the server must return)."""
    return service.chain.invoke({"question": QUESTION})


def _ask(question: str = QUESTION) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_invoke_returns_the_guard_answer_and_decision(client: Any, in_process: Any) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="abstain-guard", messages=_ask(), logprobs=True, top_logprobs=2
    )
    completion = raw.parse()
    choice = completion.choices[0]
    expected = in_process.response_metadata["abstention"]
    decision = choice.model_extra["abstention"]
    assert choice.message.content == in_process.content
    assert decision["abstained"] is expected["abstained"]
    assert decision["score"] == expected["score"]  # bitwise: the server runs the same chain
    assert decision["threshold"] == expected["threshold"]
    assert decision["guarantee"]["kind"] == "participation"
    assert raw.headers["x-abstain-guard-abstained"] == str(expected["abstained"]).lower()
    assert float(raw.headers["x-abstain-guard-score"]) == expected["score"]
    assert completion.usage.completion_tokens > 0
    if expected["abstained"]:
        assert choice.logprobs is None
    else:
        tokens = choice.logprobs.content
        ours = in_process.response_metadata["logprobs"]["content"]
        assert [t.logprob for t in tokens] == [t["logprob"] for t in ours]
        assert all(len(t.top_logprobs) == 2 for t in tokens)
        assert all(t.logprob <= 0.0 for t in tokens)


def test_stream_releases_the_decided_answer_as_sse(client: Any, in_process: Any) -> None:
    chunks = list(
        client.chat.completions.create(
            model="abstain-guard",
            messages=_ask(),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == in_process.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    decision = finals[0].choices[0].model_extra["abstention"]
    assert decision["score"] == in_process.response_metadata["abstention"]["score"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_chat_openai_invoke_and_stream(server: ServerThread, in_process: Any) -> None:
    llm = langchain_openai.ChatOpenAI(
        model="abstain-guard",
        base_url=server.base_url,
        api_key="unused",
        max_retries=0,
        logprobs=True,
        include_response_headers=True,
    )
    msg = llm.invoke(QUESTION)
    assert msg.content == in_process.content
    headers = msg.response_metadata["headers"]
    abstained = in_process.response_metadata["abstention"]["abstained"]
    assert headers["x-abstain-guard-abstained"] == str(abstained).lower()
    if not abstained:
        assert len(msg.response_metadata["logprobs"]["content"]) > 0
    streamed = "".join(str(c.content) for c in llm.stream(QUESTION))
    assert streamed == in_process.content


def test_malformed_requests_are_4xx_with_a_reason(client: Any, server: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError, match="calibrated on single questions"):
        client.chat.completions.create(
            model="abstain-guard",
            messages=[*_ask(), {"role": "assistant", "content": "Paris"}, *_ask(OTHER)],
        )
    with pytest.raises(openai.BadRequestError, match="system message differs"):
        client.chat.completions.create(
            model="abstain-guard", messages=[{"role": "system", "content": "Be verbose."}, *_ask()]
        )
    url = f"{server.base_url}/chat/completions"
    not_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]["message"]
    no_messages = httpx.post(url, json={"model": "abstain-guard", "messages": []})
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    huge = httpx.post(url, json={"messages": _ask("x" * 70_000)})
    assert huge.status_code == 413


def test_a_budget_other_than_the_calibrated_one_is_refused(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="calibrated with a budget of 24") as info:
        client.chat.completions.create(model="abstain-guard", messages=_ask(), max_tokens=64)
    assert info.value.code == "max_tokens_not_calibrated"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="abstain-guard", messages=_ask(), temperature=0.7)


def test_overload_and_draining_answer_at_once_with_retry_after(
    server: ServerThread, service: GuardService
) -> None:
    url = f"{server.base_url}/chat/completions"
    limit = service.max_in_flight
    service.max_in_flight = 0
    try:
        busy = httpx.post(url, json={"messages": _ask()}, timeout=5)
    finally:
        service.max_in_flight = limit
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    service.draining = True
    try:
        closing = httpx.post(url, json={"messages": _ask()}, timeout=5)
        health = httpx.get(f"{server.base_url[:-3]}/readyz")
    finally:
        service.draining = False
    assert closing.status_code == 503 and "retry-after" in closing.headers
    assert health.status_code == 503 and health.json()["status"] == "draining"


def test_readyz_models_and_metrics(server: ServerThread, client: Any) -> None:
    root = server.base_url[: -len("/v1")]
    health = httpx.get(f"{root}/readyz").json()
    assert health["status"] == "ok" and health["max_tokens"] == 24
    assert [m.id for m in client.models.list()] == ["abstain-guard"]
    client.chat.completions.create(model="abstain-guard", messages=_ask())
    text = httpx.get(f"{root}/metrics").text
    assert 'abstain_guard_requests_total{path="/v1/chat/completions",status="200"}' in text
    decided = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("abstain_guard_chat_completions_total")
        and ('outcome="answered"' in line or 'outcome="abstained"' in line)
    ]
    assert sum(decided) >= 1
    assert "abstain_guard_chat_completion_seconds_bucket" in text
    assert "abstain_guard_queue_depth" in text
    # the drift monitor saw the decisions (the shipped guard: participation 0.8, n = 960)
    monitored = [line for line in text.splitlines() if line.startswith("abstain_guard_monitor")]
    assert f"abstain_guard_monitor_decisions_total {sum(decided)}" in monitored
    assert 'abstain_guard_monitor_band{bound="lower"} 0.8' in monitored


def test_shutdown_finishes_the_request_in_flight(service: GuardService) -> None:
    srv = ServerThread(service).start()
    result: dict[str, Any] = {}

    def ask() -> None:
        result["response"] = httpx.post(
            f"{srv.base_url}/chat/completions", json={"messages": _ask(OTHER)}, timeout=120
        )

    asker = threading.Thread(target=ask)
    asker.start()
    deadline = time.monotonic() + 30
    while service.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert service.in_flight == 1, "the request never reached the guard"
    srv.stop()
    asker.join(120)
    assert result["response"].status_code == 200
    assert "abstention" in result["response"].json()["choices"][0]


EARLIER = [
    {"role": "user", "content": "Tell me about France."},
    {"role": "assistant", "content": "France is a country in Western Europe."},
]


def test_a_conversation_is_served_only_by_a_guard_calibrated_on_conversations(
    default_model: Any, service: GuardService
) -> None:
    """The shipped guard (single questions) refuses earlier turns, in the server and in its
    own response check (the model records ``history_messages``); the same guard marked as
    calibrated on conversations serves them, live score = its in-process chain's."""
    history = [HumanMessage(EARLIER[0]["content"]), AIMessage(EARLIER[1]["content"])]
    with pytest.raises(ArtifactMismatchError, match="carries 2 earlier messages"):
        service.chain.invoke({"question": QUESTION, "history": history})
    shipped = GuardArtifact.load(default_artifact_path())
    deployment = {**shipped.metadata["deployment"], "conversations": True}
    marked = GuardArtifact(
        shipped.scorer,
        CalibrationSet(shipped.scores, shipped.correct),
        model_fingerprint=shipped.model_fingerprint,
        metadata={**shipped.metadata, "deployment": deployment},
    )
    conversations = GuardService.from_artifact(
        marked, GuardConfig(participation=0.8), model=default_model
    )
    in_process = conversations.chain.invoke({"question": QUESTION, "history": history})
    decision = in_process.response_metadata["abstention"]
    assert_only_kernel_notes(decision["guarantee"].get("warnings"), marked, decision["threshold"])
    generated = in_process.response_metadata.get("withheld_response", {}).get(
        "response_metadata", in_process.response_metadata
    )
    assert generated["generation"]["history_messages"] == 2
    with ServerThread(conversations) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        choice = client.chat.completions.create(
            model="abstain-guard", messages=[*EARLIER, *_ask()]
        ).choices[0]
    decision = choice.model_extra["abstention"]
    assert decision["score"] == in_process.response_metadata["abstention"]["score"]
    assert choice.message.content == in_process.content


def test_the_passthrough_binds_tools_on_the_embedded_model(default_model: Any) -> None:
    """``serve --no-guard`` with OpenAI tools: a forced call comes back as ``tool_calls``
    (the embedded model's prompted tool format), with logprobs; a tool result is answered."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "capital_lookup",
                "description": "The capital city of a country.",
                "parameters": {
                    "type": "object",
                    "properties": {"country": {"type": "string"}},
                    "required": ["country"],
                },
            },
        }
    ]
    ask = [{"role": "user", "content": "What is the capital of Peru? Use the tool."}]
    with ServerThread(ModelService(default_model, max_tokens=48)) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        choice = client.chat.completions.create(
            model="abstain-guard",
            messages=ask,
            tools=tools,
            tool_choice="required",
            max_tokens=48,
            logprobs=True,
        ).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.logprobs.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "capital_lookup"
        assert "country" in json.loads(call.function.arguments)
        result = {"role": "tool", "tool_call_id": call.id, "content": "Lima"}
        follow_up = client.chat.completions.create(
            model="abstain-guard",
            messages=[*ask, choice.message.model_dump(exclude_none=True), result],
            tools=tools,
            max_tokens=48,
        ).choices[0]
    assert follow_up.finish_reason in ("stop", "length", "tool_calls")
    assert follow_up.message.content or follow_up.message.tool_calls
