"""Tool calling for local chat models: the tools bound to a call, forced-call prefill and
the reply read for calls.

How each template family writes a call is :mod:`.formats`, the check of arguments against a
tool's JSON Schema :mod:`.schema`; the formats and the prompted fallback are described in
docs/agents.md. A call that cannot be read or is not valid (bad JSON, no name, an unknown
tool, arguments that do not validate) becomes an ``invalid_tool_calls`` entry with its
``error``, as LangChain's own parsers do, never an exception; with ``tool_choice="none"``
the reply is not read for calls (OpenAI's "none": the tools stay in the prompt).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.messages.tool import InvalidToolCall, ToolCall, invalid_tool_call, tool_call
from langchain_core.utils.function_calling import convert_to_openai_tool

from abstain_guard.contract.deployment import sha256_text, tools_sha256
from abstain_guard.contract.tool_choice import AUTO, KEYWORDS, NONE, tool_choice_name
from abstain_guard.errors import InvalidInputError

from .formats import ToolCallFormat, prompted_call_text, tool_call_format
from .schema import schema_name, schema_validator, tool_args_error

#: One tool in OpenAI format: ``{"type": "function", "function": {"name", "description",
#: "parameters"}}`` (what :func:`convert_to_openai_tool` returns).
Schema = dict[str, Any]


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


def normalize_tool_choice(choice: Any, names: Sequence[str]) -> str | None:
    """``choice`` read by :func:`abstain_guard.contract.tool_choice.tool_choice_name` (None, "auto",
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
        schema_validator(schema)  # a schema no call could be checked against: refused now
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
