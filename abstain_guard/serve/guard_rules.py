"""What a request may carry, given what the served artifact was calibrated on: exactly the
calibrated ``tools`` (by schema hash) and a ``tool_choice`` calibration had at that model
call of the run; earlier turns only for an artifact calibrated on conversations, in the
calibrated shape; tool calls and results only for one calibrated on an agent. Anything else
is refused (400) with what was calibrated and what to do. docs/serving.md, "What a request
may ask".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.utils.function_calling import convert_to_openai_tool

from abstain_guard.contract.deployment import DeploymentRecord, conversation_refusal, tools_sha256
from abstain_guard.contract.prompts import history_problem
from abstain_guard.contract.tool_choice import AUTO, NONE, REQUIRED, free_choice
from abstain_guard.serve.conversation import Turns, is_tool_turn, requested_tool_choice
from abstain_guard.serve.schemas import ChatCompletionRequest, RequestRefused

#: How to calibrate an agent with its tools (named in refusals).
CALIBRATE_AGENT = "calibrate the agent as deployed with `abstain-guard calibrate --agent`"


def tool_name(schema: Mapping[str, Any]) -> str:
    """The tool name of an OpenAI-format schema."""
    return str((schema.get("function") or {}).get("name", schema.get("name", "?")))


def request_tools(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's tools in OpenAI format (as a chat model's ``bind_tools`` records them).

    Raises:
        RequestRefused: a tool that is not a function schema.
    """
    tools = []
    for i, tool in enumerate(request.tools or []):
        try:
            tools.append(convert_to_openai_tool(tool))
        except (TypeError, ValueError, KeyError) as exc:
            raise RequestRefused(
                f"tools.{i} is not a function tool schema ({exc}); send "
                '{"type": "function", "function": {"name", "description", "parameters"}}.',
                param=f"tools.{i}",
            ) from exc
    return tools


def check_tools(
    record: DeploymentRecord, request: ChatCompletionRequest, position: int = 0
) -> str | None:
    """Check the request's ``tools`` and ``tool_choice`` (for model call ``position`` of the
    run) against the calibration; return the ``tool_choice`` to bind (None: the model
    decides).

    Raises:
        RequestRefused: other tools than the calibrated ones (or tools where calibration
            had none, or none where it had some), or another ``tool_choice``.
    """
    calibrated = [tool_name(t) for t in record.tools or []]
    offered = request_tools(request)
    if tools_sha256(offered) != record.tools_sha256:
        if not calibrated:
            message = (
                "tools are not accepted: this guard was calibrated without tools, on "
                f"questions answered directly. Omit tools, or {CALIBRATE_AGENT}."
            )
        elif not offered:
            message = (
                f"This guard was calibrated with the tools {calibrated} (an agent); send "
                "exactly those tool schemas with every request (GET /readyz lists them)."
            )
        else:
            message = (
                f"The tools {[tool_name(t) for t in offered]} differ from the ones this guard "
                f"was calibrated with: {calibrated}. Send exactly the calibrated schemas "
                f"(same names, descriptions and parameters), or {CALIBRATE_AGENT} with these."
            )
        raise RequestRefused(message, param="tools", code="tools_not_calibrated")
    return _tool_choice(record, request, position)


def _tool_choice(
    record: DeploymentRecord, request: ChatCompletionRequest, position: int
) -> str | None:
    """The ``tool_choice`` to bind for model call ``position`` of the run (0-based: the
    assistant turns after the question so far): one calibration's runs had at that position
    (``AgentRecord.call_tool_choices``; None and ``"auto"`` are one; a position no
    calibration run reached takes any).

    Raises:
        RequestRefused: ``tool_choice`` without tools, or one calibration did not have there.
    """
    asked = requested_tool_choice(request.tool_choice)
    if not record.tools:
        if asked not in (None, NONE, AUTO):
            raise RequestRefused(
                f"tool_choice={asked!r} needs tools, and this guard was calibrated without "
                "tools; omit tool_choice.",
                param="tool_choice",
            )
        return None
    calibrated = record.agent.call_tool_choices if record.agent is not None else {}
    return _call_choice(calibrated, position, asked)


def _call_choice(
    calibrated: Mapping[str, list[str | None]], position: int, asked: str | None
) -> str | None:
    """``asked`` for model call ``position`` when calibration's runs had it there."""
    seen = calibrated.get(str(position))
    if seen is None or free_choice(asked) in {free_choice(c) for c in seen}:
        return free_choice(asked)
    spellings = sorted({_openai_spelling(c) for c in seen})
    raise RequestRefused(
        f"tool_choice={_openai_spelling(asked)} for model call {position + 1} of the run "
        f"({position} assistant turn(s) after the question), but calibration's runs had "
        f"{' or '.join(spellings)} there; send that tool_choice at this point of the run, as "
        "the calibrated agent does (GET /readyz lists each call's calibrated choices).",
        param="tool_choice",
        code="tool_choice_not_calibrated",
    )


def _openai_spelling(choice: str | None) -> str:
    """How an OpenAI request says ``choice``."""
    if choice in (None, AUTO):
        return "'auto' (or none)"
    if choice in (NONE, REQUIRED):
        return repr("required" if choice == REQUIRED else NONE)
    return json.dumps({"type": "function", "function": {"name": choice}})


def check_turns(record: DeploymentRecord, turns: Turns) -> None:
    """Check the conversation's shape against the calibration.

    Raises:
        RequestRefused: earlier turns for an artifact calibrated on single questions (or in
            a shape calibration never had), tool calls or results for one not calibrated on
            an agent, or steps after the question that are not tool calls and results.
    """
    if turns.tool_turns and (record.agent is None or not record.tools):
        raise RequestRefused(
            "Assistant tool calls and tool results are accepted only by a guard calibrated "
            "on an agent with its tools; this one was calibrated on questions answered "
            f"directly. Send the question alone, or {CALIBRATE_AGENT}.",
            param="messages",
        )
    if turns.steps:
        last = turns.steps[-1]
        if not all(is_tool_turn(m) for m in turns.steps) or not isinstance(last, ToolMessage):
            raise RequestRefused(
                "After the question only the assistant's tool calls and their results may "
                "follow, ending with a tool result: end the messages with the question or "
                "with tool results.",
                param="messages",
            )
    if not turns.history:
        return
    if not record.calibrated_on_conversations:
        refusal = conversation_refusal(len(turns.history))
        raise RequestRefused(refusal[0].upper() + refusal[1:] + ".", param="messages")
    said = [m for m in turns.history if not is_tool_turn(m)]
    pairs = [("user" if isinstance(m, HumanMessage) else "assistant", m.text) for m in said]
    problem = history_problem(pairs)
    if problem is not None or not all(isinstance(m, (HumanMessage, AIMessage)) for m in said):
        raise RequestRefused(
            "The earlier turns are not in the shape this guard was calibrated on "
            f"(user / assistant turns alternating, ending with the assistant): {problem}.",
            param="messages",
        )
