"""From LangChain messages to token ids: chat roles, the chat template, left-padded batches.

The prompt ids are exactly what generation feeds the model (chat template with the
generation prompt), so replaying ``prompt_token_ids + token_ids`` reproduces a generation.
AI tool calls and tool results are written the template's way (:class:`ToolRendering`, the
formats of :mod:`..tools.formats`); conversations without them give the plain role/content dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import ToolCall

from abstain_guard.errors import InvalidInputError

from ..tools.formats import prompted_call_text, tool_call_format
from .prefix import common_prefix

#: A response to replay: its text, or the exact generated token ids.
AnswerLike = str | Sequence[int]


def message_text(message: BaseMessage) -> str:
    """The text of a message; raises InvalidInputError for non-text content blocks."""
    content = message.content
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            else:
                raise InvalidInputError(
                    "only text content is supported; got a content block of type "
                    f"{block.get('type') if isinstance(block, dict) else type(block).__name__}"
                )
        return "".join(parts)
    raise InvalidInputError(f"message content must be a string, got {type(content).__name__}")


# -- tool calls and results --------------------------------------------------------------


@dataclass(frozen=True)
class ToolRendering:
    """How a template shows tool calls and results: ``format``, whether it has a tool role,
    and the prompted ``block`` to add to the system message (None: none)."""

    format: str
    tool_role: bool = True
    block: str | None = None


def short_id(call_id: str) -> str:
    """A 9-character alphanumeric id (Mistral templates require them): ``call_id`` itself
    when it is one, else a hash of it."""
    if re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    return hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:9]


def _render_id(call_id: str | None, rendering: ToolRendering) -> str:
    cid = call_id or ""
    return short_id(cid) if tool_call_format(rendering.format).short_ids else cid


def assistant_dict(
    text: str, calls: Sequence[ToolCall], rendering: ToolRendering
) -> dict[str, Any]:
    """An assistant turn: for template formats ``{"role", "content", "tool_calls": [{"type":
    "function", "id", "function": {"name", "arguments": dict}}]}``; for the prompted one the
    calls are appended to the content as ``<tool_call>`` blocks (one per line)."""
    if not calls:
        return {"role": "assistant", "content": text}
    if not tool_call_format(rendering.format).template_tools:
        blocks = "\n".join(prompted_call_text(c["name"], c["args"]) for c in calls)
        return {"role": "assistant", "content": f"{text}\n{blocks}" if text else blocks}
    rendered = [
        {
            "type": "function",
            "id": _render_id(c.get("id"), rendering),
            "function": {"name": c["name"], "arguments": dict(c["args"])},
        }
        for c in calls
    ]
    return {"role": "assistant", "content": text, "tool_calls": rendered}


def tool_result_dict(
    message: ToolMessage, text: str, rendering: ToolRendering, name: str | None
) -> dict[str, Any]:
    """A tool result: ``{"role": "tool", "content", "tool_call_id", "name"}``, or for the
    prompted format on a template without a tool role a user message
    ``<tool_response>\\n{content}\\n</tool_response>``."""
    prompted = not tool_call_format(rendering.format).template_tools
    if prompted and not rendering.tool_role:
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    out: dict[str, Any] = {
        "role": "tool",
        "content": text,
        "tool_call_id": _render_id(message.tool_call_id, rendering),
    }
    if name:
        out["name"] = name
    return out


def add_tool_block(dicts: list[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    """``dicts`` with ``block`` after the first system message's text (blank line between),
    or in a new system message first when there is none."""
    if dicts and dicts[0]["role"] == "system":
        first = dict(dicts[0])
        first["content"] = f"{first['content']}\n\n{block}" if first["content"] else block
        return [first, *dicts[1:]]
    return [{"role": "system", "content": block}, *dicts]


def chat_dicts(
    messages: Sequence[BaseMessage],
    system_prompt: str | None = None,
    tools: ToolRendering | None = None,
) -> list[dict[str, Any]]:
    """``[{"role", "content"}]`` for the chat template; ``system_prompt`` is prepended when
    the conversation has no system message first. Raises InvalidInputError on an empty
    conversation or one whose messages are all blank.

    With ``tools`` (:class:`ToolRendering`), AI messages with ``tool_calls`` and
    ``ToolMessage`` results are written the template's way (:func:`assistant_dict`,
    :func:`tool_result_dict`) and the prompted tool block, if any, is added to the system
    message (:func:`add_tool_block`). Without tool calls, tool messages or a block the
    dicts are the plain ``{"role", "content"}`` ones, whatever ``tools`` is."""
    if not messages:
        raise InvalidInputError("messages is empty; pass at least one message")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id -> tool name, for tool results
    for m in messages:
        text = message_text(m)
        if tools is not None and isinstance(m, AIMessage) and m.tool_calls:
            names.update({str(c.get("id")): c["name"] for c in m.tool_calls})
            out.append(assistant_dict(text, m.tool_calls, tools))
            continue
        if tools is not None and isinstance(m, ToolMessage):
            name = m.name or names.get(m.tool_call_id)
            out.append(tool_result_dict(m, text, tools, name))
            continue
        out.append({"role": _role(m), "content": text})
    if all(not str(d["content"]).strip() and not d.get("tool_calls") for d in out):
        raise InvalidInputError("the prompt is empty (all message contents are blank)")
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    if tools is not None and tools.block:
        out = add_tool_block(out, tools.block)
    return out


def _role(message: BaseMessage) -> str:
    """The chat-template role of a message."""
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, ToolMessage):
        return "tool"
    return getattr(message, "role", None) or "user"


@dataclass(frozen=True)
class PlainTemplate:
    """The prompt of a model without a chat template (a base model such as GPT-2 or
    Gemma-3 270M): each turn ``{role}: {content}`` on its own line, then ``assistant:``.
    Generation stops where the model opens a next turn (:attr:`turn_markers`; a base model
    otherwise goes on with ``"\nuser: ..."``). Its :attr:`text` is hashed into the
    generation record in place of a chat template's, so a guard refuses another one."""

    name: str = "plain"
    turn: str = "{role}: {content}\n"
    generation_prompt: str = "assistant:"
    roles: tuple[str, ...] = ("system", "user", "assistant", "tool")

    def render(self, dicts: Sequence[dict[str, Any]]) -> str:
        """The prompt text of the conversation ``dicts`` (``[{"role", "content"}]``)."""
        turns = (self.turn.format(role=d["role"], content=d["content"]) for d in dicts)
        return "".join(turns) + self.generation_prompt

    @property
    def turn_markers(self) -> tuple[str, ...]:
        """Where a next turn opens: a new line starting with a role and its colon."""
        return tuple(f"\n{role}:" for role in self.roles)

    @property
    def text(self) -> str:
        """The template as recorded (hashed): its name, turn, generation prompt and roles."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


PLAIN_TEMPLATE = PlainTemplate()
"""The template of every model whose tokenizer has no chat template."""


def prompt_ids(
    tokenizer: Any, dicts: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Token ids of the prompt: the chat template with the generation prompt (and
    ``tools=`` when given: OpenAI-format schemas), or :data:`PLAIN_TEMPLATE` for tokenizers
    without one (tools are then never passed)."""
    if getattr(tokenizer, "chat_template", None):
        extra = {} if tools is None else {"tools": tools}
        try:
            enc = tokenizer.apply_chat_template(
                dicts, add_generation_prompt=True, tokenize=True, return_dict=True, **extra
            )
        except Exception as exc:
            raise InvalidInputError(f"the chat template rejected the messages: {exc}") from exc
        return [int(t) for t in enc["input_ids"]]
    return [int(t) for t in tokenizer(PLAIN_TEMPLATE.render(dicts))["input_ids"]]


