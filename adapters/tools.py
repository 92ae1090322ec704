"""Tool calling for local chat models: formats, detection, prefill and parsing.

A chat template either takes a ``tools`` list (Qwen2/2.5, Llama 3.1+, Mistral, ...) or does
not (SmolLM2, the embedded model). One registry, :data:`FORMATS`, holds how each family
writes a call:

* ``"hermes"`` (Qwen2/2.5, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`` blocks, text allowed around them;
* ``"llama3"`` (Llama 3.1+): the whole reply is ``{"name": ..., "parameters": {...}}``
  (several separated by ``;``), optionally after ``<|python_tag|>``;
* ``"mistral"``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or the
  newer ``[TOOL_CALLS]name[ARGS]{...}`` (repeated per call);
* ``"prompted"``, the fallback for templates that do not take ``tools``: the tool list is
  written into the system message as :func:`prompted_tool_block` (a fixed text), and calls
  are read like hermes. Tool results go into a user message
  ``<tool_response>\\n{content}\\n</tool_response>`` when the template has no tool role.

A call forced by ``tool_choice`` is begun in the prompt (:func:`tool_prefill`); the text
read for calls is that opening plus the generated text; with ``tool_choice="none"`` it is
not read for calls at all (OpenAI's "none": the tools stay in the prompt, no call is taken).
Everything here is a pure function of its arguments (a tokenizer is only read). A call that
cannot be read or is not a valid call (bad JSON, no name, an unknown tool, arguments that are
not an object or do not validate against the tool's JSON Schema, :func:`tool_args_error`)
becomes an ``invalid_tool_calls`` entry with its ``error``, as LangChain's own parsers do,
never an exception. Messages are rendered by :mod:`.encoding` (``chat_dicts`` with a
``ToolRendering``), tool calls streamed by :func:`.streaming.reply_chunks`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
from langchain_core.messages import AIMessage
from langchain_core.messages.tool import InvalidToolCall, ToolCall, invalid_tool_call, tool_call
from langchain_core.utils.function_calling import convert_to_openai_tool

from abstain_guard.deployment import sha256_text, tools_sha256
from abstain_guard.errors import InvalidInputError
from abstain_guard.tool_choice import AUTO, KEYWORDS, NONE, tool_choice_name

HERMES, LLAMA3, MISTRAL, PROMPTED = "hermes", "llama3", "mistral", "prompted"

#: One tool in OpenAI format: ``{"type": "function", "function": {"name", "description",
#: "parameters"}}`` (what :func:`convert_to_openai_tool` returns).
Schema = dict[str, Any]

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


# -- the tools of one call -------------------------------------------------------------------

PROMPTED_HEADER = "You can use the following tools:\n"
PROMPTED_FOOTER = (
    "\n\nTo use a tool, reply with a tool call whose arguments are values taken from the "
    "question, like:\n{example}\nIf no tool is needed, answer directly."
)


def prompted_tool_block(schemas: Sequence[Mapping[str, Any]]) -> str:
    """The system-prompt text of the prompted fallback (a pure function of ``schemas``, in
    OpenAI format, in order)::

        You can use the following tools:
        - <name>: <description>
          Parameters (JSON Schema): <parameters as JSON>
        ...

        To use a tool, reply with a tool call whose arguments are values taken from the
        question, like:
        <tool_call>
        {"name": "<first tool>", "arguments": {"<param>": "<<param>>", ...}}
        </tool_call>
        If no tool is needed, answer directly.

    (the example names the first tool and its parameters, as :func:`prompted_call_text`
    writes a call; the second paragraph is one line)."""
    lines = []
    for schema in schemas:
        fn = schema.get("function", schema)
        params = json.dumps(fn.get("parameters", {}), ensure_ascii=False)
        lines.append(
            f"- {fn.get('name')}: {fn.get('description', '')}\n  Parameters (JSON Schema): {params}"
        )
    first = schemas[0].get("function", schemas[0]) if schemas else {}
    props = first.get("parameters", {}).get("properties", {})
    example = prompted_call_text(str(first.get("name", "")), {k: f"<{k}>" for k in props})
    return PROMPTED_HEADER + "\n".join(lines) + PROMPTED_FOOTER.format(example=example)


def prompted_call_text(name: str, args: Mapping[str, Any]) -> str:
    """One call as the prompted (and hermes) format writes it."""
    body = json.dumps({"name": name, "arguments": dict(args)}, ensure_ascii=False)
    return f"{_OPEN}\n{body}\n{_CLOSE}"


def schema_name(schema: Mapping[str, Any]) -> str:
    """The tool name of an OpenAI-format schema."""
    return str(schema.get("function", schema).get("name", ""))


def normalize_tool_choice(choice: Any, names: Sequence[str]) -> str | None:
    """``choice`` read by :func:`abstain_guard.tool_choice.tool_choice_name` (None, "auto",
    "none", "any" or a tool name; ``"required"``/True → "any", False → "none"), a name
    checked against the bound tools ``names``. Raises InvalidInputError for anything else."""
    name = tool_choice_name(choice)
    if name is None or name in KEYWORDS or name in names:
        return name
    raise InvalidInputError(
        f"tool_choice {choice!r} is not 'auto', 'any', 'required', 'none' or one of the bound "
        f"tools {sorted(names)}"
    )


def tool_prefill(fmt: str, choice: str | None) -> str:
    """The opening of a call appended after the generation prompt when ``choice`` forces
    one: "any" → the format's opening up to the tool name; a tool name → up to its
    arguments; None/"auto"/"none" → ""."""
    if choice in (None, AUTO, NONE):
        return ""
    spec = tool_call_format(fmt)
    if choice == "any":
        return spec.prefill_open
    return spec.prefill_open + json.dumps(choice)[1:-1] + f'", "{spec.args_key}": '


@dataclass(frozen=True)
class ToolSetup:
    """The tools bound to one call: OpenAI ``schemas``, the normalized ``choice`` and the
    ``format`` the model's template uses."""

    schemas: tuple[Schema, ...]
    choice: str | None
    format: str

    @property
    def names(self) -> list[str]:
        """The tool names, in order."""
        return [schema_name(s) for s in self.schemas]

    @property
    def spec(self) -> ToolCallFormat:
        """The format's registry entry."""
        return tool_call_format(self.format)

    @property
    def prompt_block(self) -> str | None:
        """The prompted fallback's system block (None for template formats)."""
        return None if self.spec.template_tools else prompted_tool_block(self.schemas)

    @property
    def template_tools(self) -> list[Schema] | None:
        """What goes to ``apply_chat_template(tools=...)`` (None for the prompted one)."""
        return list(self.schemas) if self.spec.template_tools else None

    @property
    def prefill(self) -> str:
        """See :func:`tool_prefill`."""
        return tool_prefill(self.format, self.choice)

    @property
    def end_markers(self) -> tuple[str, ...]:
        """Text after which generation ends (the text is kept): ``</tool_call>`` in the
        prompted format, whose models know no end-of-call token of their own — one call
        per model turn, and no tokens spent on what a small model writes after it.
        Template formats end with the model's own EOS (parallel calls stay possible)."""
        return ("</tool_call>",) if self.format == "prompted" else ()

    def read(self, text: str, seed: str | None = None) -> ParsedReply:
        """The reply ``text`` (prefill included) read for calls against these tools: names
        and arguments checked (:func:`parse_tool_calls` with the schemas); with
        ``tool_choice="none"`` the reply is text, never read for calls."""
        if self.choice == NONE:
            return ParsedReply(text, [], [])
        return parse_tool_calls(text, self.format, self.names, seed, schemas=self.schemas)

    def record(self) -> dict[str, Any]:
        """The generation-record keys of tool calling (see :data:`NO_TOOLS_RECORD`)."""
        return {
            "tools_sha256": tools_sha256(list(self.schemas)),
            "tool_choice": self.choice,
            "tool_call_format": self.format,
            "tool_prompt_sha256": sha256_text(self.prompt_block),
        }


