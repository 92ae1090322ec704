"""Where an agent run goes when the guard stops it (``GuardConfig.on_abstain``): ``"end"``
(the abstention ends it), ``"interrupt"`` (a human reviews the stopped step through
LangGraph's ``interrupt``, in the shape of LangChain's ``HumanInTheLoopMiddleware``: approve,
edit or reject each pending action) or ``"fallback"`` (the middleware's fallback model or
agent does the rest). A continued run is outside the certificate: its decisions say
``certified: false`` and ``continued_by``. docs/agents.md, "When the guard stops a run".
Pure helpers; the middleware applies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from langchain_core.messages import AIMessage

from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee.decision import Decision

#: The ``action`` of a decision whose run a human or a fallback continued.
CONTINUED = ("approved", "edited", "fallback")

#: The action name under which a withheld final answer is shown for review.
FINAL_ANSWER_ACTION = "final_answer"

Review = Literal["approved", "edited", "rejected"]


def review_request(withheld: Mapping[str, Any], decision: Decision) -> dict[str, Any]:
    """The ``interrupt`` payload for a stopped step: one action per withheld tool call (or
    the withheld final answer as ``final_answer`` with ``{"content": ...}``), each with a
    description naming the score and τ, and the guard's decision under ``abstention``."""
    calls = list(withheld.get("tool_calls") or [])
    stepped = decision.step is not None  # the step's own score and the run's maximum
    score = decision.step_score if stepped else decision.score
    statistic = decision.run_statistic if stepped else decision.score
    why = (
        f"The abstention guard stopped this step: step score {_fmt(score)}, run statistic "
        f"{_fmt(statistic)} > τ {_fmt(decision.threshold)}. Approving it takes the run "
        "outside the guard's certificate."
    )
    if calls:
        actions = [
            {"name": c["name"], "args": dict(c.get("args") or {}), "description": why}
            for c in calls
        ]
        configs = [
            {"action_name": c["name"], "allowed_decisions": ["approve", "edit", "reject"]}
            for c in calls
        ]
    else:
        content = withheld.get("content")
        actions = [{"name": FINAL_ANSWER_ACTION, "args": {"content": content}, "description": why}]
        configs = [
            {"action_name": FINAL_ANSWER_ACTION, "allowed_decisions": ["approve", "edit", "reject"]}
        ]
    return {
        "action_requests": actions,
        "review_configs": configs,
        "abstention": decision.to_dict(),
    }


def apply_review(
    original: AIMessage, response: Any, n_actions: int
) -> tuple[AIMessage | None, Review]:
    """The message to continue with after the human's ``response`` to :func:`review_request`
    for the stopped ``original`` message (its tool calls, or its text for a final answer);
    ``(None, "rejected")`` when any action is rejected (the run ends with the abstention).

    Raises:
        InvalidInputError: the response is not ``{"decisions": [...]}`` with one valid
            decision per action (an edit must keep the call's position and name a tool).
    """
    decisions = response.get("decisions") if isinstance(response, Mapping) else None
    if not isinstance(decisions, Sequence) or len(decisions) != n_actions:
        raise InvalidInputError(
            f"resume the stopped run with {{'decisions': [...]}} holding one decision per "
            f"pending action ({n_actions}); got {response!r}"
        )
    kinds = [d.get("type") if isinstance(d, Mapping) else None for d in decisions]
    bad = [k for k in kinds if k not in ("approve", "edit", "reject")]
    if bad:
        raise InvalidInputError(
            f"a review decision's type must be 'approve', 'edit' or 'reject', got {bad}"
        )
    if "reject" in kinds:
        return None, "rejected"
    if "edit" not in kinds:
        return original, "approved"
    if not original.tool_calls:  # an edited final answer
        edited = decisions[0].get("edited_action") or {}
        content = (edited.get("args") or {}).get("content")
        if not isinstance(content, str):
            raise InvalidInputError(
                "edit a withheld final answer with "
                "{'type': 'edit', 'edited_action': {'name': 'final_answer', "
                "'args': {'content': '...'}}}"
            )
        return original.model_copy(update={"content": content}), "edited"
    calls = []
    for call, decision in zip(original.tool_calls, decisions, strict=True):
        if decision["type"] != "edit":
            calls.append(call)
            continue
        edited = decision.get("edited_action")
        if not isinstance(edited, Mapping) or not isinstance(edited.get("name"), str):
            raise InvalidInputError(
                "an edit decision needs 'edited_action': {'name': <tool>, 'args': {...}}"
            )
        calls.append({**call, "name": edited["name"], "args": dict(edited.get("args") or {})})
    return original.model_copy(update={"tool_calls": calls}), "edited"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)
