"""Certified streaming of one answer: release text chunk by chunk while the running maximum
of the prefix scores stays under τ (:mod:`abstain_guard.contract.streaming`).

:func:`certified_stream` / :func:`acertified_stream` drive a runnable's stream through a
:class:`StreamGate` under a prefix sink and yield :class:`GateEvent` s: ``text``, then one
``decision``. Each chunk end is decided by :meth:`AbstentionPolicy.decide` with ``step``, so
an unscorable prefix abstains (fail closed); the decision records ``streaming``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessageChunk
from langchain_core.messages.utils import message_chunk_to_message

from abstain_guard.backends import scorer_needs
from abstain_guard.contract.streaming import ChunkRule, PrefixSink, StreamPrefix, open_prefix_sink
from abstain_guard.errors import ArtifactMismatchError, ContextLengthError, ScoringError
from abstain_guard.guarantee.decision import Decision
from abstain_guard.guard.policy import AbstentionPolicy, with_decision

NOT_SERVED = (
    "the chat model did not serve the answer's prefixes (certified streaming needs the "
    "project's engine, GeometryChatModel, without tools bound): the guard calibrated with "
    "a chunk rule cannot decide without them"
)


def check_streamable(kind: str, chat_models: Sequence[Any]) -> None:
    """Refuse a certified stream that cannot be decided chunk by chunk: a scorer that needs
    extra model passes per answer (samples, a re-forward), or a chat model that does not
    serve prefixes (only the project's engine does).

    Raises:
        ArtifactMismatchError: naming what to use instead.
    """
    if "model" in scorer_needs(kind):
        raise ArtifactMismatchError(
            f"scorer {kind!r} needs extra model passes for each answer (samples or a "
            "re-forward), which a stream's prefixes cannot get while it is generated: "
            "certified streaming takes the likelihood, probe, geometry and type-floor "
            "scorers (e.g. probe_mid, likelihood_probe, perplexity)"
        )
    others = [type(m).__name__ for m in chat_models if not getattr(m, "serves_prefixes", False)]
    if others or not chat_models:
        raise ArtifactMismatchError(
            f"certified streaming needs chat models that serve the answer's prefixes while "
            f"generating (GeometryChatModel, abstain_guard.adapters); got {others or 'none'}. "
            "Use an artifact calibrated without chunk_rule for other models."
        )


@dataclass
class GateEvent:
    """What a certified stream yields: released ``text``, or at the end the ``decision``
    (``message``: the answer or the abstention, as ``invoke`` returns it)."""

    kind: Literal["text", "decision"]
    text: str = ""
    message: AIMessage | None = None
    decision: Decision | None = None


@dataclass
class StreamGate:
    """The decision state of one certified stream (module docstring)."""

    policy: AbstentionPolicy
    rule: ChunkRule
    group: str | None = None
    running: float | None = None
    chunks: int = 0
    released: str = ""
    pending: str = ""
    stopped: Decision | None = None
    _whole: BaseMessageChunk | None = field(default=None, repr=False)

    def take(self, chunk: Any) -> None:
        """Add one chunk of the wrapped runnable's stream (its text is held until a chunk
        end passes)."""
        if not isinstance(chunk, BaseMessageChunk):
            raise ScoringError(
                f"the wrapped runnable streamed {type(chunk).__name__}, not message chunks; "
                "put the guard right after the chat model"
            )
        self._whole = chunk if self._whole is None else self._whole + chunk
        if isinstance(chunk.content, str):
            self.pending += chunk.content

    def chunk_end(self, prefix: StreamPrefix) -> str | None:
        """Decide the answer so far; the text to release (maybe ``""``), or None when the
        stream stops here (:attr:`stopped` holds the decision)."""
        _, decision = self.policy.decide(
            prefix.message, group=self.group, step=self.chunks, previous=self.running
        )
        self.chunks += 1
        self.running = decision.run_statistic
        if decision.abstained:
            self.stopped = self._finish(decision, prefix.tokens)
            return None
        out, self.pending = self.pending, ""
        self.released += out
        return out

    def stop_message(self) -> AIMessage:
        """The abstention for a stream stopped at a chunk end."""
        assert self.stopped is not None
        withheld = self.message()
        return self.policy.abstention_message(withheld, self.stopped)

    def message(self) -> AIMessage | None:
        """The wrapped runnable's message so far (all chunks added)."""
        if self._whole is None:
            return None
        msg = message_chunk_to_message(self._whole)
        return msg if isinstance(msg, AIMessage) else None

    def final(self, served: bool) -> tuple[AIMessage, Decision, str]:
        """The whole answer's decision on the running maximum: ``(message, decision, text
        still to release)`` (the text is ``""`` for an abstention)."""
        whole = self.message()
        if not served:  # fail closed: the stream could not be decided chunk by chunk
            msg, decision = self.policy.abstain(
                "scoring failed", f"ScoringError: {NOT_SERVED}", self.group
            )
            decision = decision.replace(streaming=self._block(None, False))
            return with_decision(msg, decision), decision, ""
        msg, decision = self.policy.decide(
            whole, group=self.group, step=self.chunks, previous=self.running
        )
        self.chunks += 1
        decision = self._finish(decision, None)
        msg = with_decision(msg, decision)
        if decision.abstained:
            return msg, decision, ""
        rest, self.pending = self.pending, ""
        self.released += rest
        return msg, decision, rest

    def _finish(self, decision: Decision, tokens: int | None) -> Decision:
        return decision.replace(streaming=self._block(tokens, decision.abstained))

    def _block(self, tokens: int | None, abstained: bool) -> dict[str, Any]:
        return {
            "chunk_rule": str(self.rule),
            "chunks_decided": self.chunks,
            "stopped_at_tokens": tokens,
            "released_chars": len(self.released),
            "partial_release": bool(abstained and self.released),
        }


