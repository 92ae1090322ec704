"""The monitor of replicas on Ray Serve (abstain_guard/serve/monitor_actor.py), its body run
in this process: the decisions of several replicas reach one monitor in the deployment's
admission order and one log; a dead replica's places are given up; a decision whose place
was taken before a restart is still fed; a restarted monitor resumes its log. The same class
runs as the Ray actor in tests/test_serve_replicas.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from abstain_guard import GuardConfig, default_artifact_path
from abstain_guard.guarantee.decision import Decision
from abstain_guard.monitor.log import read_log
from abstain_guard.serve.monitor_actor import DeploymentMonitor

CONFIG = GuardConfig(participation=0.8).model_dump(mode="json")


def _monitor(log: Path | None = None) -> DeploymentMonitor:
    return DeploymentMonitor(
        str(default_artifact_path()),
        CONFIG,
        log_path=None if log is None else str(log),
        monitor_options={"seed": 0},
        reap_s=0,
    )


def _decision(score: float) -> Decision:
    return Decision(abstained=False, score=score, threshold=10.0)


def test_two_replicas_feed_one_log_in_the_deployments_admission_order(tmp_path: Path) -> None:
    log = tmp_path / "live.jsonl"
    monitor = _monitor(log)

    async def scenario() -> None:
        await monitor.admit("a", "r1")
        await monitor.admit("b", "r2")
        await monitor.admit("c", "r1")
        await monitor.finish("c", _decision(0.3))  # the later requests end first
        await monitor.finish("b", _decision(0.2))
        assert await monitor.records() == []  # held behind "a"
        assert (await monitor.state())["deployment"]["in_flight"] == 1
        await monitor.finish("a", _decision(0.1))

    asyncio.run(scenario())
    assert asyncio.run(monitor.records()) == ["a", "b", "c"]
    _, logged = read_log(log)
    assert [r.run_id for r in logged] == ["a", "b", "c"]
    state = asyncio.run(monitor.state())
    assert state["decisions"] == 3
    assert state["deployment"]["decisions_by_replica"] == {"r1": 2, "r2": 1}


def test_a_dead_replicas_places_are_given_up_and_the_others_go_on() -> None:
    monitor = _monitor()

    async def scenario() -> None:
        await monitor.register("r1", None, batch=1)
        await monitor.admit("a", "r1")  # on the replica that dies
        await monitor.admit("b", "r2")
        await monitor.admit("c", "r1")
        await monitor.finish("b", _decision(0.2))
        assert await monitor.records() == []
        assert monitor.in_flight() == 2 and monitor.queued() == 1  # r1: 2 over a batch of 1
        assert monitor.release_replica("r1") == 2

    asyncio.run(scenario())
    assert asyncio.run(monitor.records()) == ["b"]
    deployment = asyncio.run(monitor.state())["deployment"]
    assert deployment["released_by_dead_replicas"] == 2 and deployment["dead_replicas"] == 1
    assert deployment["in_flight"] == 0


def test_a_released_place_never_holds_the_sequence_and_a_late_decision_is_still_fed() -> None:
    monitor = _monitor()

    async def scenario() -> None:
        await monitor.admit("a", "r1")
        await monitor.admit("b", "r1")
        await monitor.finish("b", _decision(0.2))
        await monitor.release("a")  # refused after admission, or a tool call
        await monitor.release("a")  # twice: a no-op
        await monitor.finish("z", _decision(0.4))  # admitted before a restart of the actor

    asyncio.run(scenario())
    assert asyncio.run(monitor.records()) == ["b", "z"]
    assert asyncio.run(monitor.state())["deployment"]["late_decisions"] == 1


def test_feedback_waits_for_a_held_decision_and_is_refused_twice(tmp_path: Path) -> None:
    monitor = _monitor(tmp_path / "live.jsonl")

    async def scenario() -> None:
        await monitor.admit("a", "r1")
        await monitor.admit("b", "r2")
        await monitor.finish("b", _decision(0.2))
        labeled = asyncio.create_task(monitor.feedback("b", True))
        await asyncio.sleep(0.05)
        assert not labeled.done()  # "b" is held behind "a"
        await monitor.finish("a", _decision(0.1))
        assert (await labeled)["body"]["id"] == "b"
        assert (await monitor.feedback("b", False))["error"] == "duplicate"
        assert (await monitor.feedback("nope", True))["error"] == "unknown"

    asyncio.run(scenario())


def test_a_restarted_monitor_resumes_its_log(tmp_path: Path) -> None:
    log = tmp_path / "live.jsonl"
    first = _monitor(log)

    async def decide(monitor: DeploymentMonitor, keys: list[str]) -> None:
        for key in keys:
            await monitor.admit(key, "r1")
            await monitor.finish(key, _decision(0.1))

    asyncio.run(decide(first, ["a", "b"]))
    again = _monitor(log)
    assert asyncio.run(again.state())["resumed"]["decisions"] == 2
    asyncio.run(decide(again, ["c"]))
    assert asyncio.run(again.feedback("a", True))["body"]["id"] == "a"  # from before
    _, logged = read_log(log)
    assert [r.run_id for r in logged] == ["a", "b", "c"]


def test_the_deployments_metrics_count_every_replicas_requests() -> None:
    monitor = _monitor()

    async def scenario() -> bytes:
        await monitor.request_done("/v1/chat/completions", 200)
        await monitor.request_done("/v1/chat/completions", 400)
        await monitor.decided(
            Decision(abstained=False, score=1.5, reason="score <= threshold"), 0.5, False
        )
        await monitor.admit("a", "r1")
        return await monitor.metrics()

    text = asyncio.run(scenario()).decode()
    assert 'abstain_guard_requests_total{path="/v1/chat/completions",status="400"} 1.0' in text
    assert 'abstain_guard_chat_completions_total{outcome="answered",reason="score"} 1.0' in text
    assert "abstain_guard_in_flight 1.0" in text
    assert "abstain_guard_monitor_decisions_total" in text
    assert "abstain_guard_decision_score_count 1.0" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--replicas", "0"], "--replicas must be a positive integer"),
        (["--replicas", "2", "--no-guard"], "--no-guard runs in one process only"),
        (["--cpus-per-replica", "2"], "--cpus-per-replica only applies"),
    ],
)
def test_replica_options_are_checked(argv: list[str], message: str) -> None:
    from abstain_guard.cli.commands import build_parser
    from abstain_guard.errors import ConfigError

    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(ConfigError, match=message):
        args.func(args)
