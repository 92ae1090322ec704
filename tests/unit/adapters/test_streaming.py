"""Real token streaming of GeometryChatModel (stream / astream / astream_events): chunks
arrive while the scheduler is still generating, add up to exactly what invoke returns, and
the last chunk carries the same metadata; the incremental decoder on byte-level BPE text
with multi-byte characters and stop strings; the guard's stream stays buffered."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessage, AIMessageChunk
from tiny_models import tiny_chat_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
from abstain_guard.adapters import GeometryChatModel
from abstain_guard.adapters.engine.scheduler import scheduler_for
from abstain_guard.adapters.engine.streaming import IncrementalText, cut_at_stop
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.errors import ModelError
from abstain_guard.scorers import PerplexityScorer

QUESTION = "hello there"


@pytest.fixture(scope="module")
def model() -> GeometryChatModel:
    return tiny_chat_model("llama", seed=0, max_new_tokens=24)


@pytest.fixture(scope="module")
def reference(model: GeometryChatModel) -> AIMessage:
    msg = model.invoke(QUESTION)
    assert len(msg.response_metadata["token_ids"]) >= 8  # long enough to stream in pieces
    return msg


def _joined(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    return total


def _check_stream(chunks: list[AIMessageChunk], ref: AIMessage) -> None:
    """The chunks add up to ``ref``: same text, the metadata only on the last chunk."""
    texts = [str(c.content) for c in chunks[:-1]]
    assert len(texts) >= 4 and all(texts)  # token pieces, not one block
    assert "".join(texts) == ref.content
    last = chunks[-1]
    assert last.chunk_position == "last" and last.content == ""
    assert last.response_metadata == ref.response_metadata
    assert last.usage_metadata == ref.usage_metadata
    assert all(not c.response_metadata for c in chunks[:-1])
    joined = _joined(chunks)
    assert joined.content == ref.content
    assert joined.response_metadata["token_ids"] == ref.response_metadata["token_ids"]
    assert joined.response_metadata["geometry"] == ref.response_metadata["geometry"]


def test_stream_adds_up_to_invoke(model: GeometryChatModel, reference: AIMessage) -> None:
    _check_stream(list(model.stream(QUESTION)), reference)


def test_astream_adds_up_to_invoke(model: GeometryChatModel, reference: AIMessage) -> None:
    async def main() -> list[AIMessageChunk]:
        return [c async for c in model.astream(QUESTION)]

    _check_stream(asyncio.run(main()), reference)


class DecodeGate:
    """A forward pre-hook on the real model: every decode step (one input token) sets
    :attr:`waiting` and waits until :attr:`opened` is set, at most ``limit`` seconds, then
    stops waiting (records :attr:`timed_out`; a stream that yields only after generation
    then fails the test instead of hanging)."""

    def __init__(self, model: GeometryChatModel, limit: float = 5.0) -> None:
        self.opened = threading.Event()
        self.waiting = threading.Event()
        self.timed_out = False
        self.limit = limit
        self._handle = model.hf_model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1 and not self.timed_out:
            self.waiting.set()
            self.timed_out = not self.opened.wait(self.limit)

    def close(self) -> None:
        self._handle.remove()


def _active_rows(model: GeometryChatModel) -> list[Any]:
    return [r for e in scheduler_for(model._s).engines for r in e.active]


@pytest.mark.parametrize("api", ["sync", "async"])
def test_first_chunk_arrives_while_the_row_is_generating(
    model: GeometryChatModel, reference: AIMessage, api: str
) -> None:
    """The worker is held in a decode step until the consumer has its first chunk: with
    real streaming that chunk arrives while the row is still active in the scheduler (one
    token chosen of the answer's N); a stream that yields after generation never does."""
    n_tokens = len(reference.response_metadata["token_ids"])
    seen: list[tuple[str, int]] = []  # (first chunk text, tokens of the active row then)
    gate = DecodeGate(model)

    def on_chunk(chunk: AIMessageChunk) -> None:
        if not seen:
            # the first token comes from the prefill; wait until the worker is in the next
            # decode step (the row is then among the scheduler's active rows)
            assert gate.waiting.wait(gate.limit)
            rows = _active_rows(model)
            seen.append((str(chunk.content), len(rows[0].ids) if len(rows) == 1 else -1))
            gate.opened.set()

    try:
        if api == "sync":
            chunks = []
            for c in model.stream(QUESTION):
                on_chunk(c)
                chunks.append(c)
        else:

            async def main() -> list[AIMessageChunk]:
                out = []
                async for c in model.astream(QUESTION):
                    on_chunk(c)
                    out.append(c)
                return out

            chunks = asyncio.run(main())
    finally:
        gate.opened.set()
        gate.close()
    assert not gate.timed_out
    (first_text, tokens_then), *_ = seen
    assert first_text and reference.content.startswith(first_text)
    assert 1 <= tokens_then < n_tokens
    _check_stream(chunks, reference)


def _cancelled_rows(model: GeometryChatModel) -> int:
    return sum(e.cancelled for e in scheduler_for(model._s).engines)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_consumer_that_stops_reading_cancels_the_generation(
    model: GeometryChatModel, reference: AIMessage, api: str
) -> None:
    """Closing the stream after its first chunk stops the row at its next token instead of
    decoding the rest of the budget for nobody; the model then answers as before."""
    before = _cancelled_rows(model)
    gate = DecodeGate(model)
    try:
        if api == "sync":
            stream = model.stream(QUESTION)
            first = next(stream)
            assert gate.waiting.wait(gate.limit)  # the worker is inside the next decode step
            stream.close()
        else:

            async def main() -> AIMessageChunk:
                stream = model.astream(QUESTION)
                chunk = await stream.__anext__()
                assert gate.waiting.wait(gate.limit)
                await stream.aclose()  # type: ignore[attr-defined]
                return chunk

            first = asyncio.run(main())
    finally:
        gate.opened.set()
        gate.close()
    assert not gate.timed_out
    assert str(first.content) and str(reference.content).startswith(str(first.content))
    deadline = time.monotonic() + 10
    while _active_rows(model) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _active_rows(model)
    assert _cancelled_rows(model) == before + 1
    assert model.invoke(QUESTION).response_metadata == reference.response_metadata


def test_astream_events_reports_each_token(model: GeometryChatModel, reference: AIMessage) -> None:
    async def main() -> list[dict[str, Any]]:
        return [e async for e in model.astream_events(QUESTION, version="v2")]

    events = asyncio.run(main())
    kinds = [e["event"] for e in events]
    assert kinds[0] == "on_chat_model_start" and kinds[-1] == "on_chat_model_end"
    streamed = [e["data"]["chunk"] for e in events if e["event"] == "on_chat_model_stream"]
    assert len(streamed) >= 4
    _check_stream(streamed, reference)
    output = events[-1]["data"]["output"]
    assert output.content == reference.content
    assert output.response_metadata["token_ids"] == reference.response_metadata["token_ids"]


def test_stream_cuts_at_a_stop_string(model: GeometryChatModel, reference: AIMessage) -> None:
    text = str(reference.content)
    stop = text[5:7]  # two characters from inside the answer
    cut = model.invoke(QUESTION, stop=[stop])
    assert cut.content == text[: text.find(stop)] and cut.response_metadata["finish_reason"]
    chunks = list(model.stream(QUESTION, stop=[stop]))
    assert "".join(str(c.content) for c in chunks) == cut.content
    assert chunks[-1].response_metadata == cut.response_metadata


def test_stream_callbacks_get_each_token(model: GeometryChatModel, reference: AIMessage) -> None:
    from langchain_core.callbacks import BaseCallbackHandler

    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            self.tokens.append(token)

    handler = Tokens()
    chunks = list(model.stream(QUESTION, config={"callbacks": [handler]}))
    assert handler.tokens == [str(c.content) for c in chunks]  # once each, the last ""
    assert "".join(handler.tokens) == reference.content


# -- the incremental decoder on real tokenizers -------------------------------------------

CORPUS = [
    "naïve café — 日本語のテキスト 😀🎉 emoji, “quotes” … Ωμέγα ñandú",
    "Привет мир! 你好，世界。 The quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def byte_bpe() -> Any:
    """A byte-level BPE tokenizer (GPT-2 / SmolLM / Llama-3 style) trained on text with
    multi-byte characters: many tokens hold part of a character."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
    )
    tk.train_from_iterator(CORPUS * 20, trainer)
    return tf.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def _stream_text(tokenizer: Any, ids: list[int], stops: list[str]) -> tuple[list[str], str]:
    """Pieces pushed, then the final text's remainder; returns (pieces, final text)."""
    final, _ = cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stops)
    inc = IncrementalText(tokenizer, stops)
    pieces = [inc.push(i) for i in ids]
    pieces.append(inc.finish(final))
    return pieces, final


def test_multibyte_characters_are_released_whole(byte_bpe: Any) -> None:
    ids = byte_bpe.encode("日本語 😀 café", add_special_tokens=False)
    single = [byte_bpe.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in single)  # some tokens hold part of a character
    pieces, final = _stream_text(byte_bpe, ids, [])
    assert final == "日本語 😀 café" and "".join(pieces) == final
    assert all("\ufffd" not in p for p in pieces)
    assert sum(bool(p) for p in pieces) >= 3


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_released_text_is_always_a_prefix_of_the_answer(byte_bpe: Any, data: Any) -> None:
    vocab = len(byte_bpe)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=30))
    text = byte_bpe.decode(ids, skip_special_tokens=True)
    stops = []
    if len(text) >= 3 and data.draw(st.booleans()):
        start = data.draw(st.integers(0, len(text) - 2))
        stops = [text[start : start + data.draw(st.integers(1, 2))]]
    pieces, final = _stream_text(byte_bpe, ids, stops)
    assert "".join(pieces) == final


