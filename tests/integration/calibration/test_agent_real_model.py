"""A LangChain v1 agent on the real embedded model: ``create_agent`` with SmolLM2-135M as a
``GeometryChatModel`` and ``AbstentionMiddleware`` with the shipped guard, no tools.

The shipped guard at its default setting (participation 0.8) answers a question whose
uncertainty score is at most its threshold τ. Its calibration questions were answered with
the deployed prompt and budget, and their stored scores are the scores the live guard
computes (within 2e-5, tests/test_shipped_artifact.py). So the test asks the calibration
question with the lowest stored score (answered) and the one with the highest (abstained)
among the first ones, both far from τ (more than 1e-3): no threshold is tuned for the test,
and the agent must reproduce the stored score, which proves it runs the model exactly as
the guard was calibrated (system prompt, budget, decoding, geometry).

Also here: the real model's token stream (byte-level BPE) adds up to ``invoke``'s answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest
from _kernel_notes import assert_only_kernel_notes
from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tracers.base import BaseTracer
from langchain_core.tracers.schemas import Run
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from abstain_guard import AbstentionMiddleware, GuardArtifact, GuardConfig, default_artifact_path
from abstain_guard.calibration.measure.held_out import artifact_items
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.guard.tracing import EVENT_NAME

pytestmark = [pytest.mark.model, pytest.mark.slow]

#: Calibration questions the pick looks at (their stored scores are known).
CANDIDATES = 40
#: Least distance of a picked question's stored score from τ.
MARGIN = 1e-3


class MemoryTracer(BaseTracer):
    """A real LangChain tracer (LangSmith's base class) that keeps finished runs."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[Run] = []

    def _persist_run(self, run: Run) -> None:
        self.runs.append(run)


class CustomEvents(BaseCallbackHandler):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_custom_event(self, name: str, data: Any, *, run_id: UUID, **kw: Any) -> None:
        self.events.append((name, data))


def _all_runs(run: Run) -> Iterator[Run]:
    yield run
    for child in run.child_runs:
        yield from _all_runs(child)


@pytest.fixture(scope="module")
def shipped() -> GuardArtifact:
    return GuardArtifact.load(default_artifact_path())


@pytest.fixture(scope="module")
def questions(shipped: GuardArtifact) -> dict[str, tuple[str, float]]:
    """``{"answer": (question, stored score), "abstain": (...)}`` picked by stored score."""
    tau = shipped.decision_rule(GuardConfig()).threshold
    _, held_out, _ = artifact_items(shipped)
    by_id = {item.id: item for item in held_out}
    ids = list(shipped.metadata["calibration_ids"])[:CANDIDATES]
    scored = [(float(shipped.scores[i]), by_id[item_id]) for i, item_id in enumerate(ids)]
    low_score, low = min(scored, key=lambda s: s[0])
    high_score, high = max(scored, key=lambda s: s[0])
    assert low_score < tau - MARGIN and high_score > tau + MARGIN, (low_score, tau, high_score)
    assert low.kind == high.kind == "open"
    return {
        "answer": (low.prompt_text(), low_score),
        "abstain": (high.prompt_text(), high_score),
    }


@pytest.mark.parametrize("case", ["answer", "abstain"])
def test_agent_answers_or_abstains_on_the_real_model(
    default_model: Any,
    shipped: GuardArtifact,
    questions: dict[str, tuple[str, float]],
    case: str,
) -> None:
    record = DeploymentRecord.from_metadata(shipped.metadata)
    assert record is not None
    _, prompt = record.kind("open")
    assert default_model.max_new_tokens == prompt.max_new_tokens  # the calibrated budget
    agent = create_agent(
        default_model,
        tools=[],
        system_prompt=prompt.system_prompt,
        middleware=[AbstentionMiddleware(shipped)],
    )
    question, stored_score = questions[case]
    tracer, events = MemoryTracer(), CustomEvents()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("agent-test").start_as_current_span("agent request"):
        state = agent.invoke(
            {"messages": [HumanMessage(question)]}, config={"callbacks": [tracer, events]}
        )
    provider.shutdown()

    # the final state: one answer, decided as the stored score says, nothing mismatched
    messages = state["messages"]
    assert len(messages) == 2
    final = messages[-1]
    assert isinstance(final, AIMessage)
    decision = final.response_metadata["abstention"]
    assert decision["abstained"] is (case == "abstain")
    assert decision["score"] == pytest.approx(stored_score, abs=2e-5)
    assert decision["threshold"] == shipped.decision_rule(GuardConfig()).threshold
    assert (decision["scorer"], decision["mode"], decision["target"]) == (
        shipped.scorer.name,
        "participation",
        0.8,
    )
    # prompt, budget, decoding as calibrated: nothing but the kernel note on other kernels
    assert_only_kernel_notes(decision["guarantee"].get("warnings"), shipped, decision["threshold"])
    if case == "abstain":
        assert final.content == GuardConfig().abstain_message
        withheld = final.response_metadata["withheld_response"]
        assert withheld["content"] and withheld["response_metadata"]["token_ids"]
    else:
        assert final.content and final.content != GuardConfig().abstain_message
        phi_in = final.response_metadata["geometry"]["phi_in"]
        # Φ needs the reference means, which only the geometry scorers fit and install
        means = getattr(shipped.scorer, "reference_means_", None)
        assert (phi_in is not None) is (means is not None)
        assert final.response_metadata["geometry"]["hidden"]  # what the probe scorers read

    # the recorded trace: the model's run, the deciding node tagged, the custom event
    (root,) = tracer.runs
    runs = list(_all_runs(root))
    (model_run,) = [r for r in runs if r.run_type == "llm"]
    assert model_run.name == "GeometryChatModel"
    generated = model_run.outputs["generations"][0][0]["message"]["kwargs"]  # serialized
    withheld_or_final = (
        final.response_metadata["withheld_response"]["content"]
        if case == "abstain"
        else final.content
    )
    assert generated["content"] == withheld_or_final
    tag = "abstained" if case == "abstain" else "answered"
    (node,) = [r for r in runs if tag in (r.tags or [])]
    assert node.name == "AbstentionMiddleware.after_model"
    assert node.extra["metadata"][EVENT_NAME] == decision
    assert [e["name"] for e in node.events].count(EVENT_NAME) == 1
    assert root.outputs["messages"][-1].response_metadata["abstention"] == decision
    assert events.events == [(EVENT_NAME, decision)]
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes or {})
    assert attrs["abstain_guard.abstained"] is (case == "abstain")
    assert attrs["abstain_guard.score"] == decision["score"]


def test_real_model_stream_adds_up_to_invoke(
    default_model: Any, questions: dict[str, tuple[str, float]]
) -> None:
    question, _ = questions["abstain"]
    reference = default_model.invoke(question)
    chunks = list(default_model.stream(question))
    assert len(chunks) >= 3 and chunks[-1].chunk_position == "last"
    assert "".join(str(c.content) for c in chunks) == reference.content
    assert chunks[-1].response_metadata == reference.response_metadata