def _events_of(gate: StreamGate, sink: PrefixSink, chunk: Any) -> tuple[list[GateEvent], bool]:
    """What one chunk of the wrapped stream gives: the text released at the chunk ends the
    engine put into ``sink`` with it, and whether the stream stopped (the last event is then
    the abstention)."""
    gate.take(chunk)
    events = []
    for prefix in sink.take():
        out = gate.chunk_end(prefix)
        if out is None:
            events.append(_stop_event(gate))
            return events, True
        if out:
            events.append(GateEvent("text", text=out))
    return events, False


def certified_stream(
    policy: AbstentionPolicy,
    rule: ChunkRule,
    stream: Any,
    group: str | None = None,
) -> Iterator[GateEvent]:
    """Drive ``stream`` (a zero-argument callable returning the wrapped runnable's chunk
    iterator, called with the prefix sink open) through a :class:`StreamGate`; yields the
    released text as it passes, then the decision. A stop closes the wrapped stream (the
    engine stops generating); an input too long for the model's context is decided by
    :meth:`AbstentionPolicy.decide_unanswerable`."""
    gate = StreamGate(policy, rule, group)
    try:
        with open_prefix_sink(rule) as sink, contextlib.closing(iter(stream())) as chunks:
            for chunk in chunks:
                events, stopped = _events_of(gate, sink, chunk)
                yield from events
                if stopped:
                    return
    except ContextLengthError as exc:
        yield _unanswerable_event(gate, exc)
        return
    yield _final_event(gate, sink.served)


async def acertified_stream(
    policy: AbstentionPolicy,
    rule: ChunkRule,
    stream: Any,
    group: str | None = None,
) -> AsyncIterator[GateEvent]:
    """:func:`certified_stream` for an async chunk iterator (``stream()`` returns one)."""
    gate = StreamGate(policy, rule, group)
    try:
        with open_prefix_sink(rule) as sink:
            chunks = stream()
            try:
                async for chunk in chunks:
                    events, stopped = _events_of(gate, sink, chunk)
                    for event in events:
                        yield event
                    if stopped:
                        return
            finally:
                await chunks.aclose()
    except ContextLengthError as exc:
        yield _unanswerable_event(gate, exc)
        return
    yield _final_event(gate, sink.served)


def _stop_event(gate: StreamGate) -> GateEvent:
    assert gate.stopped is not None
    return GateEvent("decision", message=gate.stop_message(), decision=gate.stopped)


def _unanswerable_event(gate: StreamGate, exc: ContextLengthError) -> GateEvent:
    msg, decision = gate.policy.decide_unanswerable(exc, gate.group)
    return GateEvent("decision", message=msg, decision=decision)


def _final_event(gate: StreamGate, served: bool) -> GateEvent:
    msg, decision, rest = gate.final(served)
    return GateEvent("decision", text=rest, message=msg, decision=decision)


def as_chunks(event: GateEvent) -> list[AIMessageChunk]:
    """The guard's output chunks for one event: the released text; for the decision the
    rest of the answer (or the abstention message) with the decided message's metadata."""
    if event.kind == "text":
        return [AIMessageChunk(content=event.text)]
    assert event.message is not None
    msg = event.message
    content = event.text if not event.decision or not event.decision.abstained else msg.content
    return [
        AIMessageChunk(
            content=content,
            id=msg.id,
            response_metadata=dict(msg.response_metadata),
            usage_metadata=msg.usage_metadata,
            chunk_position="last",
        )
    ]