NO_TOOLS_RECORD: dict[str, Any] = {
    "tools_sha256": None,
    "tool_choice": None,
    "tool_call_format": None,
    "tool_prompt_sha256": None,
}
"""The tool keys of a generation record without tools."""


# -- arguments against the tool's schema -----------------------------------------------------

#: Keywords by which a parameters schema says what it does with arguments it does not list.
_OPEN_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def tool_parameters(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON Schema a call's arguments must satisfy: the tool's ``parameters`` (an object
    with no properties when it has none), closed to arguments it does not declare
    (``additionalProperties: false``) unless it says itself what to do with them. A
    model that invents an argument has not called the tool it was shown."""
    fn = schema.get("function", schema)
    params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
    if not any(key in params for key in _OPEN_KEYWORDS):
        params["additionalProperties"] = False
    return params


@functools.lru_cache(maxsize=256)
def _validator(parameters_json: str) -> Any:
    """A jsonschema validator of one parameters schema (given as canonical JSON, the cache
    key); the dialect is the schema's ``$schema`` (draft 2020-12 without one).

    Raises:
        jsonschema.SchemaError: the schema is not valid JSON Schema.
    """
    parameters = json.loads(parameters_json)
    cls = jsonschema.validators.validator_for(parameters)
    cls.check_schema(parameters)
    return cls(parameters)


def _schema_validator(schema: Mapping[str, Any]) -> Any:
    """The validator of ``schema``'s closed parameters (:func:`tool_parameters`).

    Raises:
        InvalidInputError: the tool's parameters are not valid JSON Schema.
    """
    parameters = tool_parameters(schema)
    try:
        return _validator(json.dumps(parameters, sort_keys=True, ensure_ascii=False))
    except jsonschema.SchemaError as exc:
        raise InvalidInputError(
            f"the parameters of tool {schema_name(schema)!r} are not valid JSON Schema: "
            f"{exc.message}"
        ) from exc


def tool_args_error(schema: Mapping[str, Any], args: Mapping[str, Any]) -> str | None:
    """Why ``args`` do not validate against the tool ``schema`` (OpenAI format; see
    :func:`tool_parameters`), or None when they do. The one check of a call's arguments,
    whoever generated it (calibration, an agent, the server)."""
    error = jsonschema.exceptions.best_match(_schema_validator(schema).iter_errors(dict(args)))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    at = f" (at {where})" if where else ""
    return (
        f"the arguments of {schema_name(schema)!r} do not match its parameters schema: "
        f"{error.message}{at}"
    )


def tool_setup(tools: Sequence[Any] | None, choice: Any, fmt: str) -> ToolSetup | None:
    """The :class:`ToolSetup` of a call (None without tools). ``tools`` are anything
    :func:`convert_to_openai_tool` takes. Raises InvalidInputError for a forcing
    ``tool_choice`` without tools or one naming no bound tool."""
    if not tools:
        if tool_choice_name(choice) not in (None, AUTO, NONE):
            raise InvalidInputError(f"tool_choice={choice!r} needs tools; bind some first")
        return None
    schemas = tuple(convert_to_openai_tool(t) for t in tools)
    for schema in schemas:
        _schema_validator(schema)  # a schema no call could be checked against: refused now
    names = [schema_name(s) for s in schemas]
    return ToolSetup(schemas, normalize_tool_choice(choice, names), fmt)


# -- the generated reply ---------------------------------------------------------------------


def decode_keeping(tokenizer: Any, ids: Sequence[int], keep: Sequence[str]) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, except that the special tokens
    whose text is in ``keep`` stay in the text (e.g. Mistral's ``[TOOL_CALLS]``)."""
    keep_ids: dict[int, str] = {}
    for marker in keep:
        tid = tokenizer.convert_tokens_to_ids(marker)
        known = isinstance(tid, int) and tid != tokenizer.unk_token_id
        if known and tokenizer.decode([tid], skip_special_tokens=True) == "":
            keep_ids[tid] = marker
    if not keep_ids:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))
    parts: list[str] = []
    run: list[int] = []
    for tid in ids:
        if int(tid) in keep_ids:
            parts.append(tokenizer.decode(run, skip_special_tokens=True))
            parts.append(keep_ids[int(tid)])
            run = []
        else:
            run.append(int(tid))
    parts.append(tokenizer.decode(run, skip_special_tokens=True))
    return "".join(parts)


