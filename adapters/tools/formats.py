"""Tool-call formats: how each chat-template family writes a call, and reading them.

One registry, :data:`FORMATS`, holds how each family writes a call (``"hermes"``,
``"llama3"``, ``"mistral"``, and the ``"prompted"`` fallback read like hermes; see
:mod:`.calls`): its splitter (text → the text outside the calls and the calls as written,
:class:`Found`), the opening that forces a call, and the markers that must survive
decoding. :func:`detect_tool_call_format` picks the format from a chat template. A call that
cannot be read becomes a :class:`Found` with its ``error``, never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from abstain_guard.errors import InvalidInputError

HERMES, LLAMA3, MISTRAL, PROMPTED = "hermes", "llama3", "mistral", "prompted"


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_DECODER = json.JSONDecoder()


# -- reading calls ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """One call as written: ``name`` and ``args`` when readable, the ``raw`` text, and
    ``error`` (None: well-formed; still checked against the tool names later)."""

    name: str | None
    args: dict[str, Any] | None
    raw: str
    error: str | None = None


def _read_args(value: Any) -> dict[str, Any] | None:
    """Arguments as a dict: an object, or a string holding one (OpenAI style); else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def found_from_object(obj: Any, raw: str, arg_keys: Sequence[str] = ("arguments",)) -> Found:
    """A :class:`Found` from a decoded JSON value ``{"name", <arg key>: {...}}`` (a missing
    arguments key means no arguments)."""
    if not isinstance(obj, dict):
        return Found(None, None, raw, "a tool call must be a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return Found(None, None, raw, "the tool call has no name")
    key = next((k for k in arg_keys if k in obj), None)
    args = {} if key is None else _read_args(obj[key])
    if args is None:
        return Found(name, None, raw, f"the arguments of {name!r} are not a JSON object")
    return Found(name, args, raw)


def _decode_at(text: str, start: int) -> tuple[Any, int]:
    """The JSON value at ``text[start:]`` (leading whitespace skipped) and the index after
    it; raises ValueError when there is none."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    return _DECODER.raw_decode(text, i)


def _found_from_text(body: str, arg_keys: Sequence[str] = ("arguments",)) -> Found:
    """A call from the text of exactly one JSON object (surrounding whitespace allowed)."""
    raw = body.strip()
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        return bad_json(raw, exc)
    return found_from_object(obj, raw, arg_keys)


_NAME = re.compile(r'"name"\s*:\s*"([^"\\]+)"')


def bad_json(raw: str, exc: Exception, what: str = "the tool call") -> Found:
    """An unreadable call; its name is taken from a ``"name": "..."`` in ``raw`` if any."""
    match = _NAME.search(raw)
    return Found(match.group(1) if match else None, None, raw, f"{what} is not valid JSON: {exc}")


def split_hermes(text: str) -> tuple[str, list[Found]]:
    """Text outside ``<tool_call>...</tool_call>`` blocks and the calls in them.

    A closed block must hold exactly one JSON object. An unclosed last block (the answer
    ended first) is read up to the end of its JSON object; what follows is text."""
    outside: list[str] = []
    calls: list[Found] = []
    pos = 0
    while (start := text.find(_OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        body_at = start + len(_OPEN)
        end = text.find(_CLOSE, body_at)
        if end >= 0:
            calls.append(_found_from_text(text[body_at:end]))
            pos = end + len(_CLOSE)
            continue
        try:
            obj, after = _decode_at(text, body_at)
        except ValueError as exc:
            calls.append(bad_json(text[body_at:].strip(), exc))
            pos = len(text)
        else:
            calls.append(found_from_object(obj, text[body_at:after].strip()))
            pos = after
        break
    outside.append(text[pos:])
    return "".join(outside), calls


def split_llama3(text: str) -> tuple[str, list[Found]]:
    """Llama 3.1+ calls: after ``<|python_tag|>``, or a reply that starts with a JSON
    object naming a tool; several calls may follow each other, separated by ``;``. A reply
    starting with JSON that is not a call (no ``name``) is plain text."""
    if _PYTHON_TAG in text:
        before, body = text.split(_PYTHON_TAG, 1)
    elif text.lstrip().startswith("{"):
        before, body = "", text
        try:
            first, _ = _decode_at(body, 0)
        except ValueError:
            if '"name"' not in body:
                return text, []
        else:
            if not isinstance(first, dict) or "name" not in first:
                return text, []
    else:
        return text, []
    calls: list[Found] = []
    i = 0
    while True:
        j = i  # i: the end of the last call; j: the start of the next one
        while j < len(body) and (body[j].isspace() or body[j] == ";"):
            j += 1
        if j >= len(body):
            return before, calls
        try:
            obj, after = _decode_at(body, j)
        except ValueError as exc:
            if calls and body[j] != "{":  # text after the calls
                return before + body[i:], calls
            calls.append(bad_json(body[j:].strip(), exc))
            return before, calls
        calls.append(found_from_object(obj, body[j:after].strip(), ("parameters", "arguments")))
        i = after


def split_mistral(text: str) -> tuple[str, list[Found]]:
    """Mistral calls: ``[TOOL_CALLS]`` followed by a JSON list (or one object) of
    ``{"name", "arguments"}``, or by ``name[ARGS]{...}``; text outside is kept."""
    if _MISTRAL_TAG not in text:
        return text, []
    first, *segments = text.split(_MISTRAL_TAG)
    outside = [first]
    calls: list[Found] = []
    for seg in segments:
        head = seg.lstrip()
        if head.startswith(("[", "{")):
            try:
                obj, after = _decode_at(seg, 0)
            except ValueError as exc:
                calls.append(bad_json(seg.strip(), exc, "the tool calls are"))
                continue
            items = obj if isinstance(obj, list) else [obj]
            calls.extend(found_from_object(it, json.dumps(it)) for it in items)
            outside.append(seg[after:])
        elif _MISTRAL_ARGS in seg:
            name, rest = seg.split(_MISTRAL_ARGS, 1)
            try:
                args, after = _decode_at(rest, 0)
            except ValueError as exc:
                found = bad_json(rest.strip(), exc, "the arguments are")
                calls.append(Found(name.strip() or None, None, found.raw, found.error))
                continue
            obj = {"name": name.strip(), "arguments": args}
            calls.append(found_from_object(obj, rest[:after].strip()))
            outside.append(rest[after:])
        else:
            error = "expected a JSON list of calls or name[ARGS]{...} after [TOOL_CALLS]"
            calls.append(Found(None, None, seg.strip(), error))
    return "".join(outside), calls


# -- the registry ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCallFormat:
    """How one template family writes tool calls.

    Attributes:
        name: the registry key.
        template_tools: the chat template takes ``tools=`` (else the prompted system block).
        split: text → (text outside the calls, the calls as written).
        prefill_open: the opening of a call, appended to the prompt to force one.
        args_key: the arguments key of the format's JSON (for the named prefill).
        markers: strings that may be special tokens and must survive decoding.
        short_ids: call ids must be 9 alphanumeric characters (Mistral templates).
    """

    name: str
    template_tools: bool
    split: Callable[[str], tuple[str, list[Found]]]
    prefill_open: str
    args_key: str = "arguments"
    markers: tuple[str, ...] = ()
    short_ids: bool = False


FORMATS: dict[str, ToolCallFormat] = {
    HERMES: ToolCallFormat(
        HERMES, True, split_hermes, _OPEN + '\n{"name": "', markers=(_OPEN, _CLOSE)
    ),
    LLAMA3: ToolCallFormat(
        LLAMA3, True, split_llama3, '{"name": "', "parameters", markers=(_PYTHON_TAG,)
    ),
    MISTRAL: ToolCallFormat(
        MISTRAL,
        True,
        split_mistral,
        _MISTRAL_TAG + '[{"name": "',
        markers=(_MISTRAL_TAG, _MISTRAL_ARGS),
        short_ids=True,
    ),
    PROMPTED: ToolCallFormat(
        PROMPTED, False, split_hermes, _OPEN + '\n{"name": "', markers=(_OPEN, _CLOSE)
    ),
}
"""Every tool-call format, by name."""


def tool_call_format(name: str) -> ToolCallFormat:
    """The registered format ``name``; raises InvalidInputError for an unknown one."""
    if name not in FORMATS:
        raise InvalidInputError(f"unknown tool-call format {name!r}; choose from {sorted(FORMATS)}")
    return FORMATS[name]


def detect_tool_call_format(template: str | None) -> str:
    """The format a chat template uses: ``"prompted"`` when it does not reference
    ``tools`` (or there is no template), else by its call syntax: ``<tool_call>`` →
    hermes, ``[TOOL_CALLS]`` → mistral, ``<|python_tag|>`` or ``ipython`` → llama3, and
    prompted for a syntax this module does not know."""
    if not template or not re.search(r"\btools\b", template):
        return PROMPTED
    if _OPEN in template:
        return HERMES
    if _MISTRAL_TAG in template:
        return MISTRAL
    if _PYTHON_TAG in template or "ipython" in template:
        return LLAMA3
    return PROMPTED


def template_has_tool_role(template: str | None) -> bool:
    """Whether the template names a ``tool`` (or ``ipython``) role in a string literal."""
    return bool(template) and bool(re.search(r"""['"](tool|ipython)['"]""", template or ""))


def prompted_call_text(name: str, args: Mapping[str, Any]) -> str:
    """One call as the prompted (and hermes) format writes it."""
    body = json.dumps({"name": name, "arguments": dict(args)}, ensure_ascii=False)
    return f"{_OPEN}\n{body}\n{_CLOSE}"
