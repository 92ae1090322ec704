"""From LangChain messages to token ids: chat roles, the chat template, left-padded batches.

The prompt ids are exactly what generation feeds the model (chat template with the
generation prompt), so replaying ``prompt_token_ids + token_ids`` reproduces a generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

from abstain_guard.errors import InvalidInputError

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


def chat_dicts(
    messages: Sequence[BaseMessage], system_prompt: str | None = None
) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` for the chat template; ``system_prompt`` is prepended when
    the conversation has no system message first. Raises InvalidInputError on an empty
    conversation or one whose messages are all blank."""
    if not messages:
        raise InvalidInputError("messages is empty; pass at least one message")
    out: list[dict[str, str]] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            role = "system"
        elif isinstance(m, HumanMessage):
            role = "user"
        elif isinstance(m, AIMessage):
            role = "assistant"
        elif isinstance(m, ToolMessage):
            role = "tool"
        else:
            role = getattr(m, "role", None) or "user"
        out.append({"role": role, "content": message_text(m)})
    if all(not d["content"].strip() for d in out):
        raise InvalidInputError("the prompt is empty (all message contents are blank)")
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def prompt_ids(tokenizer: Any, dicts: list[dict[str, str]]) -> list[int]:
    """Token ids of the prompt: the chat template with the generation prompt, or a plain
    ``role: content`` transcript ending in ``assistant:`` for tokenizers without one."""
    if getattr(tokenizer, "chat_template", None):
        try:
            enc = tokenizer.apply_chat_template(
                dicts, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except Exception as exc:
            raise InvalidInputError(f"the chat template rejected the messages: {exc}") from exc
        return [int(t) for t in enc["input_ids"]]
    # base models without a template (e.g. GPT-2): a plain transcript
    text = "".join(f"{d['role']}: {d['content']}\n" for d in dicts) + "assistant:"
    return [int(t) for t in tokenizer(text)["input_ids"]]


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


__all__ = [
    "AnswerLike",
    "chat_dicts",
    "left_padded",
    "message_text",
    "prompt_ids",
    "response_ids",
]
