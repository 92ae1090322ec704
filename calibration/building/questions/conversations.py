"""Conversation rows: earlier turns before a calibration question, checked and grouped (the
row format and its rules: docs/agents.md, 'Conversations').
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from abstain_guard.contract.prompts import history_problem, history_role_problem

#: Earlier turns of a conversation row: ``(role, content)`` pairs, role ``"user"`` or
#: ``"assistant"``.
History = tuple[tuple[str, str], ...]

_FORMAT = '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'


def check_history(history: Sequence[Sequence[str]]) -> None:
    """Raise ValueError (the message says what to do) unless ``history`` is well-formed
    (:func:`history_problem`)."""
    problem = history_problem(history)
    if problem is not None:
        raise ValueError(problem)


def json_type_name(value: Any) -> str:
    """The JSON type of a parsed value, for error messages (``"boolean"``, ``"number"``,
    ``"object"``, ``"list"``, else the Python type's name)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _turn(value: Any, index: int) -> tuple[str, str]:
    """One ``{"role", "content"}`` object as a ``(role, content)`` pair.

    Raises:
        ValueError: not an object, a missing or non-string role or content, tool calls.
    """
    if not isinstance(value, Mapping):
        raise ValueError(
            f"history turn {index} is a JSON {json_type_name(value)}, not an object; write each "
            'turn as {"role": "user" | "assistant", "content": "..."}'
        )
    if value.get("tool_calls"):
        raise ValueError(history_role_problem(index, "tool"))
    role, content = value.get("role"), value.get("content")
    if not isinstance(role, str):
        raise ValueError(f"history turn {index} has no role; give it 'user' or 'assistant'")
    if content is not None and not isinstance(content, str):
        raise ValueError(
            f"history turn {index} has a JSON {json_type_name(content)} as content; write the "
            "text as a string"
        )
    return role, content or ""


def json_list(value: Any, name: str, items: str, form: str) -> list[Any]:
    """A row field holding a JSON list, or (CSV/TSV) a string holding one; a missing, null,
    empty string or empty list is ``[]``.

    Raises:
        ValueError: not valid JSON, or not a list (naming the field and the ``form`` to write).
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{name} is not valid JSON ({exc.msg} at column {exc.colno}); write it as {form}"
            ) from exc
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"{name} is a JSON {json_type_name(value)}, not a list of {items}; write it as {form}"
        )
    return list(value)


def parse_history(value: Any) -> History:
    """The earlier turns of a row from its ``history`` field: a JSON list of ``{"role",
    "content"}`` objects, or (CSV/TSV) a string holding one. A missing, null, empty
    string or empty list is no history.

    Raises:
        ValueError: the value is not such a list, or the turns break a rule of
            :func:`history_problem` (the message names the turn and what to do).
    """
    turns = json_list(value, "history", "turns", _FORMAT)
    history = tuple(_turn(turn, i) for i, turn in enumerate(turns, start=1))
    check_history(history)
    return history


def parse_conversation_id(value: Any) -> str | None:
    """A row's conversation id (a string or an integer) as a string; None when missing.

    Raises:
        ValueError: a boolean, a float, an object or a list.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError(
        f"conversation_id is a JSON {json_type_name(value)}; write it as a string (or an integer)"
    )


def conversation_fields(
    values: Mapping[str, Any], history: str | None, conversation_id: str | None
) -> tuple[History, str | None]:
    """A row's earlier turns and conversation id from ``values`` (field name → value as
    read; a missing field is absent or None).

    Raises:
        ValueError: either field is malformed (the message names the field and the fix).
    """
    turns: History = ()
    conversation = None
    if history is not None:
        value = values.get(history)
        try:
            turns = parse_history(value)
        except ValueError as exc:
            raise ValueError(f"field {history!r}: {exc}") from exc
    if conversation_id is not None:
        try:
            conversation = parse_conversation_id(values.get(conversation_id))
        except ValueError as exc:
            raise ValueError(f"field {conversation_id!r}: {exc}") from exc
    return turns, conversation


def conversation_units(conversations: Sequence[str | None]) -> list[list[int]]:
    """Indices of the rows of each conversation, conversations in order of first appearance
    and rows in input order; a row without a conversation (None) is one of its own."""
    units: list[list[int]] = []
    where: dict[str, int] = {}
    for i, conversation in enumerate(conversations):
        if conversation is None:
            units.append([i])
        elif conversation in where:
            units[where[conversation]].append(i)
        else:
            where[conversation] = len(units)
            units.append([i])
    return units
