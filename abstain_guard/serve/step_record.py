"""The server's own record of the step decisions it issued (step gating of agent runs).

With step gating (``AgentRecord.gating == "steps"``, :mod:`abstain_guard.agent_steps`) every
model call of a run is decided on the run's running maximum of step scores. Over HTTP a run
is a sequence of requests: the client sends the question, gets a tool call, runs it and sends
the conversation back with the result. The earlier steps' scores must come from the server —
a score a client sends could be anything — so the server keeps each answered tool-calling
step's decision in a :class:`StepRecord`, keyed by the tool calls it returned **and the run
up to them** (:func:`step_key`: the question, earlier turns, earlier steps and tool results,
the call's text, ids, names and arguments). A client that edits or invents a call, or
replays one in another conversation, finds no record.

The record is bounded: at most ``max_entries`` (least recently used dropped first), each
kept ``ttl_s`` seconds. It lives in the server process: a restart forgets it, and replicas
behind a load balancer do not share it. What a request whose earlier steps have no record
gets is :mod:`abstain_guard.serve.step_gate`'s business (fail closed: an abstention).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from abstain_guard.serve.conversation import openai_tool_calls

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_TTL_S",
    "StepEntry",
    "StepRecord",
    "context_digest",
    "step_key",
]

#: Step decisions kept at most (least recently used dropped first).
DEFAULT_MAX_ENTRIES = 100_000
#: How long a step decision is kept, in seconds.
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StepEntry:
    """One answered tool-calling step the server returned.

    Attributes:
        step: the model call's position in the run (0-based).
        step_score: the scorer's score of that call.
        run_statistic: the run's running maximum after it.
    """

    step: int
    step_score: float
    run_statistic: float


def _text(message: BaseMessage) -> str:
    content = message.content
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True)


def _calls(message: AIMessage) -> list[list[Any]]:
    """The tool calls as the client gets them back (:func:`openai_tool_calls`: the returned
    ids), arguments in one canonical JSON."""
    out = []
    for call in openai_tool_calls(message):
        args = json.loads(call["function"]["arguments"])
        out.append([call["id"], call["function"]["name"], json.dumps(args, sort_keys=True)])
    return out


def _signature(message: BaseMessage) -> list[Any]:
    """What a message contributes to a key: its role, text, and tool calls or call id (a
    tool result's ``name`` is left out: clients send it or not)."""
    if isinstance(message, AIMessage):
        return ["assistant", _text(message), _calls(message)]
    if isinstance(message, ToolMessage):
        return ["tool", str(message.tool_call_id), _text(message)]
    if isinstance(message, HumanMessage):
        return ["user", _text(message)]
    return [message.type, _text(message)]


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False).encode("utf-8")).hexdigest()


def context_digest(
    question: str, history: Sequence[BaseMessage], steps: Sequence[BaseMessage]
) -> str:
    """A digest of a run's context before a model call: the earlier turns, the question and
    the steps (tool calls and results) after it."""
    return _sha256([[_signature(m) for m in history], question, [_signature(m) for m in steps]])


def step_key(context: str, message: AIMessage) -> str:
    """The key of the tool-calling ``message`` made in ``context`` (:func:`context_digest`)."""
    return _sha256([context, _signature(message)])


class StepRecord:
    """A bounded, thread-safe map from :func:`step_key` to :class:`StepEntry`: LRU with a
    size cap and a time to live.

    Args:
        max_entries: the most entries kept (the least recently used go first).
        ttl_s: seconds an entry is kept after it was stored.
        clock: the time source (monotonic seconds; tests pass their own).

    Raises:
        ValueError: ``max_entries < 1`` or ``ttl_s <= 0``.
    """

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1 or not ttl_s > 0:
            raise ValueError(
                f"a step record needs max_entries >= 1 and ttl_s > 0 (got {max_entries}, {ttl_s})"
            )
        self.max_entries = max_entries
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, StepEntry]] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, key: str, entry: StepEntry) -> None:
        """Keep ``entry`` under ``key`` (the newest), dropping the oldest over the cap."""
        with self._lock:
            now = self._clock()
            self._entries[key] = (now, entry)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evicted += 1
            while self._entries:  # the least recently used first: drop those expired
                oldest = next(iter(self._entries.values()))[0]
                if now - oldest <= self.ttl_s:
                    break
                self._entries.popitem(last=False)
                self.expired += 1

    def get(self, key: str) -> StepEntry | None:
        """The entry under ``key``, or None (never stored, evicted, or older than ``ttl_s``:
        then dropped)."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            stored, entry = found
            if self._clock() - stored > self.ttl_s:
                del self._entries[key]
                self.expired += 1
                return None
            self._entries.move_to_end(key)
            return entry

    def describe(self) -> dict[str, Any]:
        """Size, limits and how many entries were evicted or expired (``/healthz``)."""
        with self._lock:
            size = len(self._entries)
        return {
            "entries": size,
            "max_entries": self.max_entries,
            "ttl_s": self.ttl_s,
            "evicted": self.evicted,
            "expired": self.expired,
        }
