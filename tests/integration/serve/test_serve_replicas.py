"""``serve --replicas 2`` on Ray Serve (abstain_guard/serve/ray_serve.py): a local Ray cluster
(2 CPUs), two replicas of the shipped guard and one monitor actor. The OpenAI client gets
answers from both replicas, ``/v1/monitor`` counts every decision of both in one state, and a
replica killed under load loses no answered decision from the monitor log: its in-flight
requests get a 5xx, Ray Serve starts a new replica, and the log holds every answered id."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import ray
from _kernel_notes import assert_only_kernel_notes
from ray import serve

from abstain_guard import GuardArtifact, GuardConfig, default_artifact_path
from abstain_guard.monitor.log import read_log
from abstain_guard.serve.ray_serve import Deployment, ReplicaServer, ReplicaSpec
from abstain_guard.serve.runner import free_port

pytestmark = [pytest.mark.model, pytest.mark.slow]

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What currency is used in the United Kingdom?",
    "On which continent is Kenya?",
    "What is the chemical symbol for gold?",
    "What is the capital of Italy?",
]


def _running_replicas(server: ReplicaServer) -> int:
    """Replicas Ray Serve reports running now (a replaced one counts once it serves)."""
    app = serve.status().applications.get(server.deployment.app_name)
    deployment = None if app is None else app.deployments.get("abstain-guard")
    if deployment is None:
        return 0
    states = deployment.replica_states
    return sum(n for state, n in states.items() if getattr(state, "value", state) == "RUNNING")


@pytest.fixture(scope="module")
def server(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaServer]:
    """Two replicas of the shipped guard on the session's 2-CPU cluster (started without
    this process's kernel settings), with a monitor log."""
    log = tmp_path_factory.mktemp("replicas") / "live.jsonl"
    spec = ReplicaSpec(
        artifact=str(default_artifact_path()),
        config=GuardConfig(participation=0.8).model_dump(mode="json"),
    )
    deployment = Deployment(replicas=2, port=free_port())
    replicas = ReplicaServer(spec, deployment, log_path=str(log))
    try:
        yield replicas.start()
    finally:
        replicas.stop()
        serve.shutdown()


def _ask(client: openai.OpenAI, question: str) -> tuple[str | None, int]:
    """The completion id and 200, or None and the error's status (599: no response)."""
    try:
        reply = client.chat.completions.create(
            model="abstain-guard", messages=[{"role": "user", "content": question}]
        )
    except openai.APIStatusError as exc:
        return None, exc.status_code
    except openai.APIConnectionError:
        return None, 599
    return reply.id, 200


def _settled(server: ReplicaServer, timeout_s: float = 60.0) -> dict[str, Any]:
    """The monitor's state once no request holds a place (every decision fed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = server.state()
        if state["deployment"]["in_flight"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def _replica_actors() -> list[Any]:
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::abstain-guard")
    ]


def test_both_replicas_answer_the_openai_client_into_one_monitor(server: ReplicaServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda q: _ask(client, q), QUESTIONS * 2))
    assert [status for _, status in answers] == [200] * len(answers)
    # the replicas compute on the kernels this process records: their decisions carry
    # exactly the kernel note this process's facts call for (none on the calibration's)
    shipped = GuardArtifact.load(default_artifact_path())
    raw = httpx.post(
        server.base_url + "/chat/completions",
        json={"model": "abstain-guard", "messages": [{"role": "user", "content": QUESTIONS[0]}]},
        timeout=120,
    ).json()
    decision = raw["choices"][0]["abstention"]
    assert_only_kernel_notes(decision["guarantee"].get("warnings"), shipped, decision["threshold"])
    answers.append((raw["id"], 200))
    state = _settled(server)
    by_replica = state["deployment"]["decisions_by_replica"]
    assert len(by_replica) == 2 and sum(by_replica.values()) == len(answers)  # both, one state
    assert state["decisions"] == len(answers)
    monitor = httpx.get(server.base_url + "/monitor", timeout=30).json()
    assert monitor["decisions"] == len(answers) and monitor["band"] == state["band"]
    metrics = httpx.get(server.base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    assert f"abstain_guard_monitor_decisions_total {float(len(answers))}" in metrics
    reply_id = next(i for i, _ in answers if i is not None)
    feedback = httpx.post(
        server.base_url + "/feedback", json={"id": reply_id, "correct": True}, timeout=30
    )
    assert feedback.status_code == 200, feedback.text
    bad = httpx.post(server.base_url + "/chat/completions", json={"messages": []}, timeout=30)
    assert bad.status_code == 400  # the same checks as one server


def test_a_replica_killed_under_load_loses_no_answered_decision(server: ReplicaServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    before = set(ray.get(server.monitor.records.remote()))
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_ask, client, q) for q in QUESTIONS * 3]
        busy_by = time.monotonic() + 120
        while server.state()["deployment"]["in_flight"] < 4:  # both replicas busy
            assert time.monotonic() < busy_by, "the replicas never got busy"
            time.sleep(0.05)
        ray.kill(_replica_actors()[0], no_restart=True)
        killed_at = time.monotonic()
        answers = [f.result() for f in futures]
    answered = {i for i, status in answers if status == 200}
    failed = [status for _, status in answers if status != 200]
    assert answered and failed, answers  # some answered, the killed replica's in flight not
    assert all(500 <= status < 600 for status in failed), failed  # a clean 5xx
    state = _settled(server)
    assert state["deployment"]["in_flight"] == 0
    assert state["deployment"]["dead_replicas"] == 1
    logged = {r.run_id for r in read_log(server.log_path or "")[1]} - before
    assert answered <= logged  # every answered decision is in the log
    assert len(logged - answered) <= len(failed)  # decided, then lost with its replica
    while _running_replicas(server) < 2:  # Ray Serve replaced it (its model loaded)
        assert time.monotonic() - killed_at < 180, "Ray Serve did not replace the replica"
        time.sleep(1.0)
    assert _ask(client, QUESTIONS[0])[1] == 200
