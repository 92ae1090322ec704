"""Step gating over HTTP: each model call of an agent run decided on the run's running
maximum, as :class:`~abstain_guard.guard.middleware.AbstentionMiddleware` decides it
in-process.

The position is the number of assistant turns after the question, the running maximum that
of the recorded scores of those turns (:class:`~abstain_guard.serve.step_record.StepRecord`).
A miss fails closed: an earlier tool call without a record abstains without running the
model (:func:`unknown_steps_abstention`). A final answer after a tool-step count calibration
never had is checked as the middleware checks it (:func:`check_tool_steps`).
docs/serving.md, "Agents: every step over HTTP".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage

from abstain_guard.contract.deployment import DeploymentRecord, tool_steps_problem
from abstain_guard.errors import ArtifactMismatchError
from abstain_guard.guarantee.agent_steps import Gating
from abstain_guard.guarantee.decision import Decision
from abstain_guard.serve.conversation import openai_tool_calls
from abstain_guard.serve.schemas import RequestRefused
from abstain_guard.serve.step_record import StepEntry, StepRecord, context_digest, step_key

#: The decision's ``reason`` when earlier steps of the run have no record.
UNKNOWN_STEPS = "earlier steps unknown"


def gating_of(record: DeploymentRecord) -> Gating:
    """How the artifact gates an agent (``AgentRecord.gating``; ``"final_answer"`` without
    an agent record)."""
    return record.agent.gating if record.agent is not None else "final_answer"


@dataclass(frozen=True)
class RunSoFar:
    """An agent run as one request finds it.

    Attributes:
        position: the model call this request makes (0-based: assistant turns so far).
        previous: the running maximum of the earlier steps' recorded scores (None: none).
        context: the digest of the run's messages before this call (the key of the step
            this call makes, :func:`~abstain_guard.serve.step_record.step_key`).
        unknown: ids of the earlier tool calls without a record (fail closed).
    """

    position: int
    previous: float | None
    context: str
    unknown: list[str] = field(default_factory=list)


def run_so_far(
    record: StepRecord, question: str, history: Sequence[BaseMessage], steps: Sequence[BaseMessage]
) -> RunSoFar:
    """The run before this request's model call: its position, the recorded running maximum
    of its earlier steps, and which of them have no record."""
    previous: float | None = None
    unknown: list[str] = []
    position = 0
    for i, message in enumerate(steps):
        if not isinstance(message, AIMessage):
            continue
        position += 1
        entry = record.get(step_key(context_digest(question, history, steps[:i]), message))
        if entry is None:
            unknown += [c["id"] for c in openai_tool_calls(message)]
        else:
            previous = entry.step_score if previous is None else max(previous, entry.step_score)
    return RunSoFar(position, previous, context_digest(question, history, steps), unknown)


def remember_step(record: StepRecord, run: RunSoFar, reply: AIMessage, decision: Decision) -> None:
    """Keep an answered tool-calling step's decision under the calls returned to the client."""
    assert decision.step_score is not None and decision.run_statistic is not None
    record.put(
        step_key(run.context, reply),
        StepEntry(
            step=run.position,
            step_score=float(decision.step_score),
            run_statistic=float(decision.run_statistic),
        ),
    )


def unknown_steps_abstention(
    policy: Any, group: str | None, run: RunSoFar, record: StepRecord
) -> tuple[AIMessage, Decision]:
    """The abstention for a run whose earlier steps have no record (nothing generated)."""
    return policy.abstain(  # type: ignore[no-any-return]
        UNKNOWN_STEPS,
        (
            f"this server holds no record of its step decision for tool call(s) "
            f"{run.unknown}: it did not return them in this conversation (edited, invented or "
            f"replayed messages), or their record expired ({record.ttl_s:g} s), was evicted "
            f"(over {record.max_entries} records) or was lost in a restart. The run's running "
            "maximum needs every earlier step's score and the server takes none from "
            "clients, so it abstains; ask the question again to start a new run"
        ),
        group,
        gating="steps",
        step=run.position,
        step_score=None,
        run_statistic=None,
        unknown_tool_calls=tuple(run.unknown),
    )


def check_tool_steps(
    policy: Any, record: DeploymentRecord, steps: Sequence[BaseMessage]
) -> list[str]:
    """The warnings of a final answer after ``steps``: a tool-step count outside the range
    calibration saw is always a warning with step gating, and with final-answer gating a
    warning under ``on_mismatch="warn"``.

    Raises:
        RequestRefused: 400 for a count outside calibration's range with final-answer gating
            and ``on_mismatch="raise"``.
    """
    problem = tool_steps_problem(record, sum(isinstance(m, ToolMessage) for m in steps))
    if problem is None:
        return []
    if gating_of(record) == "steps":
        return [f"agent run: {problem}"]
    try:
        return list(policy.mismatch([problem], "agent run"))
    except ArtifactMismatchError as exc:
        raise RequestRefused(
            f"The model's final answer was withheld: {problem} (on_mismatch='raise'; a "
            "guard with on_mismatch='warn' answers with this warning in the decision).",
            param="messages",
            code="tool_steps_not_calibrated",
        ) from exc