def test_a_decoding_that_rewrites_earlier_text_is_an_error(byte_bpe: Any) -> None:
    inc = IncrementalText(byte_bpe)
    inc.push(byte_bpe.encode("café", add_special_tokens=False)[0])
    assert inc.released
    with pytest.raises(ModelError, match="not a prefix"):
        inc.finish("something else")


def test_the_tail_that_may_begin_a_stop_string_is_held_back(byte_bpe: Any) -> None:
    ids = byte_bpe.encode("The quick brown", add_special_tokens=False)
    inc = IncrementalText(byte_bpe, ["brown fox"])
    released = "".join(inc.push(i) for i in ids)
    assert "The quick brown".startswith(released)
    assert len(released) <= len("The quick brown") - len("brown fox") + 1


# -- the guard around a streaming model stays buffered ------------------------------------


def test_guard_stream_yields_only_the_decided_message(
    model: GeometryChatModel, reference: AIMessage
) -> None:
    """Inside astream_events the wrapped model streams its tokens (its own run's events),
    but the guard's output stream is one message, after the decision was recorded."""
    rng = np.random.default_rng(0)
    scores = rng.uniform(1.0, 3.0, size=200)
    artifact = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, rng.uniform(size=200) > (scores - 1.0) / 2.0),
        model_fingerprint=model.fingerprint,
    )
    guard = AbstentionGuard(model, artifact=artifact, config=GuardConfig(participation=0.8))
    expected = guard.invoke(QUESTION)
    chunks = list(guard.stream(QUESTION))
    assert len(chunks) == 1 and chunks[0].content == expected.content
    assert chunks[0].response_metadata["abstention"] == expected.response_metadata["abstention"]

    async def main() -> list[dict[str, Any]]:
        return [e async for e in guard.astream_events(QUESTION, version="v2")]

    events = asyncio.run(main())
    kinds = [(e["event"], e["name"]) for e in events]
    model_tokens = [i for i, (k, _) in enumerate(kinds) if k == "on_chat_model_stream"]
    decided = kinds.index(("on_custom_event", "abstention"))
    guard_stream = [
        i for i, (k, n) in enumerate(kinds) if n == "AbstentionGuard" and k.endswith("stream")
    ]
    assert len(model_tokens) >= 4 and max(model_tokens) < decided
    assert all(i > decided for i in guard_stream)  # the guard itself releases nothing before
    assert kinds[-1] == ("on_chain_end", "AbstentionGuard")
    assert events[-1]["data"]["output"].content == expected.content

    async def astream() -> list[Any]:
        return [c async for c in guard.astream(QUESTION)]

    (only,) = asyncio.run(astream())
    assert only.content == expected.content
