"""Issue 46 item 7: no answered decision is lost, and a failed write is never swallowed
(abstain_guard/serve/journal.py, arrival.py, monitor_actor.py, monitor_link.py).

A decision is journaled (``<monitor-log>.journal``) before ``finish`` returns, so a monitor
actor that dies while decisions are held behind an earlier request feeds them when it starts
again on the same log; a journal write that fails refuses the decision (503) and a monitor
log write that fails is an alarm (logged error, counted, ``/readyz`` 503) with the decision
kept for the next start. The monitor actor's body runs in this process (its class is what
Ray runs, tests/test_serve_replicas.py)."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

import pytest
from _serve_fakes import ToolScriptModel, artifact
from fastapi.testclient import TestClient

from abstain_guard import GuardConfig, default_artifact_path
from abstain_guard.errors import DecisionJournalError
from abstain_guard.guarantee.decision import Decision
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.log import read_log
from abstain_guard.serve.app import create_app
from abstain_guard.serve.journal import DecisionJournal, journal_path
from abstain_guard.serve.monitor_actor import DeploymentMonitor
from abstain_guard.serve.service import GuardService

CONFIG = GuardConfig(participation=0.8).model_dump(mode="json")
ASK = [{"role": "user", "content": "What is the capital of Peru?"}]


def _monitor(log: Path) -> DeploymentMonitor:
    """The deployment's monitor actor body (as Ray starts, and restarts, it) on ``log``."""
    return DeploymentMonitor(
        str(default_artifact_path()),
        CONFIG,
        log_path=str(log),
        monitor_options={"seed": 0},
        reap_s=0,
    )


def _decision(score: float) -> Decision:
    return Decision(abstained=False, score=score, threshold=10.0)


def _logged(log: Path) -> list[str]:
    return [r.run_id for r in read_log(log)[1]]


def _break(path: Path) -> None:
    """Make every later append to ``path`` fail (it becomes a directory)."""
    path.unlink()
    path.mkdir()


def test_an_actor_restarted_with_held_decisions_loses_none(tmp_path: Path) -> None:
    log = tmp_path / "live.jsonl"
    first = _monitor(log)

    async def before_the_restart(monitor: DeploymentMonitor) -> None:
        for key, replica in (("a", "r1"), ("b", "r2"), ("c", "r1")):
            await monitor.admit(key, replica)
        await monitor.finish("c", _decision(0.3))  # acknowledged: the replicas answer them ...
        await monitor.finish("b", _decision(0.2))
        assert await monitor.records() == []  # ... while they are held behind "a"

    asyncio.run(before_the_restart(first))
    assert _logged(log) == []
    del first  # the actor dies; Ray starts it again on the same log

    again = _monitor(log)
    assert asyncio.run(again.records()) == ["b", "c"]  # fed from the journal, admission order
    assert _logged(log) == ["b", "c"]
    assert asyncio.run(again.feedback("c", True))["body"]["id"] == "c"

    async def after_the_restart() -> None:
        await again.finish("a", _decision(0.1))  # "a"'s replica ends after the restart
        await again.finish("b", _decision(0.2))  # a call Ray retried on the new actor

    asyncio.run(after_the_restart())
    assert _logged(log) == ["b", "c", "a"]  # each once
    deployment = asyncio.run(again.state())["deployment"]
    assert deployment["late_decisions"] == 1 and deployment["redelivered_decisions"] == 1
    assert asyncio.run(again.health())["ok"] is True
    # a third start finds nothing left to feed
    assert asyncio.run(_monitor(log).records()) == ["b", "c", "a"]


def test_a_failed_journal_write_refuses_the_decision_and_raises_the_alarm(
    tmp_path: Path,
) -> None:
    log = tmp_path / "live.jsonl"
    monitor = _monitor(log)
    _break(journal_path(log))  # type: ignore[arg-type]

    async def scenario() -> None:
        await monitor.admit("a", "r1")
        await monitor.admit("b", "r1")
        with pytest.raises(DecisionJournalError, match="no answer leaves unlogged"):
            await monitor.finish("a", _decision(0.1))  # not acknowledged: the replica 503s

    asyncio.run(scenario())
    health = asyncio.run(monitor.health())
    assert health["ok"] is False and health["journal_failures"] == 1
    assert "could not be written to the journal" in health["error"]
    assert monitor.in_flight() == 1  # "a" gave up its place: "b" is not held behind it


