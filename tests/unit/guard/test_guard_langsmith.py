"""The decision reaches LangSmith: tags, metadata and an event on the guard's run, as sent
by the real LangChainTracer (a LangSmith client subclass records instead of uploading)."""

from __future__ import annotations

from typing import Any

import numpy as np
from _core_fakes import ScriptedChatModel
from langchain_core.tracers.langchain import LangChainTracer
from langsmith import Client

from abstain_guard import AbstentionGuard, GuardArtifact
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.scorers import PerplexityScorer


class RecordingClient(Client):
    """A LangSmith client that records run uploads instead of sending them."""

    def __init__(self) -> None:
        super().__init__(api_key="test-key", api_url="http://127.0.0.1:9", auto_batch_tracing=False)
        self.created: list[dict[str, Any]] = []
        self.updated: list[dict[str, Any]] = []

    def create_run(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.created.append(kwargs)

    def update_run(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.updated.append(kwargs)


def test_langsmith_run_carries_the_decision() -> None:
    rng = np.random.default_rng(0)
    scores = rng.uniform(1.0, 3.0, size=100)
    correct = rng.uniform(size=100) > (scores - 1.0) / 2.0
    art = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(), calibration=CalibrationSet(scores, correct)
    )
    guard = AbstentionGuard(
        ScriptedChatModel(script={"hard": ("x", [-3.0]), "easy": ("y", [-0.01])}), artifact=art
    )
    client = RecordingClient()
    tracer = LangChainTracer(client=client, project_name="abstain-guard-test")
    guard.invoke("hard", config={"callbacks": [tracer]})
    guard.invoke("easy", config={"callbacks": [tracer]})
    tracer.wait_for_futures()
    guard_updates = [u for u in client.updated if u.get("name") == "AbstentionGuard"]
    assert len(guard_updates) == 2
    hard, easy = guard_updates
    assert "abstained" in hard["tags"] and "answered" in easy["tags"]
    meta = hard["extra"]["metadata"]["abstention"]
    assert meta["abstained"] is True and meta["scorer"] == "perplexity"
    assert easy["extra"]["metadata"]["abstention"]["abstained"] is False
    assert "abstention" in [e.get("name") for e in hard["events"]]
