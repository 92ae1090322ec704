"""Collect abstentions from traces: a callback handler and ``astream_events``.

    python examples/trace_abstentions.py

Every decision is dispatched as a custom event named ``"abstention"`` and tagged on the
guard's run (``abstained`` / ``answered``), so it shows up in any callback handler, in
``astream_events(version="v2")`` and in LangSmith traces.
"""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from abstain_guard import AbstentionGuard, GuardConfig, default_artifact_path
from abstain_guard.contract.prompts import question_prompt


class AbstentionLog(BaseCallbackHandler):
    """Collects every abstention decision seen on the callback bus."""

    def __init__(self) -> None:
        self.decisions: list[dict[str, Any]] = []

    def on_custom_event(
        self,
        name: str,
        data: Any,
        *,
        run_id: UUID,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if name == "abstention":
            self.decisions.append(dict(data))


async def _events(chain: Any, question: str) -> list[dict[str, Any]]:
    found = []
    async for event in chain.astream_events({"question": question}, version="v2"):
        if event["event"] == "on_custom_event" and event["name"] == "abstention":
            found.append(event["data"])
    return found


def main(model: Any = None) -> dict[str, Any]:
    """Run two questions with a handler, one with astream_events; return what was seen."""
    if model is None:
        from abstain_guard.adapters import load_default_model

        model = load_default_model(max_new_tokens=24)  # as calibrated
    guard = AbstentionGuard.from_artifact(
        default_artifact_path(), model, config=GuardConfig(participation=0.5)
    )
    chain = question_prompt() | guard
    log = AbstentionLog()
    questions = ["What is the capital of Germany?", "What is the capital of Nauru?"]
    chain.batch([{"question": q} for q in questions], config={"callbacks": [log]})
    for d in log.decisions:
        print(f"callback: abstained={d['abstained']} score={d['score']:.3f}")
    streamed = asyncio.run(_events(chain, "What is the currency of Peru called?"))
    for d in streamed:
        print(f"astream_events: abstained={d['abstained']} score={d['score']:.3f}")
    return {"callback": log.decisions, "events": streamed}


if __name__ == "__main__":
    main()
