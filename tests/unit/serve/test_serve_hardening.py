"""Issue 46 item 9 (serving) and issue 45's ``/metrics`` leftover (abstain_guard/serve/app.py,
monitor_actor.py, metrics.py, monitor_link.py):

* the API key is a dependency of each ``/v1/*`` route, so a mounted app or a ``root_path``
  (uvicorn's ``--root-path``) does not skip it;
* a replica waits for the monitor actor at most its timeout: a request it cannot place or
  decide in time is a 503 with ``Retry-After``, and ``/readyz`` is 503 while the actor is
  stalled or broken;
* ``/metrics`` counts decisions per group (label ``group``) and exports each group's own
  tests; feedback's ``in_risk_test`` reads the decision's own group's test.

Fast: the scripted model of tests/_serve_fakes.py, the monitor actor in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _monitor_actor_fakes import LocalActor, StalledActor
from _serve_fakes import ToolScriptModel, artifact
from fastapi import FastAPI
from fastapi.testclient import TestClient

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.serve.app import create_app
from abstain_guard.serve.monitor_actor import DeploymentMonitor, RayMonitorLink
from abstain_guard.serve.service import GuardService

KEY = "sk-test-key"
ASK = [{"role": "user", "content": "What is the capital of Peru?"}]
V1 = [
    ("post", "/v1/chat/completions", {"messages": ASK}),
    ("get", "/v1/models", None),
    ("post", "/v1/feedback", {"id": "chatcmpl-x", "correct": True}),
    ("get", "/v1/monitor", None),
]


def _service(art: GuardArtifact | None = None, **config: Any) -> GuardService:
    return GuardService.from_artifact(
        art or artifact(), GuardConfig(participation=0.8, **config), model=ToolScriptModel()
    )


# --- the API key on the routes -------------------------------------------------------------


def _statuses(client: TestClient, prefix: str, headers: dict[str, str]) -> list[int]:
    out = []
    for method, path, body in V1:
        extra = {} if body is None else {"json": body}
        response = getattr(client, method)(prefix + path, headers=headers, **extra)
        out.append(response.status_code)
        if response.status_code == 401:
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == "invalid_api_key"
    return out


@pytest.mark.parametrize("where", ["mounted", "root_path"])
def test_the_api_key_is_checked_wherever_the_app_is_mounted(where: str) -> None:
    app = create_app(_service(), api_key=KEY)
    if where == "mounted":
        outer = FastAPI()
        outer.mount("/guard", app)
        client, prefix = TestClient(outer), "/guard"
    else:  # uvicorn --root-path /api behind a proxy that keeps the prefix
        client, prefix = TestClient(app, root_path="/api"), "/api"
    with client:
        assert _statuses(client, prefix, {}) == [401, 401, 401, 401]
        assert _statuses(client, prefix, {"Authorization": "Bearer sk-wrong"}) == [401] * 4
        keyed = _statuses(client, prefix, {"Authorization": f"Bearer {KEY}"})
        assert keyed == [200, 200, 404, 200]  # the feedback id is unknown: past the key
        assert client.get(prefix + "/readyz").status_code == 200  # open for probes
        metrics = client.get(prefix + "/metrics").text
    assert 'abstain_guard_requests_total{path="/v1/models",status="401"} 2.0' in metrics


# --- the monitor actor's timeout and health --------------------------------------------------


class _BrokenMonitor:
    """A monitor actor whose every call fails, as a dead actor's calls do."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any) -> None:
            raise RuntimeError("The actor died unexpectedly before finishing this task.")

        return fail


@pytest.mark.parametrize("actor", [StalledActor(), LocalActor(_BrokenMonitor())])
def test_a_stalled_or_broken_monitor_actor_is_a_503_with_retry_after(actor: Any) -> None:
    service = _service()
    link = RayMonitorLink(actor, "r1", None, 1, timeout_s=0.2)
    with TestClient(create_app(service, link=link)) as client:
        reply = client.post("/v1/chat/completions", json={"messages": ASK})
        assert reply.status_code == 503, reply.text
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "monitor_unavailable"
        assert service.in_flight == 0
        health = client.get("/readyz")
        assert health.status_code == 503 and health.json()["status"] == "unready"
        assert "the monitor actor" in health.json()["monitor"]["error"]
        assert client.get("/v1/monitor").status_code == 503
        metrics = client.get("/metrics")  # served: this process's own, the monitor is down
        assert client.get("/livez").status_code == 200  # alive: not for a restart
        feedback = client.post("/v1/feedback", json={"id": "x", "correct": True})
        assert feedback.status_code == 503 and "retry-after" in feedback.headers
    assert metrics.status_code == 200 and "abstain_guard_monitor_up 0.0" in metrics.text
    assert 'abstain_guard_threshold{mode="participation"}' in metrics.text
    assert "abstain_guard_chat_completions_total" not in metrics.text


