"""``GET /dashboard`` (abstain_guard/serve/app.py) without a browser: the page embeds
the series of the server's monitor, or with replicas the monitor actor's; it is refused
(404) without a guard and answered 503 while the monitor actor does not answer. A scripted
chat model behind the real app (no model load); headless Chromium renders it in
tests/integration/serve/test_dashboard_chromium.py."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

from _monitor_actor_fakes import LocalActor, StalledActor
from _serve_fakes import ToolScriptModel, artifact
from fastapi.testclient import TestClient

from abstain_guard import GuardConfig
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.report import live_series
from abstain_guard.serve.app import create_app
from abstain_guard.serve.monitor_actor import DeploymentMonitor, RayMonitorLink
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.service import GuardService

CONFIG = GuardConfig(participation=0.8)
ASK = {"messages": [{"role": "user", "content": "What is the capital of Peru?"}]}


def _embedded(page: str) -> dict[str, object]:
    found = re.search(r'<script id="series" type="application/json">(.*?)</script>', page, re.S)
    assert found is not None
    data: dict[str, object] = json.loads(found.group(1))
    return data


def _service() -> GuardService:
    return GuardService.from_artifact(artifact(), CONFIG, model=ToolScriptModel())


def test_the_dashboard_embeds_the_servers_monitor() -> None:
    service = _service()
    monitor = GuardMonitor(seed=0).fit_artifact(service.guard.artifact, CONFIG)
    with TestClient(create_app(service, monitor=monitor)) as client:
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=ASK).status_code == 200
        reply = client.get("/dashboard")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    assert _embedded(reply.text) == {**asdict(live_series(monitor)), "live": True}
    assert _embedded(reply.text)["decisions"] == 3


def test_with_replicas_the_dashboard_is_the_monitor_actors(tmp_path: Path) -> None:
    guard = artifact().save(tmp_path / "guard")
    actor = DeploymentMonitor(
        str(guard), CONFIG.model_dump(mode="json"), reap_s=0, monitor_options={"seed": 0}
    )
    link = RayMonitorLink(LocalActor(actor), "r1", None, 1, timeout_s=5.0)
    with TestClient(create_app(_service(), link=link)) as client:
        for _ in range(2):
            assert client.post("/v1/chat/completions", json=ASK).status_code == 200
        reply = client.get("/dashboard")
    assert reply.status_code == 200
    assert _embedded(reply.text) == {**asdict(live_series(actor.monitor)), "live": True}
    assert _embedded(reply.text)["decisions"] == 2


def test_the_dashboard_is_refused_without_a_guard_or_a_monitor() -> None:
    raw = ModelService(ToolScriptModel(), max_tokens=24)
    with TestClient(create_app(raw)) as client:
        reply = client.get("/dashboard")
    assert reply.status_code == 404 and "--no-guard" in reply.json()["error"]["message"]
    link = RayMonitorLink(StalledActor(), "r1", None, 1, timeout_s=0.2)
    with TestClient(create_app(_service(), link=link)) as client:
        reply = client.get("/dashboard")
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "monitor_unavailable"
