"""Teacher-forced replay on :class:`~.model.GeometryChatModel`: the features of answers it
did not generate, or of answers it did, from one forward pass (:mod:`..engine.replay`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage

from abstain_guard.contract.metadata import GENERATION
from abstain_guard.errors import InvalidInputError

from ..capture.types import ReplayResult
from ..engine.encoding import AnswerLike, response_ids
from ..engine.replay import ReplaySettings, replay_item, replay_items
from ..model.loading import eos_token_ids
from ..tools.calls import tool_setup
from .core import ChatCore


class ChatReplay(ChatCore):
    """``replay``, ``replay_batch``, ``reread`` and ``encode_chat`` of the chat model."""

    def _encode_chat(
        self,
        messages: Any,
        response_text: AnswerLike | None,
        tools: Sequence[Any] | None,
        tool_choice: Any,
    ) -> tuple[list[int], list[int], int | None]:
        """:meth:`encode_chat`'s prompt and response ids, and the prompt's prefix split."""
        setup = tool_setup(tools, tool_choice, self.tool_call_format)
        prompt, split = self._prompt(self._to_messages(messages), setup)
        response = [] if response_text is None else response_ids(self.tokenizer, response_text)
        return prompt, response, split

    def encode_chat(
        self,
        messages: Any,
        response_text: AnswerLike | None = None,
        *,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
    ) -> tuple[list[int], list[int]]:
        """Token ids of the prompt (chat template + generation prompt, exactly what
        generation feeds, with ``tools`` / ``tool_choice`` as :meth:`bind_tools` takes them)
        and of the response (no special tokens added)."""
        prompt, response, _ = self._encode_chat(messages, response_text, tools, tool_choice)
        return prompt, response

    def replay_settings(self) -> ReplaySettings:
        """What a replay on this model computes with (:mod:`..engine.replay`)."""
        return ReplaySettings(
            model_name=self.model_name,
            reference=self._reference,
            capture_geometry=self.capture_geometry,
            top_logprobs=self.top_logprobs,
            capture=self.capture,
            parts=self.capture_parts,
        )

    def replay(
        self,
        messages: Any,
        response_text: AnswerLike,
        return_states: bool = False,
        *,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
    ) -> ReplayResult:
        """Teacher-forced features of an existing answer, in one forward pass.

        ``response_text`` is the answer text (EOS appended, as for a
        finished generation) or the exact generated token ids
        (``msg.response_metadata["token_ids"]``, used as they are). ``tools`` /
        ``tool_choice``: those the answer was generated with (they change the prompt).
        """
        return self.replay_batch(
            [(messages, response_text)],
            return_states=return_states,
            tools=tools,
            tool_choice=tool_choice,
        )[0]

    def replay_batch(
        self,
        items: Sequence[tuple[Any, AnswerLike]],
        batch_size: int = 16,
        return_states: bool = False,
        progress: bool = False,
        *,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        cuts: Sequence[Sequence[int]] | None = None,
    ) -> list[ReplayResult]:
        """:meth:`replay` for many pairs, ``batch_size`` left-padded sequences per forward;
        on the prefix path (:attr:`prefix_cache`) each pair alone, split as generation splits
        it (:mod:`..engine.prefix`). ``cuts[i]``: numbers of response tokens after which pair
        ``i``'s metadata is also returned (``ReplayResult.cuts``, same forward pass)."""
        if batch_size <= 0:
            raise InvalidInputError(f"batch_size must be positive, got {batch_size}")
        if cuts is not None and len(cuts) != len(items):
            raise InvalidInputError(f"{len(cuts)} cut lists for {len(items)} pairs")
        encoded = []
        for j, (messages, response) in enumerate(items):
            prompt, resp, split = self._encode_chat(messages, response, tools, tool_choice)
            from_text = isinstance(response, str)
            item = replay_item(self._s, prompt, resp, from_text, split)
            if cuts is not None:
                item.cuts = tuple(int(t) for t in cuts[j])
            encoded.append(item)
        settings = self.replay_settings()
        return replay_items(self._s, encoded, settings, batch_size, return_states, progress)

    def reread(
        self, messages: Any, answer: Any, stop: list[str] | None = None, **kwargs: Any
    ) -> AIMessage:
        """The message this model returns for ``messages`` had it generated ``answer`` (a
        :class:`~abstain_guard.contract.given_answer.GivenAnswer`), for checking answers it
        did not generate: the replay (one pass per answer, split as generation splits it,
        as calibration scores its answers) of the answer's token ids, or of its text
        tokenized with the end token after a finished one, and the generation record of a
        call with ``stop`` and ``kwargs``, decoded on this model's path."""
        opts, setup = self._settings(stop, kwargs)
        if setup is not None:
            raise InvalidInputError("Checking a given answer of a call with tools is unsupported.")
        conversation = self._to_messages(messages)
        response = list(answer.token_ids or [])
        if answer.token_ids is None:
            response = self._encode_chat(conversation, answer.text, None, None)[1]
            eos = eos_token_ids(self.hf_model, self.tokenizer)
            response += eos[:1] if answer.finished else []
        (replayed,) = self.replay_batch([(conversation, response)], batch_size=1)
        meta = dict(replayed.metadata)
        meta["replay_source"] = "token_ids" if answer.token_ids is not None else "text"
        meta[GENERATION] = self._generation_record(conversation, opts, None, self.decode_path())
        return AIMessage(content=answer.text, response_metadata=meta)
