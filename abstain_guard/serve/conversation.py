"""An OpenAI request's messages as the chat messages a model runs: :func:`split_turns` takes
the system messages apart and splits the rest at the last user message (the question) into
earlier turns and the agent's steps after it; assistant ``tool_calls`` become
``AIMessage.tool_calls``, ``tool`` messages ``ToolMessage``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolCall,
    ToolMessage,
)

from abstain_guard.contract.tool_choice import tool_choice_name
from abstain_guard.errors import InvalidInputError
from abstain_guard.serve.schemas import ChatMessageIn, RequestRefused

#: Roles of the system prompt (``developer`` is OpenAI's newer name for it).
SYSTEM_ROLES = ("system", "developer")

#: Roles a message may have.
ROLES = (*SYSTEM_ROLES, "user", "assistant", "tool")


@dataclass(frozen=True)
class Turns:
    """A request's messages, split at the question.

    Attributes:
        system: the texts of the system (and developer) messages.
        history: the messages before the question (earlier turns), system ones excluded.
        question: the text of the last user message.
        steps: the messages after the question (an agent's tool calls and their results).
    """

    system: list[str]
    history: list[BaseMessage]
    question: str
    steps: list[BaseMessage] = field(default_factory=list)

    @property
    def tool_turns(self) -> int:
        """Messages with tool calls or tool results, before and after the question."""
        return sum(1 for m in (*self.history, *self.steps) if is_tool_turn(m))


def is_tool_turn(message: BaseMessage) -> bool:
    """Whether ``message`` is an assistant tool call or a tool result."""
    return isinstance(message, ToolMessage) or bool(
        isinstance(message, AIMessage) and message.tool_calls
    )


def _calls(entry: ChatMessageIn, index: int) -> list[ToolCall]:
    """The tool calls of an assistant message, arguments parsed.

    Raises:
        RequestRefused: arguments that are not a JSON object.
    """
    calls: list[ToolCall] = []
    for call in entry.tool_calls or []:
        args: Any = call.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise RequestRefused(
                    f"Message {index}: the arguments of tool call {call.id!r} are not JSON "
                    f"({exc.msg}); send them as a JSON object string.",
                    param=f"messages.{index}.tool_calls",
                ) from exc
        if not isinstance(args, dict):
            raise RequestRefused(
                f"Message {index}: the arguments of tool call {call.id!r} are not a JSON "
                "object; send an object of named arguments.",
                param=f"messages.{index}.tool_calls",
            )
        calls.append(ToolCall(name=call.function.name, args=args, id=call.id, type="tool_call"))
    return calls


def to_message(entry: ChatMessageIn, index: int) -> BaseMessage:
    """One request message as a LangChain message.

    Raises:
        RequestRefused: an unknown role, a tool result without ``tool_call_id``, tool calls
            on a message that is not the assistant's, or malformed call arguments.
    """
    if entry.role not in ROLES:
        raise RequestRefused(
            f"Message {index} has role {entry.role!r}; use system, developer, user, "
            "assistant or tool.",
            param=f"messages.{index}.role",
        )
    if entry.tool_calls and entry.role != "assistant":
        raise RequestRefused(
            f"Message {index} ({entry.role}) has tool_calls; only assistant messages make "
            "tool calls.",
            param=f"messages.{index}.tool_calls",
        )
    text = entry.text()
    if entry.role in SYSTEM_ROLES:
        return SystemMessage(content=text)
    if entry.role == "user":
        return HumanMessage(content=text)
    if entry.role == "assistant":
        return AIMessage(content=text, tool_calls=_calls(entry, index))
    if not entry.tool_call_id:
        raise RequestRefused(
            f"Message {index} is a tool result without tool_call_id; send the id of the "
            "call it answers.",
            param=f"messages.{index}.tool_call_id",
        )
    return ToolMessage(content=text, tool_call_id=entry.tool_call_id, name=entry.name)


def to_messages(entries: Sequence[ChatMessageIn]) -> list[BaseMessage]:
    """All messages of a request (:func:`to_message`), each tool result answering a call an
    earlier assistant message made.

    Raises:
        RequestRefused: a message :func:`to_message` refuses, or a tool result whose
            ``tool_call_id`` no earlier call has.
    """
    out: list[BaseMessage] = []
    calls: set[str] = set()
    for i, entry in enumerate(entries):
        message = to_message(entry, i)
        if isinstance(message, AIMessage):
            calls.update(str(c.get("id")) for c in message.tool_calls)
        if isinstance(message, ToolMessage) and message.tool_call_id not in calls:
            raise RequestRefused(
                f"Message {i} (role 'tool') answers tool call {message.tool_call_id!r}, which "
                "no earlier assistant message made; send the assistant message with that "
                "call (its tool_calls) before the result.",
                param=f"messages.{i}.tool_call_id",
            )
        out.append(message)
    return out


def split_turns(messages: Sequence[ChatMessageIn]) -> Turns:
    """The system texts, earlier turns, question and steps of a request.

    Raises:
        RequestRefused: no user message, an empty question, or a message
            :func:`to_message` refuses.
    """
    converted = to_messages(messages)
    system = [m.text() for m in messages if m.role in SYSTEM_ROLES]
    rest = [c for c, m in zip(converted, messages, strict=True) if m.role not in SYSTEM_ROLES]
    users = [k for k, m in enumerate(rest) if isinstance(m, HumanMessage)]
    if not users:
        raise RequestRefused(
            "The request has no user message; send the question as one.", param="messages"
        )
    last = users[-1]
    question = str(rest[last].content)
    if not question.strip():
        raise RequestRefused("The user message is empty; send a question.", param="messages")
    return Turns(system=system, history=rest[:last], question=question, steps=rest[last + 1 :])


def requested_tool_choice(choice: Any) -> str | None:
    """A request's ``tool_choice`` read by
    :func:`abstain_guard.contract.tool_choice.tool_choice_name` (None, ``"auto"``, ``"none"``,
    ``"any"`` or a tool's name), the reading the local chat model applies and agent calibration
    records.

    Raises:
        RequestRefused: a ``tool_choice`` that is none of these (400).
    """
    try:
        return tool_choice_name(choice)
    except InvalidInputError as exc:
        raise RequestRefused(str(exc), param="tool_choice") from exc


def openai_tool_calls(message: AIMessage) -> list[dict[str, Any]]:
    """The tool calls of ``message`` in OpenAI's response format: ``{"id", "type":
    "function", "function": {"name", "arguments": <JSON string>}}``."""
    return [
        {
            "id": str(call.get("id") or f"call_{i}"),
            "type": "function",
            "function": {
                "name": call["name"],
                "arguments": json.dumps(call["args"], ensure_ascii=False),
            },
        }
        for i, call in enumerate(message.tool_calls)
    ]
