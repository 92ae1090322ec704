"""Decisions handed to the monitor in the order their requests were admitted, not the order
they finished (a short answer overtakes a long one, and length goes with the score).

The server numbers each request when it admits it (:meth:`ArrivalOrder.admit`) and ends it
exactly once (:meth:`ArrivalOrder.finish`): with its decision, which is journaled before
``finish`` returns and fed once every request admitted before it has ended, or with none (a
tool call, a refusal, an error, a client that went away), which gives up its place. Feedback
on a held decision waits (:meth:`ArrivalOrder.wait_fed`). docs/serving.md, "The drift
monitor, feedback and the API key".
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from abstain_guard.errors import DecisionJournalError
from abstain_guard.guarantee.decision import Decision
from abstain_guard.serve.journal import DecisionJournal, FeedHealth

logger = logging.getLogger("abstain_guard.serve")

#: What receives each decision, in admission order: ``feed(decision, run_id)``.
Feed = Callable[[Decision, str], Any]


@dataclass(frozen=True)
class _Outcome:
    """How one admitted request ended: its decision and id, or nothing to feed."""

    run_id: str | None = None
    decision: Decision | None = None


class ArrivalOrder:
    """Feeds decisions to ``feed`` in the order their requests were admitted.

    :meth:`finish` and :meth:`wait_fed` run on the server's event loop (the waits are
    asyncio events); the counters are locked, and decisions are fed one call at a time.

    Args:
        feed: called with ``(decision, run_id)`` for each decision, in admission order
            (an exception it raises is a :class:`FeedHealth` alarm; the decisions after it
            are still fed).
        journal: where each decision is written before :meth:`finish` returns (default: one
            in memory, nothing durable).
        health: where failed writes are counted (default: a new one, :attr:`health`).
    """

    def __init__(
        self,
        feed: Feed,
        journal: DecisionJournal | None = None,
        health: FeedHealth | None = None,
    ) -> None:
        self._feed = feed
        self.journal = journal if journal is not None else DecisionJournal(None)
        self.health = health if health is not None else FeedHealth()
        self._lock = threading.Lock()
        self._feeding = threading.Lock()  # held while taking outcomes off and feeding them
        self._issued = 0  # tickets handed out: the next one is this number
        self._next = 0  # the earliest ticket not yet passed on
        self._ended: dict[int, _Outcome] = {}  # tickets that ended out of turn
        self._held: dict[str, asyncio.Event] = {}  # run ids ended but not yet fed

    def admit(self) -> int:
        """The next number in admission order (call when the request is admitted)."""
        with self._lock:
            ticket = self._issued
            self._issued += 1
            return ticket

    def describe_health(self) -> dict[str, Any]:
        """:meth:`FeedHealth.describe` and whether the journal is durable (``/readyz``'s
        ``monitor``)."""
        return {**self.health.describe(), "journal": self.journal.durable}

    @property
    def waiting(self) -> int:
        """Requests that ended but wait for an earlier one before being passed on."""
        with self._lock:
            return len(self._ended)

    def finish(
        self, ticket: int, run_id: str | None = None, decision: Decision | None = None
    ) -> None:
        """End request ``ticket``: with ``decision`` under ``run_id``, or (either None) with
        nothing to feed. Only the first call per ticket counts, so a handler may call it
        again in its ``finally`` to release a place it did not fill. A decision is in the
        journal when this returns.

        Raises:
            DecisionJournalError: the decision could not be journaled (its place is given
                up; do not acknowledge it: answer 503).
        """
        outcome = _Outcome(run_id, decision) if run_id is not None and decision else _Outcome()
        if outcome.run_id is not None and outcome.decision is not None and self._open(ticket):
            self._hold(outcome.run_id, outcome.decision, ticket)
        with self._feeding:
            with self._lock:
                if ticket < self._next or ticket >= self._issued or ticket in self._ended:
                    return
                self._ended[ticket] = outcome
                if outcome.run_id is not None and ticket != self._next:
                    self._held[outcome.run_id] = asyncio.Event()
                ready = self._pop_ready()
            self._pass_on(ready)

    def _open(self, ticket: int) -> bool:
        """Whether ``ticket`` was handed out and has not ended."""
        with self._lock:
            return self._next <= ticket < self._issued and ticket not in self._ended

    def _hold(self, run_id: str, decision: Decision, ticket: int | None) -> None:
        """Journal ``decision``; on failure count it, give up ``ticket``'s place, raise."""
        try:
            self.journal.hold(run_id, decision, ticket)
        except DecisionJournalError as exc:
            self.health.failed("journal", run_id, exc)
            if ticket is not None:
                self.finish(ticket)
            raise

    def feed_now(self, run_id: str, decision: Decision) -> None:
        """Journal and feed a decision without a place in the order (its place was taken
        before a restart of this process).

        Raises:
            DecisionJournalError: as :meth:`finish`.
        """
        self._hold(run_id, decision, None)
        with self._feeding:
            self._pass_on([_Outcome(run_id, decision)])

    def _pop_ready(self) -> list[_Outcome]:
        """The outcomes now in turn, taken off (call holding the lock)."""
        ready = []
        while self._next in self._ended:
            ready.append(self._ended.pop(self._next))
            self._next += 1
        return ready

    def _pass_on(self, ready: list[_Outcome]) -> None:
        """Feed ``ready``'s decisions in order (outside the counters' lock: the feed may
        take its own)."""
        for outcome in ready:
            if outcome.run_id is None or outcome.decision is None:
                continue
            self._feed_one(outcome.run_id, outcome.decision)
            with self._lock:
                event = self._held.pop(outcome.run_id, None)
            if event is not None:
                event.set()

    def _feed_one(self, run_id: str, decision: Decision) -> None:
        """Feed one decision and mark it in the journal; a failure is an alarm (the decision
        stays in the journal), never a stop for the decisions after it."""
        try:
            self._feed(decision, run_id)
        except Exception as exc:  # the monitor log's write, or the monitor refused it
            self.health.failed("monitor log", run_id, exc)
            return
        try:
            self.journal.fed(run_id)
        except DecisionJournalError as exc:
            self.health.failed("journal", run_id, exc)

    async def wait_fed(self, run_id: str) -> None:
        """Return once ``run_id``'s decision has been fed (at once for an id not held)."""
        with self._lock:
            event = self._held.get(run_id)
        if event is not None:
            await event.wait()
