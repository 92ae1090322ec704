"""Tool calling on the vLLM backend: prompts rendered, and replies read, by the project's own
tool code (:mod:`abstain_guard.adapters.tools`), so a tool call on vLLM is the call the exact
engine would make from the same tokens.

With tools bound, :class:`~.vllm_chat.VLLMChatModel` renders the prompt here — the chat
template with ``tools=`` (or the prompted fallback's system block), the tool-call and
tool-result turns as the exact engine renders them, a forced call's opening — sends the
token ids to the server, stops on a call's end marker when it is one token, and reads the
reply for calls (names and arguments checked against the schemas; an unreadable call is an
``invalid_tool_call``, never an exception). Needs the ``local`` extra (the tokenizer).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage


class ToolPrompter:
    """The tokenizer and tool-call format of one model folder."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        from abstain_guard.adapters.tools.formats import detect_tool_call_format

        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        template = getattr(self.tokenizer, "chat_template", None)
        self.template = template if isinstance(template, str) else None
        self.format = detect_tool_call_format(self.template)

    def prompt(
        self, messages: Sequence[BaseMessage], tools: Sequence[Any] | None, choice: Any
    ) -> tuple[list[int], Any]:
        """``(prompt ids, ToolSetup or None)`` of a call with ``tools`` bound."""
        from abstain_guard.adapters.engine.encoding import ToolRendering, chat_dicts, prompt_ids
        from abstain_guard.adapters.tools.calls import tool_setup
        from abstain_guard.adapters.tools.formats import template_has_tool_role

        setup = tool_setup(tools, choice, self.format)
        rendering = ToolRendering(
            format=setup.format if setup is not None else self.format,
            tool_role=template_has_tool_role(self.template),
            block=setup.prompt_block if setup is not None else None,
        )
        dicts = chat_dicts(messages, None, rendering)
        ids = prompt_ids(self.tokenizer, dicts, setup.template_tools if setup else None)
        if setup is not None and setup.prefill:
            prefill = self.tokenizer(setup.prefill, add_special_tokens=False)["input_ids"]
            ids.extend(int(t) for t in prefill)
        return ids, setup

    def stop_token_ids(self, setup: Any) -> list[int]:
        """The ids of ``setup``'s end markers that are one token each: the server stops on
        them (a stop *string* would end the answer after the engine moved on, without its
        capture); a marker of several tokens is cut by :meth:`read` instead."""
        if setup is None:
            return []
        ids = []
        for marker in setup.end_markers:
            encoded = self.tokenizer(marker, add_special_tokens=False)["input_ids"]
            if len(encoded) == 1:
                ids.append(int(encoded[0]))
        return ids

    def read(
        self, message: AIMessage, prompt: Sequence[int], token_ids: Sequence[int], setup: Any
    ) -> AIMessage:
        """``message`` with the calls its tokens make (as the exact engine reads them)."""
        from abstain_guard.adapters.tools.calls import decode_keeping, run_seed, with_tool_calls

        if setup is None:
            return message
        ids = self._through_end_marker(list(token_ids), setup)
        text = setup.prefill + decode_keeping(self.tokenizer, ids, setup.spec.markers)
        for marker in setup.end_markers:  # the call ends at its marker
            if marker in text:
                text = text[: text.index(marker) + len(marker)]
        return with_tool_calls(message, setup.read(text, run_seed(list(prompt), ids)))

    def _through_end_marker(self, token_ids: list[int], setup: Any) -> list[int]:
        """``token_ids`` up to the token that completes an end marker (the tokens the exact
        engine generates before it stops there): a marker of several tokens is no stop
        token, so the server generates on to EOS or the budget."""
        from abstain_guard.adapters.tools.calls import decode_keeping

        if not setup.end_markers:
            return token_ids
        for k in range(1, len(token_ids) + 1):
            text = decode_keeping(self.tokenizer, token_ids[:k], setup.spec.markers)
            if any(marker in text for marker in setup.end_markers):
                return token_ids[:k]
        return token_ids


@functools.lru_cache(maxsize=8)
def prompter_for(folder: str) -> ToolPrompter:
    """One :class:`ToolPrompter` per model folder in this process."""
    return ToolPrompter(Path(folder))
