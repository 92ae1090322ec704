"""The prefix sink of a certified stream is open exactly while the stream runs, and closing
an async stream from another context (an event loop finalising the generator when a client
disconnects) closes it without raising."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from abstain_guard.contract.streaming import ChunkRule, active_prefix_sink, open_prefix_sink


def test_the_sink_is_active_inside_the_block_only() -> None:
    rule = ChunkRule("sentence")
    assert active_prefix_sink() is None
    with open_prefix_sink(rule) as sink:
        assert active_prefix_sink() is sink
    assert active_prefix_sink() is None


def test_an_async_stream_closed_from_another_context_closes_quietly() -> None:
    async def stream() -> AsyncIterator[object]:
        with open_prefix_sink(ChunkRule("tokens", every=4)) as sink:
            yield sink
            yield sink

    chunks = stream()
    first = asyncio.run(chunks.__anext__())  # each asyncio.run is a task in a copied context
    assert first is not None
    asyncio.run(chunks.aclose())  # the disconnect: another context closes the stream
    assert active_prefix_sink() is None
