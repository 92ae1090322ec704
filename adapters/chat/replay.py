"""Teacher-forced replay of :class:`~.model.GeometryChatModel` (``replay``,
``replay_batch``): the features of an existing answer in one forward pass (:mod:`..engine.replay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from abstain_guard.errors import InvalidInputError

from ..capture.parts_rule import PartsRule
from ..capture.types import ReferenceMeans, ReplayResult
from ..engine.encoding import AnswerLike
from ..engine.replay import replay_item, replay_items
from ..model.loading import LoadedModel


class ReplayMixin:
    """``replay`` and ``replay_batch`` of the chat model."""

    if TYPE_CHECKING:  # provided by GeometryChatModel
        model_name: str
        capture_geometry: bool
        top_logprobs: int
        capture: str
        capture_parts: PartsRule | None
        replay_add_eos: bool
        _reference: ReferenceMeans | None

        @property
        def _s(self) -> LoadedModel: ...

        def _encode_chat(
            self,
            messages: Any,
            response_text: AnswerLike | None,
            tools: Sequence[Any] | None,
            tool_choice: Any,
        ) -> tuple[list[int], list[int], int | None]: ...

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

        ``response_text`` is the answer text (EOS appended when ``replay_add_eos``, as for a
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
            item = replay_item(self._s, prompt, resp, from_text, self.replay_add_eos, split)
            if cuts is not None:
                item.cuts = tuple(int(t) for t in cuts[j])
            encoded.append(item)
        return replay_items(
            self._s,
            encoded,
            model_name=self.model_name,
            reference=self._reference,
            capture_geometry=self.capture_geometry,
            top_logprobs=self.top_logprobs,
            batch_size=batch_size,
            return_states=return_states,
            progress=progress,
            capture=self.capture,
            parts=self.capture_parts,
        )


__all__ = ["ReplayMixin"]