def test_a_failed_monitor_log_write_is_an_alarm_and_the_decision_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "live.jsonl"
    monitor = _monitor(log)
    saved = log.read_text()
    _break(log)

    async def scenario() -> None:
        await monitor.admit("a", "r1")
        with caplog.at_level(logging.ERROR, logger="abstain_guard.serve"):
            await monitor.finish("a", _decision(0.1))  # journaled: acknowledged

    asyncio.run(scenario())
    health = asyncio.run(monitor.health())
    assert health["ok"] is False and health["log_failures"] == 1
    assert any("could not be written to the monitor log" in r.message for r in caplog.records)
    assert asyncio.run(monitor.state())["deployment"]["health"]["ok"] is False
    # the disk is fixed and the actor restarted: the decision reaches the log
    log.rmdir()
    log.write_text(saved)
    assert asyncio.run(_monitor(log).records()) == ["a"]
    assert _logged(log) == ["a"]


def test_a_journal_keeps_only_what_is_not_yet_fed(tmp_path: Path) -> None:
    path = tmp_path / "j.journal"
    journal = DecisionJournal(path, compact_bytes=1)
    journal.hold("x", Decision(abstained=False, score=1.0), ticket=1)
    journal.hold("y", Decision(abstained=True, score=2.0), ticket=0)
    assert [h.run_id for h in journal.pending()] == ["y", "x"]  # admission order
    journal.fed("y")
    assert [h.run_id for h in journal.pending()] == ["x"] and len(journal) == 1
    journal.fed("x")
    assert journal.pending() == [] and path.read_text() == ""  # started afresh
    with path.open("a") as fh:
        fh.write('{"event": "held", "run_id": "z", "tic')  # a crash mid-write: never acked
    assert journal.pending() == []


# --- one server: the same journal, and /readyz ------------------------------------------------


def _service() -> GuardService:
    return GuardService.from_artifact(
        artifact(), GuardConfig(participation=0.8), model=ToolScriptModel()
    )


def _served_monitor(service: GuardService, log: Path) -> GuardMonitor:
    monitor = GuardMonitor(log_path=log, seed=0)
    return monitor.fit_artifact(service.guard.artifact, service.guard.config)


def test_a_server_whose_monitor_log_fails_is_unready_and_loses_nothing(tmp_path: Path) -> None:
    log = tmp_path / "live.jsonl"
    service = _service()
    with TestClient(create_app(service, monitor=_served_monitor(service, log))) as client:
        assert client.get("/readyz").json()["monitor"]["ok"] is True
        saved = log.read_text()
        _break(log)
        reply = client.post("/v1/chat/completions", json={"messages": ASK})
        assert reply.status_code == 200  # the decision is in the journal
        health = client.get("/readyz")
        assert health.status_code == 503 and health.json()["status"] == "unready"
        assert health.json()["monitor"]["log_failures"] == 1
    log.rmdir()
    log.write_text(saved)
    restarted = _served_monitor(service, log)
    create_app(_service(), monitor=restarted)  # the server starts again on the same log
    assert [r.run_id for r in restarted.records()] == [reply.json()["id"]]


def test_a_server_whose_journal_fails_answers_503_with_retry_after(tmp_path: Path) -> None:
    log = tmp_path / "live.jsonl"
    service = _service()
    with TestClient(create_app(service, monitor=_served_monitor(service, log))) as client:
        _break(journal_path(log))  # type: ignore[arg-type]
        reply = client.post("/v1/chat/completions", json={"messages": ASK})
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "monitor_unavailable"
        assert client.get("/readyz").status_code == 503
        assert client.get("/livez").status_code == 200  # unready, but no reason to restart
        assert service.in_flight == 0
    shutil.rmtree(journal_path(log))  # type: ignore[arg-type]
    assert read_log(log)[1] == []  # nothing answered, nothing logged
