"""Step gating across replicas (abstain_guard/serve/ray_serve.py,
monitor_actor.py, step_record.py). The step records live in the deployment's monitor actor,
so a run that one replica started continues on another (Ray Serve has no sticky routing, and
a replica may die mid-run); each record keeps the run's group, so a run cannot switch groups
mid-run.

Two replicas are built as Ray Serve builds them (:func:`build_replica`) around one real
:class:`DeploymentMonitor`, reached through its actor calling convention in this process
(tests/_monitor_actor_fakes.py), and answer real HTTP requests of the OpenAI format (the
scripted tool-calling model of tests/_serve_fakes.py: fast)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from _monitor_actor_fakes import LocalActor
from _serve_fakes import TOOLS, ToolScriptModel, artifact
from fastapi.testclient import TestClient

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.serve.app import create_app
from abstain_guard.serve.monitor_actor import DeploymentMonitor
from abstain_guard.serve.ray_serve import ReplicaSpec, build_replica
from abstain_guard.serve.service import GuardService
from abstain_guard.serve.step_gate import UNKNOWN_STEPS

FORCED = {"call_tool_choices": {"0": ["any"], "1": [None]}, "tool_steps": {"1": 50}}
CHILE = {"role": "user", "content": "What is the capital of Chile?"}


def _continued(first: dict[str, Any], result: str) -> list[dict[str, Any]]:
    """The run after its first step: the question, the returned call and its result."""
    message = first["choices"][0]["message"]
    call_id = message["tool_calls"][0]["id"]
    returned = {"role": "assistant", "content": "", "tool_calls": message["tool_calls"]}
    return [CHILE, returned, {"role": "tool", "tool_call_id": call_id, "content": result}]


def test_a_run_continues_on_another_replica_after_its_replica_died(tmp_path: Path) -> None:
    guard = artifact(tools=True, gating="steps", **FORCED).save(tmp_path / "guard")
    spec = ReplicaSpec(str(guard), GuardConfig(participation=0.8).model_dump(mode="json"))
    monitor = DeploymentMonitor(str(guard), spec.config, reap_s=0, monitor_options={"seed": 0})
    actor = LocalActor(monitor)

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        clients = []
        for replica in ("r1", "r2"):
            service, link = build_replica(spec, actor, replica, None, model=ToolScriptModel())
            await link.register()
            transport = httpx.ASGITransport(app=create_app(service, link=link))
            clients.append(httpx.AsyncClient(transport=transport, base_url="http://replica"))
        one, two = clients
        body = {"messages": [CHILE], "tools": TOOLS, "tool_choice": "required"}
        first = (await one.post("/v1/chat/completions", json=body)).json()
        monitor.release_replica("r1")  # replica r1 dies; the client's next call goes to r2
        body = {"messages": _continued(first, "Santiago"), "tools": TOOLS}
        final = await two.post("/v1/chat/completions", json=body)
        assert final.status_code == 200, final.text
        for client in clients:
            await client.aclose()
        return first, final.json()

    first, final = asyncio.run(scenario())
    step = first["choices"][0]["abstention"]
    assert first["choices"][0]["finish_reason"] == "tool_calls" and step["abstained"] is False
    decision = final["choices"][0]["abstention"]
    assert decision.get("reason") != UNKNOWN_STEPS, decision  # not failed closed
    assert final["choices"][0]["message"]["content"] == "Santiago"
    assert decision["step"] == 1 and decision["run_statistic"] == step["step_score"]
    state = asyncio.run(monitor.state())
    assert state["decisions"] == 1  # the run's one outcome, nothing fed as a failure
    assert state["deployment"]["step_record"]["entries"] == 1


def _grouped_service() -> GuardService:
    """An agent guard with per-group rules (``group_by="relation"``): group ``b``'s τ is
    lower (its calibration scores sit lower)."""
    base = artifact(tools=True, gating="steps", **FORCED)
    groups = np.where(np.arange(120) < 60, "a", "b")
    scores = np.concatenate([base.scores, np.linspace(0.5, 1.0, 60)])
    correct = np.concatenate([base.correct, base.correct])
    grouped = GuardArtifact(
        base.scorer,
        CalibrationSet(scores, correct, groups=groups),
        model_fingerprint="m-1",
        metadata=base.metadata,
    )
    config = GuardConfig(participation=0.8, group_by="relation")
    return GuardService.from_artifact(grouped, config, model=ToolScriptModel())


def test_a_run_keeps_its_group() -> None:
    with TestClient(create_app(_grouped_service())) as client:
        body = {
            "messages": [CHILE],
            "tools": TOOLS,
            "tool_choice": "required",
            "metadata": {"relation": "a"},
        }
        first = client.post("/v1/chat/completions", json=body).json()
        assert first["choices"][0]["abstention"]["guarantee"]["group"] == "a"
        assert first["choices"][0]["finish_reason"] == "tool_calls"
        for other in ({"relation": "b"}, {}):  # another group's τ, or none, mid-run
            body = {"messages": _continued(first, "Santiago"), "tools": TOOLS, "metadata": other}
            switched = client.post("/v1/chat/completions", json=body)
            assert switched.status_code == 400, switched.text
            error = switched.json()["error"]
            assert error["code"] == "group_changed_mid_run" and error["param"] == "metadata"
            assert "decided in group 'a'" in error["message"]
        body = {
            "messages": _continued(first, "Santiago"),
            "tools": TOOLS,
            "metadata": {"relation": "a"},
        }
        same = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert same["message"]["content"] == "Santiago"
        assert same["abstention"]["guarantee"]["group"] == "a" and same["abstention"]["step"] == 1


@pytest.mark.parametrize("group", ["a", None])
def test_the_step_record_keeps_the_group_it_was_decided_in(group: str | None) -> None:
    from abstain_guard.serve.step_record import StepEntry, StepRecord, StepSnapshot

    record = StepRecord()
    snapshot = StepSnapshot(record, {}, group)
    snapshot.put("k", StepEntry(step=0, step_score=1.5, run_statistic=1.5))
    asyncio.run(snapshot.flush())
    assert record.get("k") == StepEntry(0, 1.5, 1.5, group)


def test_a_replica_logs_json_lines_at_the_level_its_spec_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve --replicas N --log-level L`` hands its level to every replica: a replica
    built from the spec logs JSON lines on its stderr, as the single server does."""
    import json
    import logging

    guard = artifact(tools=True, gating="steps", **FORCED).save(tmp_path / "guard")
    config = GuardConfig(participation=0.8).model_dump(mode="json")
    spec = ReplicaSpec(str(guard), config, log_level="info")
    monitor = DeploymentMonitor(str(guard), spec.config, reap_s=0, monitor_options={"seed": 0})
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    try:
        build_replica(spec, LocalActor(monitor), "r1", None, model=ToolScriptModel())
        logging.getLogger("abstain_guard.serve").info("replica up")
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        root.setLevel(before[0])
        root.handlers[:] = before[1]
    record = json.loads(line)
    assert record["message"] == "replica up" and record["level"] == "INFO"
    assert record["logger"] == "abstain_guard.serve"
