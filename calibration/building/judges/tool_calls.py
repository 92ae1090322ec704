"""The tool-call judge: were an agent run's executed tool calls the expected ones?

Pure functions over plain data. An executed call is a mapping ``{"name", "args"}`` (a
LangChain ``ToolCall``, or a call as a cached agent run stores it:
``row["agent"]["messages"][i]["tool_calls"]``); an expected call is an
:class:`~abstain_guard.calibration.building.questions.tool_labels.ExpectedCall` (or such a mapping);
``schemas`` are the OpenAI-format tool schemas the model was offered (a run's
``offered[i]["tools"]``). When a call is correct (validation with the schema the model's reply
parsing applies, defaults, same keys, values compared as the tool reads them) and how calls
are matched, ordered or not: docs/agents.md, "Tool-call labels".
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from abstain_guard.adapters.tools.schema import schema_name, tool_args_error, tool_parameters
from abstain_guard.errors import InvalidInputError

from ..questions.tool_labels import ExpectedCall

_MISSING = object()
_NUMERAL = re.compile(r"^[+-]?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?$")


@dataclass(frozen=True)
class CallVerdict:
    """The verdict on one executed call.

    Attributes:
        correct: the call equals an expected call.
        reason: why, in words (``"matches expected call 0 (country_facts)"``, ``"wrong tool
            'city_facts'; expected ['country_facts']"``, ``"argument 'country': 'Pepon' !=
            'Peru'"``, ...).
        expected_index: the index of the expected call it matched, else None.
    """

    correct: bool
    reason: str
    expected_index: int | None = None


def normalize_arg_string(text: str) -> str:
    """A string argument as compared: NFKC, accents folded, case folded, whitespace
    collapsed, trailing punctuation stripped (``" Perú. "`` → ``"peru"``)."""
    text = unicodedata.normalize("NFKC", text)
    text = "".join(
        ch for ch in unicodedata.normalize("NFKD", text) if not unicodedata.combining(ch)
    )
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    while text and unicodedata.category(text[-1]).startswith("P"):
        text = text[:-1].rstrip()
    return text


def _number(value: Any, *, strings: bool) -> float | None:
    """``value`` as a finite number: a JSON number, or (``strings``) a numeral string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if strings and isinstance(value, str) and _NUMERAL.match(value.strip()):
        number = float(value.strip())
        return number if math.isfinite(number) else None
    return None


def _types(schema: Mapping[str, Any] | None) -> set[str]:
    if not schema:
        return set()
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def values_equal(got: Any, want: Any, schema: Mapping[str, Any] | None = None) -> bool:
    """Whether an argument value equals the expected one under the module's rules
    (``schema``: the value's JSON Schema, for number fields and nested defaults)."""
    if isinstance(got, bool) or isinstance(want, bool) or got is None or want is None:
        return type(got) is type(want) and got == want
    types = _types(schema)
    if types & {"number", "integer"} or not types:  # numerals count as numbers
        a, b = _number(got, strings=True), _number(want, strings=True)
        if a is not None and b is not None:
            return a == b
    if isinstance(got, str) and isinstance(want, str):
        return normalize_arg_string(got) == normalize_arg_string(want)
    if isinstance(got, Mapping) and isinstance(want, Mapping):
        return _args_problem(got, want, schema) is None
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        items = (schema or {}).get("items")
        sub = items if isinstance(items, Mapping) else None
        return len(got) == len(want) and all(
            values_equal(g, w, sub) for g, w in zip(got, want, strict=True)
        )
    return False


def _with_defaults(args: Mapping[str, Any], schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """``args`` with each left-out property that has a schema ``default`` set to it."""
    out = dict(args)
    for key, prop in ((schema or {}).get("properties") or {}).items():
        if key not in out and isinstance(prop, Mapping) and "default" in prop:
            out[key] = prop["default"]
    return out


def _args_problem(
    got: Mapping[str, Any], want: Mapping[str, Any], schema: Mapping[str, Any] | None
) -> str | None:
    """Why two argument objects differ (the first difference), or None when equal."""
    got, want = _with_defaults(got, schema), _with_defaults(want, schema)
    extra = sorted(set(got) - set(want))
    if extra:
        return f"extra argument {extra[0]!r} (= {got[extra[0]]!r})"
    missing = sorted(set(want) - set(got))
    if missing:
        return f"missing argument {missing[0]!r} (expected {want[missing[0]]!r})"
    props = (schema or {}).get("properties") or {}
    for key in sorted(want):
        if not values_equal(got[key], want[key], props.get(key)):
            return f"argument {key!r}: {got[key]!r} != expected {want[key]!r}"
    return None


def _expected_pair(
    call: ExpectedCall | Mapping[str, Any], index: int
) -> tuple[str, dict[str, Any]]:
    """``(name, args)`` of an expected call (an ExpectedCall or a ``{"name", "args"}``).

    Raises:
        InvalidInputError: neither, or no name.
    """
    if isinstance(call, ExpectedCall):
        return call.name, call.arguments()
    if isinstance(call, Mapping) and isinstance(call.get("name"), str):
        args = call.get("args") or {}
        if isinstance(args, Mapping):
            return str(call["name"]), dict(args)
    raise InvalidInputError(
        f"expected call {index} is {call!r}; give an ExpectedCall or "
        '{"name": "tool", "args": {...}}'
    )


def _executed_pair(call: Mapping[str, Any], index: int) -> tuple[str, Any]:
    """``(name, args)`` of an executed call.

    Raises:
        InvalidInputError: not a mapping with a string name.
    """
    if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
        raise InvalidInputError(
            f"executed call {index} is {call!r}; give the call as {{'name': ..., 'args': {{...}}}} "
            "(a LangChain ToolCall, or a cached run's message tool_calls entry)"
        )
    return str(call["name"]), call.get("args")


def _schemas_by_name(
    schemas: Sequence[Mapping[str, Any]] | None,
) -> dict[str, Mapping[str, Any]]:
    return {schema_name(s): s for s in schemas or ()}


def _verdict(
    name: str,
    args: Any,
    expected: Sequence[tuple[str, dict[str, Any]]],
    candidates: Sequence[int],
    schemas: Mapping[str, Mapping[str, Any]],
) -> CallVerdict:
    """The verdict of one call against the expected calls at ``candidates`` (untaken)."""
    if not isinstance(args, Mapping):
        return CallVerdict(False, f"arguments are a {type(args).__name__}, not an object")
    schema = schemas.get(name)
    if schema is not None:
        error = tool_args_error(schema, args)
        if error is not None:
            return CallVerdict(False, f"invalid call: {error}")
    params = tool_parameters(schema) if schema is not None else None
    same_tool = [i for i in candidates if expected[i][0] == name]
    if not same_tool:
        wanted = sorted({expected[i][0] for i in candidates})
        if not wanted:
            return CallVerdict(
                False, f"no expected call left for {name!r} (a repeat or an extra call)"
            )
        return CallVerdict(False, f"wrong tool {name!r}; expected {wanted}")
    problems = []
    for i in same_tool:
        problem = _args_problem(args, expected[i][1], params)
        if problem is None:
            return CallVerdict(True, f"matches expected call {i} ({name})", i)
        problems.append(f"expected call {i}: {problem}")
    return CallVerdict(False, "; ".join(problems))


def judge_tool_calls(
    calls: Sequence[Mapping[str, Any]],
    expected: Sequence[ExpectedCall | Mapping[str, Any]],
    *,
    ordered: bool = False,
    schemas: Sequence[Mapping[str, Any]] | None = None,
) -> list[CallVerdict]:
    """One :class:`CallVerdict` per executed call, in order (the rules: docs/agents.md,
    'Tool-call labels'); with ``ordered`` the i-th call must equal the i-th expected call.

    Raises:
        InvalidInputError: a call or an expected call is not of that shape.
    """
    wanted = [_expected_pair(c, i) for i, c in enumerate(expected)]
    by_name = _schemas_by_name(schemas)
    verdicts: list[CallVerdict] = []
    taken: set[int] = set()
    for k, call in enumerate(calls):
        name, args = _executed_pair(call, k)
        if ordered:
            if k >= len(wanted):
                verdicts.append(
                    CallVerdict(False, f"call {k} has no expected call at its position")
                )
                continue
            v = _verdict(name, args, wanted, [k], by_name)
        else:
            v = _verdict(
                name, args, wanted, [i for i in range(len(wanted)) if i not in taken], by_name
            )
            if not v.correct and any(wanted[i][0] == name for i in taken):
                again = _verdict(name, args, wanted, sorted(taken), by_name)
                if again.correct:
                    v = CallVerdict(False, f"repeats expected call {again.expected_index} ({name})")
        if v.expected_index is not None:
            taken.add(v.expected_index)
        verdicts.append(v)
    return verdicts
