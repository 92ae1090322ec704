"""GuardMonitor (abstain_guard/monitor.py): fed decisions of a real policy, it alarms on a
shift (log warning, OpenTelemetry event, callback, state) and not on exchangeable traffic;
feedback is taken once per known decision; its log round-trips."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _core_fakes import logprob_metadata
from langchain_core.messages import AIMessage

from abstain_guard import AbstentionPolicy, GuardArtifact, GuardConfig, PerplexityScorer
from abstain_guard.errors import (
    ArtifactMismatchError,
    DuplicateFeedbackError,
    InvalidInputError,
    NotFittedError,
    UnknownRunError,
)
from abstain_guard.monitor import Alarm, GuardMonitor, read_log

RISK = GuardConfig(mode="risk", risk_target=0.35, delta=0.1)


def _population(rng: np.random.Generator, size: int, a: float = 2.0, b: float = 5.0):
    scores = 1.0 + 2.0 * rng.beta(a, b, size=size)
    return scores, rng.uniform(size=size) < 1.0 - (scores - 1.0) / 2.0


def _message(score: float) -> AIMessage:
    return AIMessage(content="x", response_metadata=logprob_metadata(["x"], [-math.log(score)]))


@pytest.fixture(scope="module")
def artifact() -> GuardArtifact:
    scores, correct = _population(np.random.default_rng(0), 400)
    return GuardArtifact.from_calibration(scorer=PerplexityScorer(), scores=scores, correct=correct)


def _feed(monitor: GuardMonitor, policy: AbstentionPolicy, scores, correct=None) -> list[str]:
    ids = []
    for i, s in enumerate(scores):
        _, decision = policy.decide(_message(float(s)))
        ids.append(monitor.observe(decision))
        if correct is not None and not decision["abstained"]:
            monitor.record_feedback(ids[-1], bool(correct[i]))
    return ids


def test_unfitted_monitor_says_how_to_fit() -> None:
    with pytest.raises(NotFittedError, match="fit_artifact"):
        GuardMonitor().observe({"score": 1.0, "abstained": False})
    with pytest.raises(InvalidInputError, match="false_alarm"):
        GuardMonitor(false_alarm=1.5).fit([1.0, 2.0], None)  # type: ignore[arg-type]


def test_exchangeable_traffic_raises_no_alarm(artifact: GuardArtifact) -> None:
    policy = AbstentionPolicy(artifact, RISK)
    monitor = GuardMonitor(false_alarm=0.01, seed=1).fit_artifact(artifact, RISK)
    scores, correct = _population(np.random.default_rng(2), 600)
    _feed(monitor, policy, scores, correct)
    state = monitor.state()
    assert not state["alarm"] and monitor.alarms == []
    assert state["decisions"] == state["scored"] == 600
    k, n = policy.rule.guarantee["rank"], artifact.n
    assert state["expected_participation"] == pytest.approx(k / (n + 1))
    lo, hi = state["answered_interval"]
    assert lo <= state["answered_rate"] <= hi
    assert state["tests"]["risk"]["risk_target"] == 0.35
    assert state["feedback"]["answered"] == state["answered"]
    json.dumps(state)  # JSON-ready


@pytest.fixture
def otel_exporter() -> Iterator[object]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("monitor-tests"), exporter
    provider.shutdown()


def test_a_shift_alarms_in_the_log_otel_callback_and_state(
    artifact: GuardArtifact, caplog: pytest.LogCaptureFixture, otel_exporter: object
) -> None:
    tracer, exporter = otel_exporter  # type: ignore[misc]
    policy = AbstentionPolicy(artifact, RISK)
    raised: list[Alarm] = []
    monitor = GuardMonitor(seed=3, on_alarm=raised.append).fit_artifact(artifact, RISK)
    scores, _ = _population(np.random.default_rng(4), 300, a=5.0, b=2.0)
    with caplog.at_level(logging.WARNING, "abstain_guard"), tracer.start_as_current_span("app"):
        _feed(monitor, policy, scores)
    tests = [a.test for a in raised]
    assert "exchangeability" in tests and "participation" in tests
    first = monitor.alarms[0]
    assert first.e_value >= first.threshold == 200.0 and first.at <= 60
    warned = [r for r in caplog.records if "drift alarm" in r.getMessage()]
    assert len(warned) == len(raised) and warned[0].levelno == logging.WARNING
    (span,) = exporter.get_finished_spans()
    events = [e for e in span.events if e.name == "drift_alarm"]
    assert [e.attributes["abstain_guard.alarm.test"] for e in events] == tests
    state = monitor.state()
    assert state["alarm"] and state["tests"]["participation"]["alarm"]
    assert state["answered_rate"] < state["expected_participation"] - 0.2


def test_feedback_is_taken_once_for_known_decisions(artifact: GuardArtifact) -> None:
    policy = AbstentionPolicy(artifact, RISK)
    monitor = GuardMonitor(seed=0, max_records=3).fit_artifact(artifact, RISK)
    low, high = float(artifact.scores.min()), 2.99
    answered, withheld = _feed(monitor, policy, [low, high])
    monitor.record_feedback(answered, correct=False)
    with pytest.raises(DuplicateFeedbackError, match="already has feedback"):
        monitor.record_feedback(answered, correct=True)
    with pytest.raises(UnknownRunError, match="No decision with run id 'nope'"):
        monitor.record_feedback("nope", correct=True)
    with pytest.raises(InvalidInputError, match="true or false"):
        monitor.record_feedback(withheld, correct="yes")  # type: ignore[arg-type]
    record = monitor.record_feedback(withheld, correct=True)  # kept, not tested
    assert record.abstained and record.correct is True
    fb = monitor.state()["feedback"]
    assert (fb["answered"], fb["abstained"], fb["errors"]) == (1, 1, 1)
    assert monitor.state()["tests"]["risk"]["n"] == 1
    with pytest.raises(InvalidInputError, match="already recorded"):
        monitor.observe({"score": 1.5, "abstained": False}, run_id=answered)
    _feed(monitor, policy, [1.5, 1.5])  # max_records = 3: the first decision is dropped
    with pytest.raises(UnknownRunError, match="older than the last 3"):
        monitor.record_feedback(answered, correct=True)


def test_unscored_decisions_are_counted_not_tested(artifact: GuardArtifact) -> None:
    monitor = GuardMonitor(seed=0).fit_artifact(artifact)
    monitor.observe({"score": None, "abstained": True, "reason": "scoring failed"})
    state = monitor.state()
    assert (state["decisions"], state["unscored"], state["tests"]["exchangeability"]["n"]) == (
        1, 1, 0
    )  # fmt: skip
    assert state["tests"]["risk"] is None  # participation mode without a risk_target


def test_log_path_and_write_log_round_trip(artifact: GuardArtifact, tmp_path: Path) -> None:
    policy = AbstentionPolicy(artifact, RISK)
    log = tmp_path / "live.jsonl"
    monitor = GuardMonitor(seed=5, log_path=log).fit_artifact(artifact, RISK)
    scores, correct = _population(np.random.default_rng(6), 80, a=5.0, b=2.0)
    ids = _feed(monitor, policy, scores, correct)
    monitor.observe({"score": 1.2, "abstained": False, "group": "capital"}, run_id="g-1")
    header, appended = read_log(log)
    _, written = read_log(monitor.write_log(tmp_path / "written.jsonl"))
    assert [r.run_id for r in appended] == [*ids, "g-1"] == [r.run_id for r in written]
    assert appended == written
    assert appended[-1].group == "capital"
    assert header["source"]["n_calibration"] == artifact.n
    assert {a["test"] for a in header["alarms"]} == {a.test for a in monitor.alarms}
    labeled = [r for r in appended if r.correct is not None]
    assert len(labeled) == monitor.state()["feedback"]["n"]


def test_the_guard_feeds_its_monitor_and_decisions_carry_run_ids(artifact: GuardArtifact) -> None:
    from _core_fakes import ScriptedChatModel

    from abstain_guard import AbstentionGuard

    script = {"easy": ("Paris", [-0.01]), "hard": ("Lima is it", [-2.0, -1.5, -2.5])}
    monitor = GuardMonitor(seed=0, risk_target=0.2)
    guard = AbstentionGuard(ScriptedChatModel(script=script), artifact=artifact, monitor=monitor)
    easy, hard = guard.batch(["easy", "hard"])
    later = asyncio.run(guard.ainvoke("easy"))
    ids = [m.response_metadata["abstention"]["run_id"] for m in (easy, hard, later)]
    records = {r.run_id: r for r in monitor.records()}  # batch runs concurrently: any order
    assert set(records) == set(ids) and len(records) == 3
    assert [records[i].abstained for i in ids] == [False, True, False]
    monitor.record_feedback(ids[0], correct=True)
    assert monitor.state()["tests"]["risk"]["n"] == 1
    other = GuardMonitor().fit_artifact(
        GuardArtifact(PerplexityScorer(), artifact.scores[:100], artifact.correct[:100])
    )
    with pytest.raises(ArtifactMismatchError, match="another artifact"):
        AbstentionGuard(ScriptedChatModel(), artifact=artifact, monitor=other)


def test_the_agent_middleware_feeds_its_monitor(artifact: GuardArtifact) -> None:
    pytest.importorskip("langchain.agents")
    from _core_fakes import QueueChatModel
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage

    from abstain_guard import AbstentionMiddleware

    monitor = GuardMonitor(seed=0)
    model = QueueChatModel(queue=[("Lima.", [-0.01, -0.02], []), ("Quito.", [-2.0, -2.5], [])])
    agent = create_agent(model, middleware=[AbstentionMiddleware(artifact, monitor=monitor)])
    finals = [
        agent.invoke({"messages": [HumanMessage("Capital of Peru?")]})["messages"][-1]
        for _ in range(2)
    ]
    decisions = [m.response_metadata["abstention"] for m in finals]
    assert [d["abstained"] for d in decisions] == [False, True]
    assert [r.run_id for r in monitor.records()] == [d["run_id"] for d in decisions]
    assert decisions[1]["run_id"] == finals[1].id  # the replaced message keeps the id
