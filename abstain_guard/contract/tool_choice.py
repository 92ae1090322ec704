"""One reading of ``tool_choice`` (:func:`tool_choice_name`), used wherever one is applied
(``adapters.tools``), recorded (agent calibration) or compared (``serve``), so ``"none"``
means the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from abstain_guard.errors import InvalidInputError

#: The model decides whether to call a tool.
AUTO = "auto"
#: The model calls no tool: its reply is text, never read for calls.
NONE = "none"
#: The model calls some tool (OpenAI's ``"required"``).
REQUIRED = "any"
#: Every keyword value (anything else is a tool's name).
KEYWORDS = (AUTO, NONE, REQUIRED)
#: Spellings of the keywords in the APIs LangChain wraps.
_ALIASES = {"auto": AUTO, "none": NONE, "any": REQUIRED, "required": REQUIRED}


def tool_choice_name(choice: Any) -> str | None:
    """``tool_choice`` as one plain value.

    * ``None``: not given (the model decides, as with ``"auto"``);
    * ``"auto"``; ``"none"`` (also ``False``); ``"any"`` (also ``"required"``, ``True``,
      ``{"type": "any"}`` / ``{"type": "required"}``);
    * a tool's name: ``"name"``, ``{"type": "function", "function": {"name": ...}}``
      (OpenAI), ``{"type": "tool", "name": ...}`` or ``{"name": ...}``.

    Whether a name is one of the bound tools is for the caller to check.

    Raises:
        InvalidInputError: a value that is none of these.
    """
    if choice is None:
        return None
    if isinstance(choice, bool):
        return REQUIRED if choice else NONE
    if isinstance(choice, str):
        if not choice:
            raise InvalidInputError("tool_choice is an empty string; omit it or name a tool")
        return _ALIASES.get(choice, choice)
    if isinstance(choice, Mapping):
        return _mapping_name(choice)
    raise InvalidInputError(
        f"tool_choice {choice!r} is not 'auto', 'none', 'any', 'required', a tool name or "
        '{"type": "function", "function": {"name": ...}}'
    )


def _mapping_name(choice: Mapping[str, Any]) -> str:
    """The tool name (or keyword) of a ``tool_choice`` written as a mapping."""
    inner = choice.get("function")
    name = inner.get("name") if isinstance(inner, Mapping) else choice.get("name")
    if isinstance(name, str) and name:
        return name
    kind = choice.get("type")
    if isinstance(kind, str) and kind in _ALIASES:
        return _ALIASES[kind]
    raise InvalidInputError(
        f"tool_choice {dict(choice)!r} names no tool: send "
        '{"type": "function", "function": {"name": "<tool>"}}, or "auto", "none" or "required"'
    )


def recorded_tool_choice(choice: Any) -> str | None:
    """``tool_choice`` as it is recorded and compared per model call: read by
    :func:`tool_choice_name`; a value it cannot read is kept as its ``repr``, which matches
    no calibrated choice."""
    try:
        return tool_choice_name(choice)
    except InvalidInputError:
        return repr(choice)


def free_choice(choice: str | None) -> str | None:
    """None for a free choice (``"auto"`` or none given), else the choice: the form in which
    a call's choice is compared with calibration's."""
    return None if choice in (None, AUTO) else choice
