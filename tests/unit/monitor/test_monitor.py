"""GuardMonitor (abstain_guard/monitor/guard_monitor.py): fed decisions of a real policy, it alarms
on a shift (log warning, OpenTelemetry event, callback, state) and not on exchangeable traffic;
feedback is taken once per known decision; its log round-trips."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from _core_fakes import logprob_metadata
from langchain_core.messages import AIMessage

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.errors import (
    ArtifactMismatchError,
    DuplicateFeedbackError,
    InvalidInputError,
    MonitorLogError,
    NotFittedError,
    UnknownRunError,
)
from abstain_guard.guarantee.decision import Decision
from abstain_guard.guard.policy import AbstentionPolicy
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.log import read_log
from abstain_guard.monitor.scope import Alarm
from abstain_guard.scorers import PerplexityScorer

RISK = GuardConfig(mode="risk", risk_target=0.35, delta=0.1)


def _population(rng: np.random.Generator, size: int, a: float = 2.0, b: float = 5.0):
    scores = 1.0 + 2.0 * rng.beta(a, b, size=size)
    return scores, rng.uniform(size=size) < 1.0 - (scores - 1.0) / 2.0


def _message(score: float) -> AIMessage:
    return AIMessage(content="x", response_metadata=logprob_metadata(["x"], [-math.log(score)]))


@pytest.fixture(scope="module")
def artifact() -> GuardArtifact:
    scores, correct = _population(np.random.default_rng(0), 400)
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(scores, correct)
    )


def _feed(monitor: GuardMonitor, policy: AbstentionPolicy, scores, correct=None) -> list[str]:
    ids = []
    for i, s in enumerate(scores):
        _, decision = policy.decide(_message(float(s)))
        ids.append(monitor.observe(decision))
        if correct is not None and not decision.abstained:
            monitor.record_feedback(ids[-1], bool(correct[i]))
    return ids


def test_unfitted_monitor_says_how_to_fit() -> None:
    with pytest.raises(NotFittedError, match="fit_artifact"):
        GuardMonitor().observe(Decision(abstained=False, score=1.0))
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
    k, n = policy.rule.guarantee.rank, artifact.n
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
        monitor.observe(Decision(abstained=False, score=1.5), run_id=answered)
    _feed(monitor, policy, [1.5, 1.5])  # max_records = 3: the first decision is dropped
    with pytest.raises(UnknownRunError, match="older than the last 3"):
        monitor.record_feedback(answered, correct=True)


def test_unscored_decisions_are_counted_not_tested(artifact: GuardArtifact) -> None:
    monitor = GuardMonitor(seed=0).fit_artifact(artifact)
    monitor.observe(Decision(abstained=True, score=None, reason="scoring failed"))
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
    monitor.observe(Decision(abstained=False, score=1.2, group="capital"), run_id="g-1")
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
        GuardArtifact(
            PerplexityScorer(), CalibrationSet(artifact.scores[:100], artifact.correct[:100])
        )
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


# --- per-group rules: each group against its own rule (issue 34, item 3) -----------------


def _group_population(rng: np.random.Generator, name: str, size: int):
    """Group 'a' scores low and is mostly right, 'b' scores high and is wrong more often."""
    a, b = (2.0, 5.0) if name == "a" else (5.0, 2.0)
    scores = 1.0 + 2.0 * rng.beta(a, b, size=size)
    wrong = {"a": 0.1, "b": 0.3}[name] + 0.3 * (scores - 1.0) / 2.0
    return scores, rng.uniform(size=size) >= wrong


@pytest.fixture(scope="module")
def grouped() -> GuardArtifact:
    rng = np.random.default_rng(0)
    parts = [(*_group_population(rng, g, 400), [g] * 400) for g in ("a", "b")]
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts]),
            groups=np.concatenate([p[2] for p in parts]),
        ),
    )


GROUPED = GuardConfig(participation=0.8, group_by="group")
GROUPED_RISK = GuardConfig(
    mode="risk", risk_target=0.35, delta=0.1, group_by="group", group_targets={"a": 0.3, "b": 0.65}
)


def _feed_group(
    monitor: GuardMonitor, policy: AbstentionPolicy, group: str, scores, wrong=None
) -> list[str]:
    """Decide each score as a question of ``group``; feedback on answered ones (``wrong``:
    a deterministic share of errors, every k-th answered one wrong)."""
    ids, answered = [], 0
    for s in scores:
        _, decision = policy.decide(_message(float(s)), group=group)
        ids.append(monitor.observe(decision))
        if wrong is not None and not decision.abstained:
            answered += 1
            monitor.record_feedback(ids[-1], correct=not wrong(answered))
    return ids


def test_each_group_is_tested_against_its_own_rule(grouped: GuardArtifact) -> None:
    """Traffic of group 'a' only, exchangeable with a's calibration answers: a's own τ
    answers it at a's rate, so no alarm. (Tested pooled — all calibration scores, the pooled
    τ — its low scores are answered far above the pooled 0.8 and ranked low: a false alarm.)"""
    policy = AbstentionPolicy(grouped, GROUPED)
    monitor = GuardMonitor(false_alarm=0.01, seed=1).fit_artifact(grouped, GROUPED)
    scores, _ = _group_population(np.random.default_rng(5), "a", 300)
    _feed_group(monitor, policy, "a", scores)
    state = monitor.state()
    assert monitor.alarms == [] and not state["alarm"]
    a = state["groups"]["a"]
    rule_a = policy.groups.rules["a"]  # type: ignore[union-attr]
    assert a["threshold"] == rule_a.threshold != policy.rule.threshold
    assert a["tests"]["participation"]["n"] == a["decisions"] == 300
    k = int(np.sum(grouped.scores[grouped.groups == "a"] <= rule_a.threshold))
    assert a["expected_participation"] == pytest.approx(k / 401)
    assert state["groups"]["b"]["decisions"] == 0 and state["band"] is None
    json.dumps(state)


def test_a_group_drifting_alarms_in_that_group(grouped: GuardArtifact) -> None:
    """Group 'a' sent b's kind of questions: a's tests alarm, named with the group."""
    policy = AbstentionPolicy(grouped, GROUPED)
    monitor = GuardMonitor(seed=2).fit_artifact(grouped, GROUPED)
    scores, _ = _group_population(np.random.default_rng(6), "b", 200)
    _feed_group(monitor, policy, "a", scores)
    assert {(a.test, a.group) for a in monitor.alarms} >= {("participation", "a")}
    assert "in group 'a'" in monitor.alarms[0].message
    state = monitor.state()
    assert (
        state["tests"]["participation"]["alarm"]
        and state["tests"]["participation"]["max_group"] == "a"
    )
    assert not state["groups"]["b"]["tests"]["participation"]["alarm"]


def test_the_risk_test_uses_each_groups_own_target(grouped: GuardArtifact) -> None:
    """Half of the answers wrong: above a's ε = 0.3 (alarm in 'a'), below b's ε = 0.65 (no
    alarm in 'b', although above the pooled 0.35)."""
    policy = AbstentionPolicy(grouped, GROUPED_RISK)
    monitor = GuardMonitor(seed=3).fit_artifact(grouped, GROUPED_RISK)
    rng = np.random.default_rng(7)
    for g in ("b", "a"):
        scores, _ = _group_population(rng, g, 600)
        _feed_group(monitor, policy, g, scores, wrong=lambda i: i % 2 == 0)
    state = monitor.state()
    assert state["groups"]["a"]["tests"]["risk"]["risk_target"] == 0.3
    assert state["groups"]["b"]["tests"]["risk"]["risk_target"] == 0.65
    assert state["groups"]["b"]["feedback"]["error_rate"] == pytest.approx(0.5, abs=0.01)
    assert [(a.test, a.group) for a in monitor.alarms] == [("risk", "a")]


def test_the_false_alarm_bound_over_groups_is_stated(grouped: GuardArtifact) -> None:
    """group_delta='per_group': each group at a, the union bound G·a over all groups (said in
    the state); 'union': each group at a/G, so a over all."""
    per_group = GuardMonitor(false_alarm=0.01).fit_artifact(grouped, GROUPED)
    bound = per_group.state()["false_alarm_bound"]
    assert (bound["sharing"], bound["groups_tested"]) == ("per_group", 2)
    assert bound["label_free_per_scope"] == 0.01 and bound["label_free_overall"] == 0.02
    assert "union bound" in bound["statement"] and "0.02" in bound["statement"]
    assert per_group.state()["tests"]["participation"]["threshold"] == 200.0
    shared = GROUPED.model_copy(update={"group_delta": "union"})
    union = GuardMonitor(false_alarm=0.01).fit_artifact(grouped, shared)
    bound = union.state()["false_alarm_bound"]
    assert bound["label_free_per_scope"] == 0.005 and bound["label_free_overall"] == 0.01
    assert union.state()["tests"]["exchangeability"]["threshold"] == 400.0
    pooled = GuardMonitor(false_alarm=0.01).fit_artifact(grouped).state()["false_alarm_bound"]
    assert pooled["groups_tested"] is None and pooled["label_free_overall"] == 0.01


def test_unknown_groups_are_counted_not_tested(grouped: GuardArtifact) -> None:
    policy = AbstentionPolicy(grouped, GROUPED)
    monitor = GuardMonitor(seed=0).fit_artifact(grouped, GROUPED)
    _feed_group(monitor, policy, "zzz", [1.2, 1.3])
    state = monitor.state()
    assert (state["decisions"], state["unmonitored"]) == (2, 2)
    assert state["tests"]["exchangeability"]["n"] == 0
    assert "2 decisions" in state["false_alarm_bound"]["statement"]


# --- a restart resumes from the log (issue 34, item 4) -----------------------------------


def _test_state(monitor: GuardMonitor, times: bool = True) -> dict[str, object]:
    """Every number the tests carry (capitals, histories, wealths, counts, alarms), the
    kept records (``times``: with their clock times), and the state of the draws to come."""
    scopes = {}
    for name, scope in monitor.scopes_.items():
        exch, part, risk = scope.exchangeability, scope.participation, scope.risk
        scopes[name] = {
            "capital": exch.capital.tolist(),
            "history": list(exch.history),
            "exch": (exch.value, exch.peak, exch.seen),
            "part": (part._wealth.tolist(), part.answered, part.seen, part.value, part.peak),
            "risk": None if risk is None else (risk._wealth.tolist(), risk.errors, risk.seen),
            "counts": (scope.decisions, scope.answered, dict(scope.feedback)),
        }
    state = monitor.state()
    del state["resumed"]
    records = [asdict(r) for r in monitor.records()]
    if not times:
        for r in records:
            del r["time"], r["feedback_time"]
        for alarm in state["alarms"]:
            del alarm["time"]
    return {
        "scopes": scopes,
        "state": state,
        "records": records,
        "rng": monitor.scopes_[next(iter(monitor.scopes_))].exchangeability.rng.bit_generator.state,
    }


@pytest.mark.parametrize("grouped_rules", [False, True])
def test_a_restart_resumes_the_tests_exactly(
    artifact: GuardArtifact, grouped: GuardArtifact, grouped_rules: bool, tmp_path: Path
) -> None:
    """A monitor logs N decisions and feedback (a shift midway, so alarms fire) and
    "restarts" (a new object on a copy of its log, no seed given): it is in exactly the
    test state of the one that never restarted, takes feedback for a decision from before
    the restart, and both go on drawing the same numbers."""
    art, cfg = (grouped, GROUPED_RISK) if grouped_rules else (artifact, RISK)
    policy = AbstentionPolicy(art, cfg)
    log = tmp_path / "live.jsonl"
    raised: list[Alarm] = []
    first = GuardMonitor(log_path=log, on_alarm=raised.append).fit_artifact(art, cfg)
    rng = np.random.default_rng(8)
    groups = ["a", "b"] if grouped_rules else [None]
    kept: list[str] = []
    for step, (a, b) in enumerate([(2.0, 5.0), (5.0, 2.0)]):
        for g in groups:
            scores = 1.0 + 2.0 * rng.beta(a, b, size=60)
            for i, s in enumerate(scores):
                _, decision = policy.decide(_message(float(s)), group=g)
                rid = first.observe(decision)
                if i % 3 == 0 and not decision.abstained:
                    first.record_feedback(rid, correct=bool(i % 2) or step == 0)
                elif i % 3 == 1:
                    kept.append(rid)  # labeled after the restart
    assert raised  # the shift alarmed before the restart
    copy = tmp_path / "restarted.jsonl"
    copy.write_text(log.read_text())
    again: list[Alarm] = []
    restarted = GuardMonitor(log_path=copy, on_alarm=again.append).fit_artifact(art, cfg)
    assert restarted.state()["decisions"] == first.state()["decisions"] == 120 * len(groups)
    assert _test_state(restarted) == _test_state(first)
    assert again == []  # alarms raised before the restart are not raised again
    assert restarted.alarms == first.alarms and restarted.seed_ == first.seed_
    assert restarted.state()["resumed"]["decisions"] == first.state()["decisions"]
    for monitor in (first, restarted):
        monitor.record_feedback(kept[0], correct=False)
        for s in 1.0 + 2.0 * np.random.default_rng(9).beta(2.0, 5.0, size=20):
            _, decision = policy.decide(_message(float(s)), group=groups[0])
            monitor.observe(decision, run_id=f"after-{s}")
    assert _test_state(restarted, times=False) == _test_state(first, times=False)
    _, records = read_log(copy)  # still one readable log for recalibrate
    assert len(records) == first.state()["decisions"]


def test_a_restart_refuses_a_log_it_cannot_resume(artifact: GuardArtifact, tmp_path: Path) -> None:
    policy = AbstentionPolicy(artifact, RISK)
    log = tmp_path / "live.jsonl"
    monitor = GuardMonitor(log_path=log, seed=4).fit_artifact(artifact, RISK)
    _feed(monitor, policy, [1.2, 1.5, 2.5])
    with pytest.raises(MonitorLogError, match="another rule"):
        GuardMonitor(log_path=log).fit_artifact(artifact, GuardConfig(participation=0.9))
    with pytest.raises(MonitorLogError, match="another monitor settings"):
        GuardMonitor(log_path=log, false_alarm=0.05).fit_artifact(artifact, RISK)
    other = GuardArtifact(
        PerplexityScorer(), CalibrationSet(artifact.scores[:100], artifact.correct[:100])
    )
    with pytest.raises(MonitorLogError, match="another artifact"):
        GuardMonitor(log_path=log).fit_artifact(other)
    snapshot = monitor.write_log(tmp_path / "snapshot.jsonl")
    with pytest.raises(MonitorLogError, match="snapshot"):
        GuardMonitor(log_path=snapshot).fit_artifact(artifact, RISK)
    lines = log.read_text().splitlines()
    decision = json.loads(lines[2])
    decision["p_value"] = 0.5
    lines[2] = json.dumps(decision)
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join(lines) + "\n")
    with pytest.raises(MonitorLogError, match="replayed p-value"):
        GuardMonitor(log_path=tampered).fit_artifact(artifact, RISK)
    unseeded = tmp_path / "unseeded.jsonl"  # no seed: its tests cannot be replayed
    header = json.loads(lines[0])
    del header["seed"]
    unseeded.write_text(json.dumps(header) + "\n")
    with pytest.raises(MonitorLogError, match="another seed"):
        GuardMonitor(log_path=unseeded).fit_artifact(artifact, RISK)
