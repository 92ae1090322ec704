"""The server's own record of the step decisions it issued (step gating of agent runs).

Over HTTP an agent run is a sequence of requests, and the earlier steps' scores must come
from the server, never the client: each answered tool-calling step's decision is kept in a
bounded :class:`StepRecord` (LRU, time to live), keyed by the tool calls it returned and the
run up to them (:func:`step_key`), so an edited, invented or replayed call finds no record.
One server keeps it in its process; replicas keep the deployment's in the monitor actor
(:class:`~abstain_guard.serve.monitor_actor.ActorStepRecord`); both are a
:class:`StepStore`, read into a :class:`StepSnapshot` per request. A run keeps its first
step's group (:func:`check_run_group`). docs/serving.md, "Agents: every step over HTTP".
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from abstain_guard.serve.conversation import openai_tool_calls
from abstain_guard.serve.schemas import RequestRefused

#: Step decisions kept at most (least recently used dropped first).
DEFAULT_MAX_ENTRIES = 100_000
#: How long a step decision is kept, in seconds.
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StepLimits:
    """How many step decisions a step record keeps and for how long (``serve``'s
    ``--step-record-size`` / ``--step-record-ttl``).

    Attributes:
        max_entries: the most entries kept (the least recently used go first).
        ttl_s: seconds an entry is kept after it was stored.
    """

    max_entries: int = DEFAULT_MAX_ENTRIES
    ttl_s: float = DEFAULT_TTL_S

    def record(self) -> StepRecord:
        """A step record in this process with these limits."""
        return StepRecord(self.max_entries, self.ttl_s)


@dataclass(frozen=True)
class StepEntry:
    """One answered tool-calling step the server returned.

    Attributes:
        step: the model call's position in the run (0-based).
        step_score: the scorer's score of that call.
        run_statistic: the run's running maximum after it.
        group: the run's group (``group_by``; None without one): fixed by its first step.
    """

    step: int
    step_score: float
    run_statistic: float
    group: str | None = None


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


def step_keys(
    question: str, history: Sequence[BaseMessage], steps: Sequence[BaseMessage]
) -> list[str]:
    """The keys of a run's earlier tool-calling steps (each assistant turn in ``steps``, in
    the context before it): what a request reads from the store."""
    return [
        step_key(context_digest(question, history, steps[:i]), message)
        for i, message in enumerate(steps)
        if isinstance(message, AIMessage)
    ]


class StepStore(Protocol):
    """Where step decisions are kept: the server's :class:`StepRecord`, or the deployment's
    one in the monitor actor (replicas)."""

    max_entries: int
    ttl_s: float

    async def entries(self, keys: Sequence[str]) -> dict[str, StepEntry]:
        """The entries under ``keys`` that are kept (a missing key: none)."""
        ...

    async def store(self, key: str, entry: StepEntry) -> None:
        """Keep ``entry`` under ``key``; kept when this returns."""
        ...

    def describe(self) -> dict[str, Any]:
        """Size and limits (``/readyz``)."""
        ...


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

    def get_many(self, keys: Sequence[str]) -> dict[str, StepEntry]:
        """The entries kept under ``keys`` (see :meth:`get`)."""
        found = {key: self.get(key) for key in keys}
        return {key: entry for key, entry in found.items() if entry is not None}

    async def entries(self, keys: Sequence[str]) -> dict[str, StepEntry]:
        """:meth:`get_many` (the :class:`StepStore` read)."""
        return self.get_many(keys)

    async def store(self, key: str, entry: StepEntry) -> None:
        """:meth:`put` (the :class:`StepStore` write)."""
        self.put(key, entry)

    def describe(self) -> dict[str, Any]:
        """Size, limits and how many entries were evicted or expired (``/readyz``)."""
        with self._lock:
            size = len(self._entries)
        return {
            "entries": size,
            "max_entries": self.max_entries,
            "ttl_s": self.ttl_s,
            "evicted": self.evicted,
            "expired": self.expired,
        }


class StepSnapshot:
    """One request's view of a :class:`StepStore`: the entries its run needs, read before
    deciding, and the step it answers, written back by :meth:`flush` (the synchronous
    ``get`` / ``put`` of a :class:`StepRecord`, which step gating calls).

    Args:
        store: where the entries come from and go to.
        found: the entries read for this request (:meth:`StepStore.entries`).
        group: the run's group as this request names it; every entry put is kept under it.
    """

    def __init__(
        self, store: StepStore, found: dict[str, StepEntry], group: str | None = None
    ) -> None:
        self.store = store
        self.found = dict(found)
        self.group = group
        self.max_entries = store.max_entries
        self.ttl_s = store.ttl_s
        self._new: dict[str, StepEntry] = {}

    @classmethod
    async def read(
        cls,
        store: StepStore,
        question: str,
        history: Sequence[BaseMessage],
        steps: Sequence[BaseMessage],
        group: str | None = None,
    ) -> StepSnapshot:
        """The snapshot of the entries of a run's earlier steps (:func:`step_keys`)."""
        return cls(store, await store.entries(step_keys(question, history, steps)), group)

    def get(self, key: str) -> StepEntry | None:
        """The entry read (or put by this request) under ``key``."""
        return self._new.get(key) or self.found.get(key)

    def put(self, key: str, entry: StepEntry) -> None:
        """Keep ``entry`` (under this request's group) until :meth:`flush`."""
        self._new[key] = replace(entry, group=self.group)

    async def flush(self) -> None:
        """Write the entries put to the store (before the answer leaves)."""
        for key, entry in self._new.items():
            await self.store.store(key, entry)
        self._new.clear()


def check_run_group(snapshot: StepSnapshot, group: str | None) -> None:
    """Refuse a request that continues a run under another group than its earlier steps
    were decided in (the run's rule is its first step's group's).

    Raises:
        RequestRefused: 400, ``code: group_changed_mid_run``.
    """
    started = {entry.group for entry in snapshot.found.values()}
    if started and started != {group}:
        (first, *_) = sorted(started, key=str)
        raise RequestRefused(
            f"This agent run's earlier steps were decided in group {first!r}, and this request "
            f"names group {group!r}: a run keeps its group (the threshold it is decided on). "
            "Send the same metadata as the run's first request, or ask the question again to "
            "start a new run.",
            param="metadata",
            code="group_changed_mid_run",
        )
