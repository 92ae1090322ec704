"""Streaming of :class:`~.model.GeometryChatModel` (``stream``, ``astream``): the
scheduler hands each token to a channel as it is chosen, and only text later tokens cannot
change is released (:mod:`..engine.streaming`); the last chunk carries the metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGenerationChunk

from abstain_guard.contract.streaming import PrefixSink, StreamPrefix, active_prefix_sink

from ..engine.batching import RowResult
from ..engine.generation import Generated, cut_markers
from ..engine.streaming import (
    IncrementalText,
    async_token_channel,
    last_chunk,
    reply_chunks,
    text_chunk,
    token_channel,
)
from ..tools.calls import ToolSetup
from .core import ChatCore


class ChatStreaming(ChatCore):
    """``_stream`` / ``_astream`` of the chat model (see the module docstring)."""

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """Yields the answer's text as the scheduler generates it (only text that later
        tokens cannot change: see :class:`..engine.streaming.IncrementalText`), then one last chunk
        (``chunk_position="last"``, no text) with the response_metadata (token ids, logprobs,
        geometry) and usage_metadata. The chunks add up to exactly what ``invoke`` returns.

        With tools bound, the text is held back (it may be a call) and the answer comes at
        the end: its content, then one ``tool_call_chunks`` chunk per call
        (:func:`..engine.streaming.reply_chunks`), then the last chunk."""
        opts, setup = self._settings(stop, kwargs)
        prompt, split = self._prompt(messages, setup)
        sink = self._prefix_sink(setup)
        ids, future = token_channel(self._submitter(prompt, opts, split, sink is not None))
        text = IncrementalText(self.tokenizer, cut_markers(opts)) if setup is None else None
        with contextlib.closing(ids):  # a consumer that stops reading cancels the request
            for item in ids:
                piece = self._token_piece(item, text, sink, messages, prompt, opts)
                if piece is not None:
                    chunk = text_chunk(piece)
                    if run_manager:
                        run_manager.on_llm_new_token(piece, chunk=chunk)
                    yield chunk
        msg = self._finished(messages, prompt, future.result(), opts, setup)
        for chunk in self._closing_chunks(msg, text):
            if run_manager:
                run_manager.on_llm_new_token(str(chunk.message.content), chunk=chunk)
            yield chunk
        yield last_chunk(msg)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """:meth:`_stream` for asyncio: the scheduler's worker hands each token to the event
        loop (no executor thread per call)."""
        opts, setup = self._settings(stop, kwargs)
        prompt, split = self._prompt(messages, setup)
        sink = self._prefix_sink(setup)
        ids, future = async_token_channel(self._submitter(prompt, opts, split, sink is not None))
        text = IncrementalText(self.tokenizer, cut_markers(opts)) if setup is None else None
        async with contextlib.aclosing(ids):  # a consumer that stops cancels the request
            async for item in ids:
                piece = self._token_piece(item, text, sink, messages, prompt, opts)
                if piece is not None:
                    chunk = text_chunk(piece)
                    if run_manager:
                        await run_manager.on_llm_new_token(piece, chunk=chunk)
                    yield chunk
        result = await asyncio.wrap_future(future)
        msg = self._finished(messages, prompt, result, opts, setup)
        for chunk in self._closing_chunks(msg, text):
            if run_manager:
                await run_manager.on_llm_new_token(str(chunk.message.content), chunk=chunk)
            yield chunk
        yield last_chunk(msg)

    @staticmethod
    def _prefix_sink(setup: ToolSetup | None) -> PrefixSink | None:
        """The certified stream's prefix sink (:mod:`abstain_guard.contract.streaming`), marked as
        served; None without one, or with tools bound (a reply that may be a tool call is
        held back whole, so there is no text to release early)."""
        sink = active_prefix_sink()
        if sink is None or setup is not None:
            return None
        sink.served = True
        return sink

    def _token_piece(
        self,
        item: Any,
        text: IncrementalText | None,
        sink: PrefixSink | None,
        messages: Sequence[BaseMessage],
        prompt: list[int],
        opts: dict[str, Any],
    ) -> str | None:
        """The text chunk to yield for one channel item (a token id, or with a ``sink`` the
        row's :class:`..engine.batching.RowSnapshot`), None for nothing. At a chunk end of the
        sink's rule the answer so far goes into the sink first (the message ``invoke``
        would return had generation stopped there), and a chunk is always yielded (maybe
        empty), so the consumer sees the chunk end right after its text."""
        tok = item.token if sink is not None else int(item)
        piece = text.push(tok) if text is not None else ""
        if sink is not None and sink.rule.ends_at(item.token_ids, self._answer_text):
            prefix = self._finished(messages, prompt, item.result(), opts, None)
            sink.put(StreamPrefix(len(item.token_ids), prefix))
            return piece
        return piece or None

    def _answer_text(self, ids: Sequence[int]) -> str:
        """The text of generated ids as an answer's text is decoded (the chunk rules read
        it; special tokens skipped)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    @staticmethod
    def _closing_chunks(msg: AIMessage, text: IncrementalText | None) -> list[ChatGenerationChunk]:
        """The chunks after the token stream, before the metadata chunk: the text not yet
        released (``text``; without tools) or the whole reply with its tool calls."""
        if text is None:
            return reply_chunks(msg)
        rest = text.finish(str(msg.content))
        return [text_chunk(rest)] if rest else []

    def _submitter(
        self, prompt: list[int], opts: dict[str, Any], split: int | None, snapshots: bool = False
    ) -> Callable[[Callable[[Any], None]], Future[RowResult]]:
        """Queues one streamed request for ``prompt`` (as ``invoke`` would, split at
        ``split`` on the prefix path) when called with its callback: the token callback, or
        with ``snapshots`` the row-snapshot callback."""

        def submit(callback: Callable[[Any], None]) -> Future[RowResult]:
            call = self._call(opts)
            (request,) = call.requests(
                [prompt],
                int(opts["max_new_tokens"]),
                [split],
                on_tokens=[None if snapshots else callback],
                on_snapshots=[callback if snapshots else None],
            )
            (future,) = call.submit([request])
            return future

        return submit

    def _finished(
        self,
        messages: Sequence[BaseMessage],
        prompt: list[int],
        result: RowResult,
        opts: dict[str, Any],
        setup: ToolSetup | None,
    ) -> AIMessage:
        """The message ``invoke`` returns for this generated row."""
        (msg,) = self._messages([messages], [prompt], [Generated.of_row(result)], opts, setup)
        return msg
