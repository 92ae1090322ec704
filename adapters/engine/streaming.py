"""Token streaming: token ids, as the scheduler chooses them, turned into text pieces whose
concatenation is exactly the answer's final text (:class:`IncrementalText` releases only
text later tokens cannot change), and the channels that carry the ids from the scheduler's
worker thread to the consumer (docs/architecture.md, "Concurrent callers", Streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from concurrent.futures import Future
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.tool import ToolCallChunk, tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk

from abstain_guard.errors import ModelError

from .batching import GenerationCancelled

REPLACEMENT = "\ufffd"


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string, and whether one was found (the cut
    :func:`.generation.to_message` applies)."""
    positions = [p for p in (text.find(s) for s in stops) if p >= 0]
    if not positions:
        return text, False
    return text[: min(positions)], True


class IncrementalText:
    """The stable text of a growing token sequence (see the module docstring).

    ``push(token_id)`` returns the new text that is now final (often ``""``);
    ``finish(final_text)`` returns the rest, checking that what was released is a prefix of
    ``final_text`` (the answer's text as ``invoke`` returns it).
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._released = ""
        self._stopped = False

    @property
    def released(self) -> str:
        """The text released so far."""
        return self._released

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly stable text."""
        if self._stopped:
            return ""
        self._ids.append(int(token_id))
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        text, self._stopped = cut_at_stop(text, self._stops)
        if not self._stopped:
            # first drop what later tokens may still change (a partial character, trailing
            # spaces), then hold back the tail a stop string could begin in: a stop that
            # begins in released text then lies wholly in text already seen
            text = text.rstrip(REPLACEMENT).rstrip()
            text = text[: max(0, len(text) - self._hold)]
        return self._release(text)

    def _release(self, stable: str) -> str:
        if len(stable) <= len(self._released) or not stable.startswith(self._released):
            return ""
        piece = stable[len(self._released) :]
        self._released = stable
        return piece

    def finish(self, final_text: str) -> str:
        """The text not yet released of ``final_text``; raises ModelError when the released
        text is not a prefix of it (a tokenizer whose decoding rewrites earlier text)."""
        if not final_text.startswith(self._released):
            raise ModelError(
                "streamed text is not a prefix of the decoded answer "
                f"({self._released!r} vs {final_text!r}); this tokenizer's decoding rewrites "
                "earlier text, use invoke() instead of stream()"
            )
        piece = final_text[len(self._released) :]
        self._released = final_text
        return piece


_DONE = object()


def token_channel(
    submit: Callable[[Callable[[Any], None]], Future[Any]],
) -> tuple[Generator[Any, None, None], Future[Any]]:
    """Submit a request whose token callback feeds a thread-safe queue.

    ``submit(on_token)`` queues the request and returns its future. Returns an iterator
    over what the callback is given (the token ids as they are chosen, or the
    :class:`.batching.RowSnapshot` after each one) (it ends when the future is done: the tokens are
    all put before the result is set, in the same worker thread) and the future. Closing
    the iterator before the end (the consumer went away) cancels the request: a queued one
    never starts, a running one stops at its next token (:class:`.GenerationCancelled`).
    """
    tokens: queue.SimpleQueue[Any] = queue.SimpleQueue()
    gone = threading.Event()

    def put(tok: Any) -> None:
        if gone.is_set():
            raise GenerationCancelled
        tokens.put(tok)

    future = submit(put)
    future.add_done_callback(lambda _f: tokens.put(_DONE))

    def ids() -> Generator[Any, None, None]:
        try:
            while (tok := tokens.get()) is not _DONE:
                yield tok
        finally:
            _cancel(future, gone)

    return ids(), future


def _cancel(future: Future[Any], gone: threading.Event) -> None:
    """Stop ``future``'s request if it is not done: unqueue it, or flag the running row."""
    if not future.done() and not future.cancel():
        gone.set()


def async_token_channel(
    submit: Callable[[Callable[[Any], None]], Future[Any]],
) -> tuple[AsyncGenerator[Any, None], Future[Any]]:
    """:func:`token_channel` for a coroutine: the worker thread hands each id to the running
    event loop (``loop.call_soon_threadsafe``), so the loop never blocks on the queue."""
    loop = asyncio.get_running_loop()
    tokens: asyncio.Queue[Any] = asyncio.Queue()
    gone = threading.Event()

    def put(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: the consumer is gone
            loop.call_soon_threadsafe(tokens.put_nowait, item)

    def put_token(tok: Any) -> None:
        if gone.is_set():
            raise GenerationCancelled
        put(tok)

    future = submit(put_token)
    future.add_done_callback(lambda _f: put(_DONE))

    async def ids() -> AsyncGenerator[Any, None]:
        try:
            while (tok := await tokens.get()) is not _DONE:
                yield tok
        finally:
            _cancel(future, gone)

    return ids(), future


def text_chunk(text: str) -> ChatGenerationChunk:
    """A stream chunk carrying ``text`` only."""
    return ChatGenerationChunk(message=AIMessageChunk(content=text))


def last_chunk(msg: AIMessage) -> ChatGenerationChunk:
    """The stream's closing chunk: no text, the answer's metadata and usage."""
    return ChatGenerationChunk(
        message=AIMessageChunk(
            content="",
            response_metadata=msg.response_metadata,
            usage_metadata=msg.usage_metadata,
            chunk_position="last",
        )
    )


def tool_call_chunks(message: AIMessage) -> list[ToolCallChunk]:
    """The calls of ``message`` as stream chunks ``{"name", "args" (JSON text), "id",
    "index"}``: valid calls first (args: their JSON), then invalid ones (args: their raw
    text as a JSON string, so that summed chunks still read them as invalid)."""
    chunks = [
        tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
        for i, c in enumerate(message.tool_calls)
    ]
    start = len(chunks)
    chunks.extend(
        tool_call_chunk(
            name=c.get("name"), args=json.dumps(c.get("args")), id=c.get("id"), index=start + i
        )
        for i, c in enumerate(message.invalid_tool_calls)
    )
    return chunks


def reply_chunks(message: AIMessage) -> list[ChatGenerationChunk]:
    """The stream chunks of an answer read for tool calls: its content (if any), then one
    chunk per call (:func:`tool_call_chunks`). With the stream's last (metadata) chunk they
    add up to ``message``: the same content and ``tool_calls``; the same
    ``invalid_tool_calls`` (name, id) except that LangChain gives summed chunks no error
    and their args stay JSON-quoted (``json.loads(args)`` is the raw text)."""
    out = []
    if message.content:
        out.append(ChatGenerationChunk(message=AIMessageChunk(content=message.content)))
    out.extend(
        ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[c]))
        for c in tool_call_chunks(message)
    )
    return out
