"""Where a server's decisions go: the drift monitor, its admission order and the metrics.

The app talks to one :class:`MonitorLink`: a :class:`LocalMonitorLink` in one process, or
:class:`~abstain_guard.serve.monitor_actor.RayMonitorLink` to the deployment's one monitor
actor with replicas. Each request is keyed by its completion id from admission on, so one
that ends without a decision gives its place up by that key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

from abstain_guard.guarantee.decision import Decision
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.report import live_page
from abstain_guard.serve.admission import Admission
from abstain_guard.serve.arrival import ArrivalOrder
from abstain_guard.serve.journal import DecisionJournal, journal_path, recover
from abstain_guard.serve.metrics import ServerMetrics
from abstain_guard.serve.service import json_safe


class MonitorLink(Protocol):
    """What the app needs of the monitor and the metrics (see the module docstring); a call
    that the monitor does not take in time raises ``MonitorUnavailableError`` (503)."""

    @property
    def monitored(self) -> bool:
        """Whether decisions are monitored (False without a guard: ``--no-guard``)."""
        ...

    async def admit(self, key: str) -> None:
        """Take request ``key``'s place in admission order."""
        ...

    async def finish(self, key: str, decision: Decision) -> None:
        """End request ``key`` with its decision; journaled when this returns
        (``DecisionJournalError`` otherwise: answer 503)."""
        ...

    def release(self, key: str) -> None:
        """End request ``key`` without a decision (a no-op once it finished)."""
        ...

    async def feedback(self, run_id: str, correct: bool) -> dict[str, Any]:
        """Label decision ``run_id``; the ``/v1/feedback`` body (``UnknownRunError``,
        ``DuplicateFeedbackError``)."""
        ...

    async def state(self) -> dict[str, Any]:
        """The monitor's state, JSON-safe (``/v1/monitor``)."""
        ...

    async def dashboard(self) -> str:
        """The monitor's page (``/dashboard``, :func:`~abstain_guard.monitor.report.live_page`)."""
        ...

    def request_done(self, path: str, status: int) -> None:
        """Count one HTTP request by path and status."""
        ...

    def decided(self, decision: Decision | None, seconds: float, stream: bool) -> None:
        """Count one answered chat completion: the decision that ended its run (None: none)
        and its latency."""
        ...

    def refused(self, outcome: str, reason: str) -> None:
        """Count a chat completion that was refused or failed (``ServerMetrics.refused``)."""
        ...

    async def metrics(self) -> bytes:
        """The Prometheus text exposition (``/metrics``)."""
        ...

    async def health(self) -> dict[str, Any]:
        """``{"ok": bool, ...}`` (``/readyz``'s ``monitor``)."""
        ...


def feedback_body(monitor: GuardMonitor, run_id: str, correct: bool) -> dict[str, Any]:
    """Label ``run_id`` on ``monitor``; what ``POST /v1/feedback`` answers.

    Raises:
        UnknownRunError, DuplicateFeedbackError: as :meth:`GuardMonitor.record_feedback`.
    """
    record = monitor.record_feedback(run_id, correct)
    state = monitor.state()
    return {
        "id": record.run_id,
        "correct": record.correct,
        "abstained": record.abstained,
        "in_risk_test": in_risk_test(state, record.abstained, record.score, record.group),
        "alarm": state["alarm"],
    }


def in_risk_test(
    state: Mapping[str, Any], abstained: bool, score: float | None, group: str | None
) -> bool:
    """Whether feedback on a decision entered a risk test (``state``: the monitor's): an
    answered, scored decision, in the test of its own group with per-group rules (a group
    without a risk test, or none, is not in the pooled one), else in the one test."""
    if abstained or score is None:
        return False
    groups = state.get("groups")
    if groups is None:
        tests = state["tests"]
    else:
        tests = None if group is None else (groups.get(str(group)) or {}).get("tests")
    return bool(tests) and tests.get("risk") is not None


def monitor_arrival(monitor: GuardMonitor) -> ArrivalOrder:
    """The admission order feeding ``monitor``, on the journal of its log
    (``<log>.journal``; in memory without a log), after feeding ``monitor`` what the journal
    holds and the log does not.

    Raises:
        DecisionJournalError: the journal cannot be read, or replaying it failed.
    """

    def feed(decision: Decision, run_id: str) -> Any:
        return monitor.observe(decision, run_id)

    journal = DecisionJournal(journal_path(monitor.log_path))
    logged = {r.run_id for r in monitor.records()}
    recover(journal, feed, logged.__contains__)
    return ArrivalOrder(feed, journal)


class LocalMonitorLink:
    """The monitor, admission order and metrics of one server process.

    Args:
        service: the served guard (or raw model); its load is in the metrics.
        monitor: the fitted monitor (None without a guard).
    """

    def __init__(self, service: Admission, monitor: GuardMonitor | None) -> None:
        self.monitor = monitor
        self.arrival = None if monitor is None else monitor_arrival(monitor)
        guard = getattr(service, "guard", None)
        self.metrics_ = ServerMetrics(
            service,
            monitor,
            scores=None if guard is None else guard.artifact.scores,
            health=None if self.arrival is None else self.arrival.health,
        )
        self._tickets: dict[str, int] = {}

    @property
    def monitored(self) -> bool:
        return self.monitor is not None

    async def admit(self, key: str) -> None:
        if self.arrival is not None:
            self._tickets[key] = self.arrival.admit()

    async def finish(self, key: str, decision: Decision) -> None:
        ticket = self._tickets.pop(key, None)
        if self.arrival is not None and ticket is not None:
            self.arrival.finish(ticket, key, decision)

    def release(self, key: str) -> None:
        ticket = self._tickets.pop(key, None)
        if self.arrival is not None and ticket is not None:
            self.arrival.finish(ticket)

    async def feedback(self, run_id: str, correct: bool) -> dict[str, Any]:
        assert self.monitor is not None
        if self.arrival is not None:  # a decision held behind an earlier request: wait
            await self.arrival.wait_fed(run_id)
        return feedback_body(self.monitor, run_id, correct)

    async def state(self) -> dict[str, Any]:
        assert self.monitor is not None
        return dict(json_safe(self.monitor.state()))

    async def dashboard(self) -> str:
        assert self.monitor is not None
        return await asyncio.to_thread(live_page, self.monitor)  # off the event loop

    def request_done(self, path: str, status: int) -> None:
        self.metrics_.request_done(path, status)

    def decided(self, decision: Decision | None, seconds: float, stream: bool) -> None:
        self.metrics_.decided(decision, seconds, stream)

    def refused(self, outcome: str, reason: str) -> None:
        self.metrics_.refused(outcome, reason)

    async def metrics(self) -> bytes:
        return self.metrics_.render()

    async def health(self) -> dict[str, Any]:
        if self.arrival is None:
            return {"ok": True}
        return self.arrival.describe_health()
