"""What the engineer on call reads of ``abstain-guard serve`` (abstain_guard/serve/metrics.py,
telemetry.py, app.py): chat completions counted by how they ended (a scoring error is not
an abstention on score), the score histogram, τ, target and ``build_info``; ``/livez`` and
``/readyz``; JSON log lines with the request's ids; the guard's OpenTelemetry span; one
``finish_reason`` for an abstention; the artifact digest in the monitor log.

Fast: the scripted model of tests/_serve_fakes.py (real guard, real FastAPI app)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _serve_fakes import UNSURE, ToolScriptModel, artifact
from fastapi.testclient import TestClient
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatResult
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from abstain_guard import GuardArtifact, GuardConfig, __version__
from abstain_guard.cli.commands import build_parser
from abstain_guard.errors import BackendError
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.log import read_log
from abstain_guard.serve import telemetry
from abstain_guard.serve.app import create_app
from abstain_guard.serve.openai_format import completion_body, sse_chunks, sse_decided_end
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.service import GuardService, answer_of

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN}-01"


class OnCallModel(ToolScriptModel):
    """Answers "Lima" confidently; unsure for a question with "unsure", without logprobs
    (unscorable) for one with "broken"; fails like a dead engine for one with "down", and as
    an API client's connection does for one with "gone"."""

    def _reply(self, messages: list[BaseMessage], tools: Any) -> AIMessage:
        if "unsure" in str(messages[-1].content):
            return AIMessage(content="Maybe", response_metadata={"lp": UNSURE})
        return super()._reply(messages, tools)

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        question = str(messages[-1].content)
        if "down" in question:
            raise BackendError("The vLLM server at http://127.0.0.1:1 did not answer.")
        if "gone" in question:
            raise ConnectionResetError("Connection reset by peer")
        result = super()._generate(messages, *args, **kwargs)
        if "broken" in question:
            result.generations[0].message.response_metadata.pop("logprobs")
        return result


class EngineModel(OnCallModel):
    """As if on an engine of its own at ``engine_url`` (the vLLM backend's ``engine()``)."""

    engine_url: str = "http://127.0.0.1:9"

    def engine(self) -> tuple[str, dict[str, Any]]:
        return self.engine_url, {}


def _ask(text: str, **body: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **body}


@pytest.fixture
def saved(tmp_path: Path) -> GuardArtifact:
    return GuardArtifact.load(artifact().save(tmp_path / "guard"))


def _service(art: GuardArtifact, model: Any = None) -> GuardService:
    return GuardService.from_artifact(
        art, GuardConfig(participation=0.8), model=model or OnCallModel()
    )


def _metric(text: str, line: str) -> float:
    (value,) = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line + " ")]
    return value


def test_metrics_tell_errors_refusals_and_abstentions_apart(
    saved: GuardArtifact, tmp_path: Path
) -> None:
    service = _service(saved)
    monitor = GuardMonitor(log_path=tmp_path / "live.jsonl", seed=0)
    monitor.fit_artifact(saved, service.guard.config)
    with TestClient(create_app(service, monitor=monitor)) as client:
        for question in ("Peru?", "unsure?", "broken?"):
            assert client.post("/v1/chat/completions", json=_ask(question)).status_code == 200
        for question in ("down?", "gone?"):
            failed = client.post("/v1/chat/completions", json=_ask(question))
            assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        refused = client.post("/v1/chat/completions", json=_ask("Peru?", max_tokens=64))
        assert refused.status_code == 400
        text = client.get("/metrics").text
    ended = "abstain_guard_chat_completions_total"
    assert _metric(text, f'{ended}{{outcome="answered",reason="score"}}') == 1
    assert _metric(text, f'{ended}{{outcome="abstained",reason="score"}}') == 1
    assert _metric(text, f'{ended}{{outcome="abstained",reason="scoring_error"}}') == 1
    assert _metric(text, f'{ended}{{outcome="failed",reason="BackendError"}}') == 1
    assert _metric(text, f'{ended}{{outcome="failed",reason="ConnectionResetError"}}') == 1
    assert _metric(text, f'{ended}{{outcome="refused",reason="max_tokens_not_calibrated"}}') == 1
    for counter in ("abstain_guard_chat_completions", "abstain_guard_monitor_decisions"):
        assert f"# TYPE {counter}_total counter" in text
    assert _metric(text, "abstain_guard_monitor_decisions_total") == 3
    assert _metric(text, "abstain_guard_decision_score_count") == 2  # the scored ones
    rule = service.guard.decision_rule
    assert f'abstain_guard_decision_score_bucket{{le="{rule.threshold!r}"}}' in text
    assert _metric(text, 'abstain_guard_threshold{mode="participation"}') == rule.threshold
    assert _metric(text, 'abstain_guard_target{mode="participation"}') == 0.8
    assert _metric(text, "abstain_guard_monitor_up") == 1
    assert _metric(text, 'abstain_guard_monitor_write_failures_total{target="log"}') == 0
    build = (
        f'abstain_guard_build_info{{artifact_sha256="{saved.digest}",mode="participation",'
        f'scorer="{saved.scorer.name}",version="{__version__}"}}'
    )
    assert _metric(text, build) == 1
    header, records = read_log(tmp_path / "live.jsonl")  # stamped with the same digest
    assert header["source"]["artifact_sha256"] == saved.digest and len(records) == 3


