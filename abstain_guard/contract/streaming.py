"""Certified streaming: the chunk rule, the stream statistic and the prefix channel.

A streamed answer is decided chunk by chunk while it is generated. The **chunk rule**
(:class:`ChunkRule`) says after which generated tokens the answer so far is scored: every
``k`` tokens (``"tokens:k"``), or after each token whose text ends a sentence
(``"sentence"``: ``.``, ``!``, ``?``, a newline) or a clause (``"clause"``: those and ``,``
``;`` ``:``). It reads only the token ids (decoded as the answer's text is), so the live
stream and calibration find the same chunk ends.

For an answer of ``n`` tokens with interior chunk ends ``t_1 < … < t_m < n``, the prefix
scores are ``s_j`` = the scorer's score of the answer cut after ``t_j`` tokens (what the
chat model would have returned had it stopped there), and ``s_{m+1}`` the whole answer's.
The guard keeps the running maximum and releases chunk ``j`` only while
``max(s_1..s_j) <= τ``; the first chunk that crosses τ stops the stream. So the answers
streamed to the end are exactly those whose **stream statistic**

    M = max(s_1, ..., s_{m+1})                      (:func:`stream_statistic`)

is ``<= τ`` — the anytime-stop argument of agent step gating (:mod:`abstain_guard.guarantee.
agent_steps`): calibrating τ on ``M`` certifies the error among completed streams. A stream
shows text and is then stopped exactly when ``F <= τ < M``, ``F = s_1`` the first chunk's
score (``F = +inf`` when the answer has no interior chunk end: nothing is shown before the
decision; :func:`first_release_statistic`); its rate is :mod:`abstain_guard.guarantee.
partial_release`'s.

The prefix channel: while a guard streams, it opens a :class:`PrefixSink` (a context
variable, :func:`open_prefix_sink`); a chat model that can score prefixes (the project's
engine) puts each chunk end's message into it before yielding the chunk's text.

Pure functions and small classes; shapes ``[n]`` are an answer's generated tokens.
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

__all__ = [
    "CHUNK_KINDS",
    "CLAUSE_MARKS",
    "SENTENCE_MARKS",
    "ChunkRule",
    "PrefixSink",
    "StreamPrefix",
    "active_prefix_sink",
    "first_release_statistic",
    "open_prefix_sink",
    "stream_statistic",
]

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
    """``M``: the largest of the interior prefix scores ``[m]`` and the whole answer's (the
    running maximum the guard stops on; module docstring)."""
    return max([float(final_score), *(float(s) for s in prefix_scores)])


def first_release_statistic(prefix_scores: Sequence[float]) -> float:
    """``F``: the first interior chunk's score (text is shown at τ iff ``F <= τ``); ``+inf``
    for an answer without interior chunk ends (nothing is shown before its decision)."""
    return float(prefix_scores[0]) if len(prefix_scores) else math.inf


@dataclass
class StreamPrefix:
    """One chunk end of a live stream: ``tokens`` generated so far, the text released up to
    it (``text``: what the chat model streamed up to this chunk end) and ``message`` (the
    ``AIMessage`` the chat model would return had it stopped after those tokens)."""

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
        _SINK.reset(token)
