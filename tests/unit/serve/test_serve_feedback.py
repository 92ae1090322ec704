"""``serve``'s drift monitor, feedback and API key (abstain_guard/serve/app.py): every
decision reaches the monitor under its completion id, ``POST /v1/feedback`` labels it once,
``/metrics`` and ``/v1/monitor`` show the alarms, and nothing a client sends changes the
served threshold. A scripted chat model behind the real server (no model load)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _serve_fakes import ToolScriptModel, artifact
from fastapi.testclient import TestClient

from abstain_guard import GuardConfig
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.serve.app import create_app
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.runner import ServerThread, is_loopback
from abstain_guard.serve.service import GuardService

openai = pytest.importorskip("openai")

KEY = "sk-test-key"
ASK = [{"role": "user", "content": "What is the capital of Peru?"}]


def _service() -> GuardService:
    return GuardService.from_artifact(
        artifact(), GuardConfig(participation=0.8), model=ToolScriptModel()
    )


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, GuardMonitor, GuardService]]:
    service = _service()
    monitor = GuardMonitor(false_alarm=0.01, risk_target=0.2, seed=0)
    monitor.fit_artifact(service.guard.artifact, service.guard.config)
    with ServerThread(service, api_key=KEY, monitor=monitor) as server:
        yield server, monitor, service


def _root(server: ServerThread) -> str:
    return server.base_url[: -len("/v1")]


def _feedback(server: ServerThread, body: Any, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}/feedback", json=body, headers=headers)


def test_the_api_key_is_required_on_v1_routes(served: Any) -> None:
    server, _, _ = served
    wrong = openai.OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="abstain-guard", messages=ASK)
    response = httpx.get(f"{server.base_url}/models")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{_root(server)}/readyz").status_code == 200  # open, as in vLLM
    assert httpx.get(f"{_root(server)}/metrics").status_code == 200


def test_feedback_labels_each_decision_once(served: Any) -> None:
    server, monitor, _ = served
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model="abstain-guard", messages=ASK)
    record = {r.run_id: r for r in monitor.records()}[reply.id]
    assert record.score is not None and record.abstained is False

    assert _feedback(server, {"id": reply.id, "correct": True}, key=None).status_code == 401
    ok = _feedback(server, {"id": reply.id, "correct": True})
    assert ok.status_code == 200, ok.text
    assert ok.json() == {
        "id": reply.id, "correct": True, "abstained": False, "in_risk_test": True, "alarm": False
    }  # fmt: skip
    again = _feedback(server, {"id": reply.id, "correct": False})
    assert again.status_code == 409 and "already has feedback" in again.json()["error"]["message"]
    unknown = _feedback(server, {"id": "chatcmpl-never", "correct": True})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "id"
    for bad in ({"id": reply.id}, {"id": reply.id, "correct": "yes"}, ["x"]):
        assert _feedback(server, bad).status_code == 400
    assert monitor.state()["feedback"]["answered"] == 1


def test_clients_cannot_move_the_threshold_and_alarms_reach_metrics(served: Any) -> None:
    server, _, service = served
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    threshold = service.guard.threshold
    sneaky = {"id": "x", "correct": False, "threshold": 1e9, "risk_target": 0.99}
    refused = _feedback(server, sneaky)
    assert refused.status_code == 400 and "nothing else" in refused.json()["error"]["message"]
    for _ in range(25):  # every answer reported wrong: the risk test (ε = 0.2) alarms
        reply = client.chat.completions.create(model="abstain-guard", messages=ASK)
        assert _feedback(server, {"id": reply.id, "correct": False}).status_code == 200
    state = httpx.get(f"{server.base_url}/monitor", headers={"Authorization": f"Bearer {KEY}"})
    assert state.json()["alarm"] is True
    # the scripted model gives every answer one score, the lowest calibration score's
    # neighbour: the rank test rightly alarms too
    assert {a["test"] for a in state.json()["alarms"]} == {"risk", "exchangeability"}
    metrics = httpx.get(f"{_root(server)}/metrics").text
    assert 'abstain_guard_monitor_alarm{test="risk"} 1.0' in metrics
    assert 'abstain_guard_monitor_alarm{test="participation"} 0.0' in metrics
    assert 'abstain_guard_monitor_e_value{test="exchangeability"}' in metrics
    assert 'abstain_guard_monitor_band{bound="lower"} 0.8' in metrics
    assert 'abstain_guard_requests_total{path="/v1/feedback",status="200"}' in metrics
    # the guard still serves with its calibrated threshold
    assert service.guard.threshold == threshold
    assert httpx.get(f"{_root(server)}/readyz").json()["threshold"] == threshold
    after = client.chat.completions.with_raw_response.create(model="abstain-guard", messages=ASK)
    assert float(after.headers["X-Abstain-Guard-Threshold"]) == threshold


def test_feedback_beyond_loopback_needs_a_key() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    service = _service()
    with TestClient(create_app(service, loopback=False)) as open_app:
        reply = open_app.post("/v1/chat/completions", json={"messages": ASK}).json()
        refused = open_app.post("/v1/feedback", json={"id": reply["id"], "correct": True})
        assert refused.status_code == 403 and "--api-key" in refused.json()["error"]["message"]
    keyed = create_app(_service(), loopback=False, api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(keyed) as client:
        reply = client.post("/v1/chat/completions", json={"messages": ASK}, headers=auth).json()
        body = {"id": reply["id"], "correct": True}
        assert client.post("/v1/feedback", json=body, headers=auth).status_code == 200


def test_loopback_without_a_key_takes_feedback_and_no_guard_has_none() -> None:
    with TestClient(create_app(_service())) as client:
        reply = client.post("/v1/chat/completions", json={"messages": ASK}).json()
        assert client.post("/v1/feedback", json={"id": reply["id"], "correct": True}).is_success
        state = client.get("/v1/monitor").json()
        assert state["decisions"] == 1 and state["feedback"]["n"] == 1
    raw = ModelService(ToolScriptModel(), model_name="raw", max_tokens=64)
    with TestClient(create_app(raw)) as client:
        assert client.post("/v1/feedback", json={"id": "x", "correct": True}).status_code == 404
        assert "abstain_guard_monitor" not in client.get("/metrics").text


def test_a_non_ascii_bearer_token_is_a_401_and_a_non_ascii_key_works() -> None:
    """Tokens are compared as bytes: a token with non-ASCII bytes is wrong (401, not a 500),
    and a key with non-ASCII characters, sent as its UTF-8 bytes, is right."""
    app = create_app(_service(), api_key=KEY)
    with TestClient(app, raise_server_exceptions=False) as client:
        for token in ("clé", "sk-test-kéy", "\u2603"):
            headers = {"Authorization": f"Bearer {token}".encode()}
            response = client.get("/v1/models", headers=headers)
            assert response.status_code == 401, (token, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
    unicode_key = "sk-clé-\u2603"
    with TestClient(create_app(_service(), api_key=unicode_key)) as client:
        right = {"Authorization": f"Bearer {unicode_key}".encode()}
        assert client.get("/v1/models", headers=right).status_code == 200
        short = {"Authorization": b"Bearer sk-cl"}
        assert client.get("/v1/models", headers=short).status_code == 401