def test_a_healthy_monitor_actor_keeps_readyz_ok(tmp_path: Path) -> None:
    guard = artifact().save(tmp_path / "guard")
    config = GuardConfig(participation=0.8).model_dump(mode="json")
    monitor = DeploymentMonitor(str(guard), config, reap_s=0, monitor_options={"seed": 0})
    link = RayMonitorLink(LocalActor(monitor), "r1", None, 1, timeout_s=5.0)
    with TestClient(create_app(_service(), link=link)) as client:
        assert client.post("/v1/chat/completions", json={"messages": ASK}).status_code == 200
        health = client.get("/readyz")
        assert health.status_code == 200 and health.json()["monitor"]["ok"] is True


# --- /metrics and feedback per group ---------------------------------------------------------


def _grouped() -> GuardArtifact:
    """Groups ``a`` and ``b`` (``b``'s τ below the scripted answer's score)."""
    base = artifact()
    groups = np.where(np.arange(120) < 60, "a", "b")
    scores = np.concatenate([base.scores, np.linspace(0.5, 1.0, 60)])
    correct = np.concatenate([base.correct, base.correct])
    return GuardArtifact(
        base.scorer,
        CalibrationSet(scores, correct, groups=groups),
        model_fingerprint="m-1",
        metadata=base.metadata,
    )


def test_metrics_count_each_group_and_feedback_reads_its_own_groups_test() -> None:
    service = _service(_grouped(), group_by="relation", unknown_group="pooled")
    monitor = GuardMonitor(risk_target=0.2, seed=0)
    monitor.fit_artifact(service.guard.artifact, service.guard.config)
    with TestClient(create_app(service, monitor=monitor)) as client:

        def ask(relation: str) -> dict[str, Any]:
            body = {"messages": ASK, "metadata": {"relation": relation}}
            return dict(client.post("/v1/chat/completions", json=body).json())

        answered, withheld, uncalibrated = ask("a"), ask("b"), ask("zzz")
        assert answered["choices"][0]["abstention"]["abstained"] is False
        assert withheld["choices"][0]["abstention"]["abstained"] is True
        assert uncalibrated["choices"][0]["abstention"]["abstained"] is False  # pooled rule
        text = client.get("/metrics").text

        def label(reply: dict[str, Any]) -> bool:
            body = {"id": reply["id"], "correct": False}
            return bool(client.post("/v1/feedback", json=body).json()["in_risk_test"])

        # group a's answer enters a's risk test; "zzz" has no test of its own (answered by
        # the pooled rule, unmonitored), though the pooled summary has a risk test
        assert label(answered) is True
        assert label(uncalibrated) is False
        assert label(withheld) is False
    counted = 'abstain_guard_chat_completions_total{group="%s",outcome="%s",reason="score"} 1.0'
    for group, outcome in (("a", "answered"), ("b", "abstained"), ("zzz", "answered")):
        assert counted % (group, outcome) in text
    assert 'abstain_guard_monitor_group_decisions_total{group="a"} 1.0' in text
    assert 'abstain_guard_monitor_group_e_value{group="b",test="exchangeability"}' in text
    assert 'abstain_guard_monitor_group_alarm{group="a",test="risk"} 0.0' in text


def test_metrics_without_groups_keep_the_outcome_label_only() -> None:
    with TestClient(create_app(_service())) as client:
        client.post("/v1/chat/completions", json={"messages": ASK})
        text = client.get("/metrics").text
    assert 'abstain_guard_chat_completions_total{outcome="answered",reason="score"} 1.0' in text
    assert "abstain_guard_monitor_group_" not in text
