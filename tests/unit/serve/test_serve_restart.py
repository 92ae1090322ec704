"""``serve`` restarted on its ``--monitor-log`` (issue 34, item 4): the drift monitor resumes
the log, so feedback for a decision made before the restart is taken (not a 404) and the
tests go on where they stopped. A scripted chat model behind the real app (no model load)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from _serve_fakes import ToolScriptModel, artifact

from abstain_guard import GuardConfig
from abstain_guard.cli.serve import serve_monitor
from abstain_guard.guarantee.decision import Decision
from abstain_guard.serve.app import create_app, service_monitor
from abstain_guard.serve.service import GuardService

TestClient = pytest.importorskip("fastapi.testclient").TestClient

ASK = [{"role": "user", "content": "What is the capital of Peru?"}]


def _service() -> GuardService:
    return GuardService.from_artifact(
        artifact(), GuardConfig(participation=0.8), model=ToolScriptModel()
    )


def test_a_restarted_server_takes_feedback_for_decisions_before_the_restart(
    tmp_path: Path,
) -> None:
    log = tmp_path / "live.jsonl"
    service = _service()
    with TestClient(create_app(service, monitor=service_monitor(service, log_path=log))) as app:
        ids = [app.post("/v1/chat/completions", json={"messages": ASK}).json()["id"] for _ in "ab"]
        assert app.post("/v1/feedback", json={"id": ids[0], "correct": True}).is_success
        before = app.get("/v1/monitor").json()
    service = _service()  # the restart: a new process, the same log
    with TestClient(create_app(service, monitor=service_monitor(service, log_path=log))) as app:
        late = app.post("/v1/feedback", json={"id": ids[1], "correct": False})
        assert late.status_code == 200, late.text
        assert late.json()["in_risk_test"] is False  # participation mode without risk_target
        again = app.post("/v1/feedback", json={"id": ids[0], "correct": False})
        assert again.status_code == 409  # labeled before the restart
        after = app.get("/v1/monitor").json()
    assert after["decisions"] == before["decisions"] == 2
    assert after["tests"]["exchangeability"] == before["tests"]["exchangeability"]
    assert after["feedback"]["n"] == 2 and after["resumed"]["decisions"] == 2


def test_serve_says_whether_its_monitor_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="abstain_guard")
    log = tmp_path / "live.jsonl"
    assert serve_monitor(_service(), None) is not None
    assert "no --monitor-log" in caplog.text
    caplog.clear()
    first = serve_monitor(_service(), str(log))
    first.observe(Decision(abstained=False, score=0.5))
    assert "resumed" not in caplog.text
    resumed = serve_monitor(_service(), str(log))
    assert resumed.state()["decisions"] == 1
    assert "the drift monitor resumed" in caplog.text
