"""Expected tool calls of a calibration row: the shape, and reading it from a data file (the
row format: docs/agents.md, 'Tool-call labels'; judged by
:func:`~abstain_guard.calibration.building.judges.tool_calls.judge_tool_calls`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .conversations import json_list, json_type_name

#: A call's arguments, hashable: ``(name, value)`` pairs sorted by name, values frozen
#: (:func:`freeze`): objects as sorted pair tuples, lists as tuples.
FrozenArgs = tuple[tuple[str, Any], ...]

_FORMAT = '[{"name": "tool_name", "args": {"argument": "value"}}]'


def freeze(value: Any) -> Any:
    """A JSON value made hashable: an object → a sorted tuple of ``(key, frozen value)``
    marked by a leading ``"__object__"``, a list → a tuple of frozen values; scalars as they
    are. :func:`thaw` inverts it."""
    if isinstance(value, Mapping):
        return ("__object__", *sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The JSON value :func:`freeze` froze (objects as dicts, lists as lists)."""
    if isinstance(value, tuple):
        if value[:1] == ("__object__",):
            return {k: thaw(v) for k, v in value[1:]}
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class ExpectedCall:
    """One tool call a right run makes: the tool's name and its arguments.

    ``args`` is stored frozen (hashable, so a :class:`QAItem` holding calls stays hashable);
    build one with :meth:`of` from a plain mapping and read the arguments back with
    :meth:`arguments`.
    """

    name: str
    args: FrozenArgs = ()

    @classmethod
    def of(cls, name: str, args: Mapping[str, Any] | None = None) -> ExpectedCall:
        """``ExpectedCall.of("country_facts", {"country": "Peru"})``."""
        frozen = freeze(dict(args or {}))
        return cls(name=name, args=tuple(frozen[1:]))

    def arguments(self) -> dict[str, Any]:
        """The arguments as a plain JSON-like dict (a fresh copy)."""
        return {k: thaw(v) for k, v in self.args}

    def to_json(self) -> dict[str, Any]:
        """``{"name": ..., "args": {...}}``, the row format."""
        return {"name": self.name, "args": self.arguments()}


def _check_json_value(value: Any, where: str) -> None:
    """Raise ValueError unless ``value`` is a finite JSON value (strings, numbers, booleans,
    null, lists, objects with string keys)."""
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}, not a finite number")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json_value(v, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where} has a non-string key {k!r}")
            _check_json_value(v, f"{where}.{k}")
        return
    raise ValueError(f"{where} is a {type(value).__name__}, not a JSON value")


def _expected_call(value: Any, index: int) -> ExpectedCall:
    """One ``{"name", "args"}`` object as an :class:`ExpectedCall`.

    Raises:
        ValueError: not an object, no name, args not an object, unknown keys.
    """
    where = f"expected tool call {index}"
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where} is a JSON {json_type_name(value)}, not an object; write each call as "
            '{"name": "tool_name", "args": {...}}'
        )
    unknown = sorted(set(value) - {"name", "args"})
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; a call has only 'name' and 'args'")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where} has no tool name; give it 'name': the tool's name")
    args = value.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise ValueError(
            f"{where} ({name!r}) has a JSON {json_type_name(args)} as 'args'; write the "
            'arguments as an object, e.g. {"country": "Peru"}'
        )
    _check_json_value(args, f"{where} ({name!r}) args")
    return ExpectedCall.of(name.strip(), args)


def parse_expected_calls(value: Any) -> tuple[ExpectedCall, ...]:
    """A row's expected calls from its ``expected_tool_calls`` field: a JSON list of
    ``{"name", "args"}`` objects, or (CSV/TSV) a string holding one. Missing, null, an
    empty string or an empty list is no expected call.

    Raises:
        ValueError: the value is not such a list (the message names the call and the fix).
    """
    calls = json_list(value, "expected_tool_calls", "calls", _FORMAT)
    return tuple(_expected_call(v, i) for i, v in enumerate(calls, start=1))


def parse_ordered(value: Any) -> bool:
    """A row's ``tool_calls_ordered`` flag: a JSON boolean, or (CSV/TSV) ``true``/``false``
    (any case, or ``1``/``0``); missing or empty is False.

    Raises:
        ValueError: anything else.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError(
        f"tool_calls_ordered is {value!r} (a JSON {json_type_name(value)}); write true or false"
    )


def tool_label_fields(row: Mapping[str, Any]) -> tuple[tuple[ExpectedCall, ...], bool]:
    """``(expected calls, ordered)`` from a row's ``expected_tool_calls`` and
    ``tool_calls_ordered`` fields (absent: no calls, unordered).

    Raises:
        ValueError: either field is malformed, or ``tool_calls_ordered`` is set without
            expected calls (the message names the field and the fix).
    """
    calls = parse_expected_calls(row.get("expected_tool_calls"))
    ordered = parse_ordered(row.get("tool_calls_ordered"))
    if ordered and not calls:
        raise ValueError(
            "tool_calls_ordered is true but the row has no expected_tool_calls; give the "
            "calls or drop the flag"
        )
    return calls, ordered