def test_a_server_without_a_guard_says_so_in_build_info() -> None:
    with TestClient(create_app(ModelService(ToolScriptModel(), max_tokens=24))) as client:
        client.post("/v1/chat/completions", json=_ask("Peru?"))
        text = client.get("/metrics").text
    assert 'mode="none"' in text and "abstain_guard_monitor_up" not in text
    assert (
        "abstain_guard_threshold" not in text
        and "abstain_guard_chat_completions_total{" not in text
    )


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[str]:
    """An engine's health endpoint (``GET /health`` 200) on a free loopback port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_readyz_follows_the_backend_and_livez_only_the_process(
    saved: GuardArtifact, engine: str
) -> None:
    with TestClient(create_app(_service(saved, EngineModel(engine_url=engine)))) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["backend"] == {"ok": True, "url": engine}
    with TestClient(create_app(_service(saved, EngineModel()))) as client:  # nothing listens
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "unready"
        assert (
            ready.json()["backend"]["ok"] is False
            and "ConnectError" in ready.json()["backend"]["error"]
        )
        assert client.get("/livez").json() == {"status": "alive"}
    with TestClient(create_app(_service(saved))) as client:  # a model in this process
        assert client.get("/readyz").json()["backend"] == {"ok": True}


@pytest.fixture
def json_logs() -> Iterator[Any]:
    """JSON lines (``serve``'s formatter) of every logger at INFO, undone afterwards; yields a
    function returning the lines logged so far, parsed."""
    root, out = logging.getLogger(), io.StringIO()
    handler, level = logging.StreamHandler(out), root.level
    handler.setFormatter(telemetry.JsonFormatter())
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in out.getvalue().splitlines()]
    root.removeHandler(handler)
    root.setLevel(level)


def test_serve_logs_decisions_as_json_at_its_default_level() -> None:
    """``serve``'s logging (a process of its own: it replaces the root logger's handlers)."""
    script = (
        "from abstain_guard.cli.commands import build_parser\n"
        "from abstain_guard.guarantee.decision import Decision\n"
        "from abstain_guard.guard.tracing import record_decision\n"
        "from abstain_guard.serve.telemetry import configure_logging\n"
        "configure_logging(build_parser().parse_args(['serve']).log_level)\n"
        "record_decision(Decision(abstained=True, score=3.5, reason='score > threshold'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ABSTAIN_GUARD_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    (line,) = [json.loads(x) for x in done.stderr.splitlines()]
    assert line["level"] == "INFO" and line["logger"] == "abstain_guard"
    assert line["decision"]["abstained"] is True and line["decision"]["score"] == 3.5


def test_json_logs_carry_the_request_and_trace_ids(saved: GuardArtifact, json_logs: Any) -> None:
    headers = {"X-Request-Id": "req-7", "traceparent": TRACEPARENT}
    with TestClient(create_app(_service(saved))) as client:
        reply = client.post("/v1/chat/completions", json=_ask("Peru?"), headers=headers)
        refused = client.post("/v1/chat/completions", json=_ask("Peru?", max_tokens=64))
    assert reply.headers["x-request-id"] == "req-7"
    lines = json_logs()
    (decided,) = [line for line in lines if "decision" in line]  # INFO, the default level
    assert decided["level"] == "INFO" and decided["decision"]["abstained"] is False
    assert decided["request_id"] == "req-7" and decided["trace_id"] == TRACE_ID
    assert decided["completion_id"] == reply.json()["id"]
    (refusal,) = [line for line in lines if "refused" in line["message"]]
    assert refusal["request_id"] == refused.headers["x-request-id"]  # generated
    assert len(refusal["trace_id"]) == 32 and refusal["trace_id"] != TRACE_ID


def test_the_log_level_comes_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert build_parser().parse_args(["serve", "--log-level", "debug"]).log_level == "debug"
    monkeypatch.setenv("ABSTAIN_GUARD_LOG_LEVEL", "warning")
    assert build_parser().parse_args(["serve"]).log_level == "warning"


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("serve-tests"))
    yield exporter
    provider.shutdown()


def test_the_guard_span_continues_the_traceparent(
    saved: GuardArtifact, spans: InMemorySpanExporter, json_logs: Any
) -> None:
    with TestClient(create_app(_service(saved))) as client:
        reply = client.post(
            "/v1/chat/completions", json=_ask("unsure?"), headers={"traceparent": TRACEPARENT}
        )
        failed = client.post("/v1/chat/completions", json=_ask("down?"))
    decided, broken = spans.get_finished_spans()
    assert decided.name == "chat abstain-guard" and decided.kind == SpanKind.SERVER
    assert format(decided.context.trace_id, "032x") == TRACE_ID
    assert decided.parent is not None and format(decided.parent.span_id, "016x") == PARENT_SPAN
    attributes = dict(decided.attributes or {})
    assert attributes["gen_ai.response.id"] == reply.json()["id"]
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["abstain_guard.outcome"] == "abstained"
    assert attributes["abstain_guard.reason"] == "score"
    assert attributes["abstain_guard.abstained"] is True  # the guard's own record of it
    assert [e.name for e in decided.events] == ["abstention"]
    assert broken.status.status_code == StatusCode.ERROR and failed.status_code == 500
    assert dict(broken.attributes or {})["error.type"] == "BackendError"
    traced = {line["trace_id"] for line in json_logs() if line.get("completion_id")}
    assert format(broken.context.trace_id, "032x") in traced  # its logs carry its trace


def test_an_abstention_finishes_with_stop_streamed_or_not(saved: GuardArtifact) -> None:
    with TestClient(create_app(_service(saved))) as client:
        whole = client.post("/v1/chat/completions", json=_ask("unsure?")).json()["choices"][0]
        streamed = client.post("/v1/chat/completions", json=_ask("unsure?", stream=True))
    assert whole["abstention"]["abstained"] and whole["finish_reason"] == "stop"
    chunks = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    (last,) = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert last["abstention"]["abstained"] and last["finish_reason"] == "stop"
    # a certified stream the guard stopped ends the same way (its last chunk)
    policy = _service(saved).guard.policy
    stopped = answer_of(policy.abstain("scoring failed", "ScoringError: stream stopped")[0])
    (end, _) = sse_decided_end(
        stopped, "", completion_id="c", model="m", created=0, logprobs=None, include_usage=False
    )
    assert stopped.abstained and json.loads(end[6:])["choices"][0]["finish_reason"] == "stop"
    body = completion_body(stopped, completion_id="c", model="m", logprobs=None)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert any('"finish_reason": "stop"' in c for c in sse_chunks(
        stopped, completion_id="c", model="m", logprobs=None, include_usage=False
    ))  # fmt: skip