def call_id(seed: str | None, index: int, short: bool = False) -> str:
    """The id of call ``index``: ``call_<24 hex>`` from a hash of ``seed`` (the run's ids,
    so the same generation gets the same ids), a random one without a seed; 9 hex
    characters with ``short`` (Mistral)."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).hexdigest() if seed else uuid.uuid4().hex
    return digest[:9] if short else f"call_{digest[:24]}"


def run_seed(prompt: Sequence[int], token_ids: Sequence[int]) -> str:
    """A seed for :func:`call_id` from a generation's prompt and token ids."""
    return hashlib.sha256(json.dumps([list(prompt), list(token_ids)]).encode()).hexdigest()


@dataclass(frozen=True)
class ParsedReply:
    """An answer read for tool calls: ``content`` (the text outside the calls, stripped;
    the whole text when there are none), ``tool_calls`` and ``invalid_tool_calls``."""

    content: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]


def parse_tool_calls(
    text: str,
    fmt: str,
    names: Sequence[str],
    seed: str | None = None,
    *,
    schemas: Sequence[Mapping[str, Any]] = (),
) -> ParsedReply:
    """Read ``text`` in format ``fmt``; a call naming no tool in ``names`` is invalid, and
    so is one whose arguments do not validate against its tool's schema in ``schemas``
    (:func:`tool_args_error`; a tool without a schema there is not checked). Never raises
    for a malformed reply."""
    spec = tool_call_format(fmt)
    outside, found = spec.split(text)
    if not found:
        return ParsedReply(text, [], [])
    by_name = {schema_name(s): s for s in schemas}
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for i, f in enumerate(found):
        cid = call_id(seed, i, spec.short_ids)
        error = f.error
        if error is None and f.name not in names:
            error = f"unknown tool {f.name!r}; the bound tools are {sorted(names)}"
        if error is None and f.name in by_name and f.args is not None:
            error = tool_args_error(by_name[f.name], f.args)
        if error is None and f.name is not None and f.args is not None:
            calls.append(tool_call(name=f.name, args=f.args, id=cid))
        else:
            # a readable call that is not valid keeps its arguments' JSON as args
            raw = f.raw if f.args is None else json.dumps(f.args, ensure_ascii=False)
            invalid.append(invalid_tool_call(name=f.name, args=raw, id=cid, error=error))
    return ParsedReply(outside.strip(), calls, invalid)


def with_tool_calls(message: AIMessage, reply: ParsedReply) -> AIMessage:
    """``message`` (metadata and usage kept) with the content and calls of ``reply``."""
    return AIMessage(
        content=reply.content,
        tool_calls=reply.tool_calls,
        invalid_tool_calls=reply.invalid_tool_calls,
        response_metadata=message.response_metadata,
        usage_metadata=message.usage_metadata,
    )


__all__ = [
    "FORMATS",
    "NO_TOOLS_RECORD",
    "Found",
    "ParsedReply",
    "ToolCallFormat",
    "ToolSetup",
    "call_id",
    "decode_keeping",
    "detect_tool_call_format",
    "normalize_tool_choice",
    "parse_tool_calls",
    "prompted_call_text",
    "prompted_tool_block",
    "run_seed",
    "schema_name",
    "template_has_tool_role",
    "tool_args_error",
    "tool_call_format",
    "tool_parameters",
    "tool_prefill",
    "tool_setup",
    "with_tool_calls",
]