#: Contents of the first user turn in the two renderings whose common prefix is the head.
_SENTINELS = ("A", "B")


@functools.lru_cache(maxsize=64)
def _head(tokenizer: Any, lead_json: str, tools_json: str) -> tuple[int, ...]:
    lead = json.loads(lead_json)
    tools = json.loads(tools_json)
    a, b = (
        prompt_ids(tokenizer, [*lead, {"role": "user", "content": s}], tools) for s in _SENTINELS
    )
    return tuple(a[: common_prefix(a, b)])


def prompt_head(
    tokenizer: Any, dicts: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[int, ...]:
    """The ids every prompt with the same leading system turn(s) (``dicts``: the chat
    template's dicts) and ``tools`` starts with: the template rendered up to the content of
    the first user turn (the common prefix of two renderings that differ only there)."""
    lead = list(itertools.takewhile(lambda d: d.get("role") == "system", dicts))
    return _head(
        tokenizer, json.dumps(lead, sort_keys=True, default=str), json.dumps(tools, default=str)
    )


def response_ids(tokenizer: Any, response: AnswerLike) -> list[int]:
    """Token ids of a response: a text is tokenized without special tokens, token ids are
    used as they are. Raises InvalidInputError for anything else."""
    if isinstance(response, str):
        return [int(t) for t in tokenizer(response, add_special_tokens=False)["input_ids"]]
    if isinstance(response, Sequence) and all(isinstance(t, (int, np.integer)) for t in response):
        return [int(t) for t in response]
    raise InvalidInputError(
        f"response must be a string or a sequence of token ids, got {type(response).__name__}"
    )


def left_padded(
    sequences: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[B, S]`` (long), sequences aligned right."""
    b = len(sequences)
    s = max(len(x) for x in sequences)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    mask = torch.zeros((b, s), dtype=torch.long)
    for i, x in enumerate(sequences):
        ids[i, s - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, s - len(x) :] = 1
    return ids, mask
