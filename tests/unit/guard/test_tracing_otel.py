"""Abstention decisions on OpenTelemetry spans, checked with the real OpenTelemetry SDK
(TracerProvider + InMemorySpanExporter): the guard and the agent middleware put the decision's
attributes and an ``abstention`` event on the span in context; the middleware also tags the
LangGraph node run that made the decision in LangChain tracers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _core_fakes import QueueChatModel, ScriptedChatModel
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_core.tracers.base import BaseTracer
from langchain_core.tracers.schemas import Run
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from abstain_guard import AbstentionGuard, AbstentionMiddleware, GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.guarantee.decision import Decision
from abstain_guard.guard.tracing import EVENT_NAME, otel_attributes
from abstain_guard.scorers import PerplexityScorer

SCRIPT = {
    "easy": ("Paris", [-0.01]),  # perplexity 1.01: answered
    "hard": ("Lima is it", [-2.0, -1.5, -2.5]),  # perplexity e^2: abstained
    "empty": ("", []),  # cannot be scored: abstains (fail closed)
}


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


@pytest.fixture
def guard(artifact: GuardArtifact) -> AbstentionGuard:
    model = ScriptedChatModel(script=SCRIPT, fingerprint="m-1")
    return AbstentionGuard(model, artifact=artifact, config=GuardConfig(participation=0.8))


@pytest.fixture
def otel() -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("abstain-guard-tests"), exporter
    provider.shutdown()


def _only_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    (span,) = exporter.get_finished_spans()
    return span


def _check_span(span: ReadableSpan, decision: dict[str, Any]) -> None:
    """The span carries the decision as attributes and as one ``abstention`` event."""
    attrs = dict(span.attributes or {})
    assert attrs["abstain_guard.abstained"] is decision["abstained"]
    assert attrs["abstain_guard.threshold"] == decision["threshold"]
    assert attrs["abstain_guard.mode"] == decision["mode"]
    assert attrs["abstain_guard.target"] == decision["target"]
    assert attrs["abstain_guard.scorer"] == decision["scorer"]
    if decision["score"] is None:
        assert "abstain_guard.score" not in attrs
    else:
        assert attrs["abstain_guard.score"] == decision["score"]
    guarantee = json.loads(str(attrs["abstain_guard.guarantee"]))
    assert guarantee == json.loads(json.dumps(decision["guarantee"], default=str))
    assert attrs["abstain_guard.guarantee.kind"] == decision["guarantee"]["kind"]
    events = [e for e in span.events if e.name == EVENT_NAME]
    assert len(events) == 1
    assert dict(events[0].attributes or {}) == otel_attributes(Decision.from_dict(decision))


@pytest.mark.parametrize(("question", "abstained"), [("easy", False), ("hard", True)])
def test_guard_decision_on_the_current_span(
    guard: AbstentionGuard,
    otel: tuple[Tracer, InMemorySpanExporter],
    question: str,
    abstained: bool,
) -> None:
    tracer, exporter = otel
    with tracer.start_as_current_span("request"):
        out = guard.invoke(question)
    decision = out.response_metadata["abstention"]
    assert decision["abstained"] is abstained
    _check_span(_only_span(exporter), decision)


def test_scoring_failure_is_recorded_with_its_error(
    guard: AbstentionGuard, otel: tuple[Tracer, InMemorySpanExporter]
) -> None:
    tracer, exporter = otel
    with tracer.start_as_current_span("request"):
        out = guard.invoke("empty")
    decision = out.response_metadata["abstention"]
    assert decision["abstained"] is True and decision["score"] is None
    span = _only_span(exporter)
    _check_span(span, decision)
    assert "ScoringError" in str(dict(span.attributes or {})["abstain_guard.error"])


def test_async_guard_and_risk_mode(
    artifact: GuardArtifact, otel: tuple[Tracer, InMemorySpanExporter]
) -> None:
    tracer, exporter = otel
    model = ScriptedChatModel(script=SCRIPT, fingerprint="m-1")
    guard = AbstentionGuard(
        model, artifact=artifact, config=GuardConfig(mode="risk", risk_target=0.3, delta=0.1)
    )

    async def main() -> Any:
        with tracer.start_as_current_span("request"):
            return await guard.ainvoke("hard")

    decision = asyncio.run(main()).response_metadata["abstention"]
    span = _only_span(exporter)
    _check_span(span, decision)
    attrs = dict(span.attributes or {})
    assert attrs["abstain_guard.mode"] == "risk"
    assert attrs["abstain_guard.guarantee.confidence"] == pytest.approx(0.9)


def test_no_span_no_recording(
    guard: AbstentionGuard, otel: tuple[Tracer, InMemorySpanExporter]
) -> None:
    _, exporter = otel
    out = guard.invoke("hard")  # no current span: the decision is made and nothing breaks
    assert out.response_metadata["abstention"]["abstained"] is True
    assert exporter.get_finished_spans() == ()


def test_every_attribute_is_kept_by_the_sdk(
    guard: AbstentionGuard, otel: tuple[Tracer, InMemorySpanExporter]
) -> None:
    """The SDK drops attribute values of unsupported types; none of ours is dropped."""
    decision = guard.invoke("easy").response_metadata["abstention"]
    attrs = otel_attributes(Decision.from_dict(decision))
    assert "abstain_guard.guarantee.participation_interval" in attrs
    tracer, exporter = otel
    with tracer.start_as_current_span("request") as span:
        span.set_attributes(attrs)
    assert set(_only_span(exporter).attributes or {}) == set(attrs)


class MemoryTracer(BaseTracer):
    def __init__(self) -> None:
        super().__init__()
        self.runs: list[Run] = []

    def _persist_run(self, run: Run) -> None:
        self.runs.append(run)


def _all_runs(run: Run) -> Iterator[Run]:
    yield run
    for child in run.child_runs:
        yield from _all_runs(child)


def test_agent_middleware_decision_on_span_and_node_run(
    artifact: GuardArtifact, otel: tuple[Tracer, InMemorySpanExporter]
) -> None:
    tracer, exporter = otel
    model = QueueChatModel(queue=[("Quito.", [-2.0, -2.5], [])], fingerprint="m-1")
    agent = create_agent(model, tools=[], middleware=[AbstentionMiddleware(artifact)])
    runs = MemoryTracer()
    with tracer.start_as_current_span("agent request"):
        result = agent.invoke(
            {"messages": [HumanMessage("Capital of Peru?")]}, config={"callbacks": [runs]}
        )
    decision = result["messages"][-1].response_metadata["abstention"]
    assert decision["abstained"] is True
    _check_span(_only_span(exporter), decision)
    (root,) = runs.runs
    tagged = [r for r in _all_runs(root) if "abstained" in (r.tags or [])]
    assert [r.name for r in tagged] == ["AbstentionMiddleware.after_model"]
    assert tagged[0].extra["metadata"]["abstention"] == decision
    assert [e["name"] for e in tagged[0].events].count(EVENT_NAME) == 1
