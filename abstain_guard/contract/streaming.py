"""Certified streaming: the chunk rule, the stream statistic and the prefix channel.

The **chunk rule** (:class:`ChunkRule`: ``"tokens:k"``, ``"sentence"``, ``"clause"``) says
after which generated tokens the answer so far is scored; it reads only the token ids, so
the live stream and calibration find the same chunk ends. The answers streamed to the end
are exactly those whose **stream statistic** ``M`` (:func:`stream_statistic`: the maximum
of the prefix scores and the whole answer's) is ``<= τ``; a stream shows text and is then
stopped when ``F <= τ < M`` (:func:`first_release_statistic`). While a guard streams it opens
a :class:`PrefixSink` (:func:`open_prefix_sink`) where an engine that scores prefixes puts
each chunk end's message. docs/guarantees.md, "While it streams: chunk by chunk".
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from abstain_guard.errors import ConfigError

ChunkKind = Literal["tokens", "sentence", "clause"]
CHUNK_KINDS: tuple[ChunkKind, ...] = ("tokens", "sentence", "clause")
#: Characters whose appearance in a token's text ends a sentence (``"sentence"`` rule).
SENTENCE_MARKS = frozenset(".!?\n")
#: ... or a clause (``"clause"`` rule).
CLAUSE_MARKS = SENTENCE_MARKS | frozenset(",;:")

_RULE = re.compile(r"^(?:(?P<kind>sentence|clause)|tokens:(?P<k>[0-9]+))$")

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True)
class ChunkRule:
    """Where a streamed answer is scored: after every ``every`` tokens (``kind="tokens"``),
    or after each token whose new text holds a sentence (clause) mark."""

    kind: ChunkKind
    every: int = 0

    def __post_init__(self) -> None:
        if self.kind not in CHUNK_KINDS:
            raise ConfigError(f"chunk rule kind must be one of {CHUNK_KINDS}, got {self.kind!r}")
        if (self.kind == "tokens") != (self.every >= 1):
            raise ConfigError(
                "a 'tokens' chunk rule needs every >= 1 (e.g. 'tokens:8'); 'sentence' and "
                f"'clause' take none (got kind={self.kind!r}, every={self.every})"
            )

    @classmethod
    def parse(cls, text: str | ChunkRule) -> ChunkRule:
        """``"tokens:8"``, ``"sentence"`` or ``"clause"`` (or a rule, returned as is).

        Raises:
            ConfigError: anything else.
        """
        if isinstance(text, ChunkRule):
            return text
        match = _RULE.match(str(text).strip())
        if match is None:
            raise ConfigError(
                f"chunk rule {text!r} is not one of 'tokens:K' (K >= 1), 'sentence', 'clause'"
            )
        if match.group("k") is not None:
            return cls("tokens", int(match.group("k")))
        kind: ChunkKind = "sentence" if match.group("kind") == "sentence" else "clause"
        return cls(kind)

    def __str__(self) -> str:
        return f"tokens:{self.every}" if self.kind == "tokens" else self.kind

    def ends_at(self, token_ids: Sequence[int], decode: Decode) -> bool:
        """Whether a chunk ends after the last of ``token_ids`` (the answer so far, ``[t]``,
        ``t >= 1``); ``decode`` turns ids into the answer's text (special tokens skipped)."""
        t = len(token_ids)
        if t == 0:
            return False
        if self.kind == "tokens":
            return t % self.every == 0
        before = decode(token_ids[:-1]) if t > 1 else ""
        text = decode(token_ids)
        new = text[len(before) :] if text.startswith(before) else text[-1:]
        marks = SENTENCE_MARKS if self.kind == "sentence" else CLAUSE_MARKS
        return any(ch in marks for ch in new)

    def interior_ends(self, token_ids: Sequence[int], decode: Decode) -> list[int]:
        """The chunk ends ``t`` with ``1 <= t < n`` of a whole answer ``[n]`` (the last
        chunk, the whole answer, is always decided)."""
        if self.kind == "tokens":
            return list(range(self.every, len(token_ids), self.every))
        return [t for t in range(1, len(token_ids)) if self.ends_at(token_ids[:t], decode)]


def stream_statistic(prefix_scores: Sequence[float], final_score: float) -> float:
    """``M``: the largest of the interior prefix scores ``[m]`` and the whole answer's."""
    return max([float(final_score), *(float(s) for s in prefix_scores)])


def first_release_statistic(prefix_scores: Sequence[float]) -> float:
    """``F``: the first interior chunk's score (text is shown at τ iff ``F <= τ``); ``+inf``
    for an answer without interior chunk ends (nothing is shown before its decision)."""
    return float(prefix_scores[0]) if len(prefix_scores) else math.inf


@dataclass
class StreamPrefix:
    """One chunk end of a live stream: ``tokens`` generated so far and ``message`` (what the
    chat model would return had it stopped after those tokens)."""

    tokens: int
    message: Any


@dataclass
class PrefixSink:
    """Where a chat model puts a live stream's chunk ends (``rule``: the artifact's)."""

    rule: ChunkRule
    prefixes: list[StreamPrefix] = field(default_factory=list)
    #: set by the chat model when it serves this stream's prefixes (else the stream cannot
    #: be certified and the guard buffers or refuses)
    served: bool = False

    def put(self, prefix: StreamPrefix) -> None:
        self.prefixes.append(prefix)

    def take(self) -> list[StreamPrefix]:
        """The chunk ends put since the last call."""
        out, self.prefixes = self.prefixes, []
        return out


_SINK: contextvars.ContextVar[PrefixSink | None] = contextvars.ContextVar(
    "abstain_guard_prefix_sink", default=None
)


def active_prefix_sink() -> PrefixSink | None:
    """The sink of the stream being generated in this context (None: not a certified
    stream); read by the chat model when its stream starts."""
    return _SINK.get()


@contextlib.contextmanager
def open_prefix_sink(rule: ChunkRule) -> Iterator[PrefixSink]:
    """Open a sink for ``rule`` in this context for the duration of the block."""
    sink = PrefixSink(rule)
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        # An async stream closed by the event loop's finaliser (a client that disconnected)
        # runs this in another context, where the sink was never set: nothing to reset there.
        with contextlib.suppress(ValueError):
            _SINK.reset(token)
