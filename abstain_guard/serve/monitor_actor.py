"""The one drift monitor of replicas on Ray Serve (``abstain-guard serve --replicas N``).

:class:`DeploymentMonitor` is the body of a named Ray actor on the node that started the
deployment: the :class:`~abstain_guard.GuardMonitor` and its log, the deployment's admission
order, the Prometheus registry and the agent runs' step records. Each replica reaches it
through a :class:`RayMonitorLink` (every awaited call has a timeout,
:data:`MONITOR_TIMEOUT_S`: 503 on a miss); the actor pings the replicas holding places and
gives up a dead one's. docs/serving.md, "Replicas on Ray Serve".
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.errors import DuplicateFeedbackError, MonitorUnavailableError, UnknownRunError
from abstain_guard.guarantee.decision import Decision
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.report import live_page
from abstain_guard.serve.metrics import ServerMetrics
from abstain_guard.serve.monitor_link import feedback_body, monitor_arrival
from abstain_guard.serve.service import json_safe
from abstain_guard.serve.step_record import StepEntry, StepLimits

logger = logging.getLogger("abstain_guard.serve")

#: How long a ping of a replica may take before it counts as alive but busy.
PING_TIMEOUT_S = 10.0
#: How long a replica waits for the monitor actor (a place, a decision, feedback, a step
#: record, health) before it answers 503 with ``Retry-After``.
MONITOR_TIMEOUT_S = 5.0


@dataclass
class _Replica:
    """A replica as the monitor knows it: its actor handle and its model's batch size."""

    handle: Any
    batch: int


class DeploymentMonitor:
    """The monitor actor's body (see the module docstring).

    Args:
        artifact: the artifact directory the replicas serve (its calibration set and rule).
        config: the guard config (``GuardConfig.model_dump()``), as the replicas get it.
        log_path: the ``--monitor-log`` (an existing one is resumed).
        monitor_options: other :class:`~abstain_guard.GuardMonitor` settings.
        reap_s: seconds between checks of the replicas holding places (0: no checks).
        steps: the step record's limits (``serve``'s ``--step-record-*``).

    Raises:
        MonitorLogError: the log cannot be resumed.
        DecisionJournalError: the journal cannot be read or replayed.
    """

    def __init__(
        self,
        artifact: str,
        config: Mapping[str, Any],
        *,
        log_path: str | None = None,
        monitor_options: Mapping[str, Any] | None = None,
        reap_s: float = 1.0,
        steps: StepLimits | None = None,
    ) -> None:
        self.monitor = GuardMonitor(log_path=log_path, **dict(monitor_options or {}))
        served = GuardArtifact.load(artifact)
        self.monitor.fit_artifact(served, GuardConfig.model_validate(config))
        self.arrival = monitor_arrival(self.monitor)
        self.steps = (steps or StepLimits()).record()
        self.metrics_ = ServerMetrics(
            monitor=self.monitor,
            load=(self.in_flight, self.queued),
            scores=served.scores,
            health=self.arrival.health,
        )
        self.reap_s = reap_s
        self._places: dict[str, tuple[int, str]] = {}  # completion id -> (ticket, replica)
        self._replicas: dict[str, _Replica] = {}
        self._reaper: asyncio.Task[None] | None = None
        self.late_decisions = 0
        self.redelivered = 0
        self.decisions_by_replica: Counter[str] = Counter()
        self.dead_replicas = 0
        self.released_by_death = 0

    # --- replicas ------------------------------------------------------------------------

    async def register(self, replica: str, handle: Any, batch: int) -> dict[str, Any] | None:
        """Know ``replica`` (its actor ``handle``, its batch size); returns the monitor's
        ``resumed`` summary (None: a fresh log or none)."""
        self._replicas[replica] = _Replica(handle, int(batch))
        if self._reaper is None and self.reap_s > 0:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        resumed: dict[str, Any] | None = self.monitor.state()["resumed"]
        return resumed

    def in_flight(self) -> int:
        """Requests admitted by the replicas and not yet ended."""
        return len(self._places)

    def queued(self) -> int:
        """Admitted requests beyond their replica's batch size, summed over replicas."""
        per = Counter(replica for _, replica in self._places.values())
        return sum(max(0, n - self._batch(r)) for r, n in per.items())

    def _batch(self, replica: str) -> int:
        known = self._replicas.get(replica)
        return known.batch if known is not None else 1

    async def check_replicas(self) -> list[str]:
        """Ping the replicas that hold places; give up the places of the dead ones (their
        requests were never answered). Returns the dead replicas' ids."""
        import ray  # the actor runs on Ray; pings need it

        holders = {replica for _, replica in self._places.values()}
        dead = []
        for replica in sorted(holders):
            known = self._replicas.get(replica)
            if known is None:
                continue
            try:
                await asyncio.wait_for(known.handle.__ray_ready__.remote(), PING_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                dead.append(replica)
            except asyncio.TimeoutError:
                continue  # busy, not dead
        for replica in dead:
            self.release_replica(replica)
        return dead

    def release_replica(self, replica: str) -> int:
        """Give up every place ``replica`` holds (it died); returns how many."""
        keys = [k for k, (_, owner) in self._places.items() if owner == replica]
        for key in keys:
            self.arrival.finish(self._places.pop(key)[0])
        self._replicas.pop(replica, None)
        self.dead_replicas += 1
        self.released_by_death += len(keys)
        logger.warning(
            "replica %s died: %d requests in flight on it ended without a decision",
            replica,
            len(keys),
        )
        return len(keys)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_s)
            try:
                await self.check_replicas()
            except Exception:  # a failed check must not end the checks
                logger.exception("checking the replicas failed")

    # --- decisions -----------------------------------------------------------------------

    async def admit(self, key: str, replica: str) -> bool:
        """Give request ``key`` of ``replica`` its place; False when ``replica`` is not
        registered (the actor restarted: register again)."""
        self._places[key] = (self.arrival.admit(), replica)
        return replica in self._replicas

    async def finish(self, key: str, decision: Decision) -> None:
        """End request ``key`` with ``decision``: journaled before this returns, fed in
        admission order (at once if its place is unknown here: taken before a restart of
        this actor; not again if the journal or the log already had it, a call Ray retried).

        Raises:
            DecisionJournalError: the journal write failed (the replica answers 503).
        """
        place = self._places.pop(key, None)
        if place is not None:
            self.arrival.finish(place[0], key, decision)
            self.decisions_by_replica[place[1]] += 1
            return
        if key in self.monitor.records_:
            self.redelivered += 1
            return
        self.arrival.feed_now(key, decision)
        self.late_decisions += 1

    async def release(self, key: str) -> None:
        """End request ``key`` without a decision."""
        place = self._places.pop(key, None)
        if place is not None:
            self.arrival.finish(place[0])

    async def feedback(self, run_id: str, correct: bool) -> dict[str, Any]:
        """``{"body": ...}`` (the ``/v1/feedback`` answer) or ``{"error": "unknown" |
        "duplicate", "message": ...}``."""
        await self.arrival.wait_fed(run_id)
        try:
            return {"body": feedback_body(self.monitor, run_id, correct)}
        except UnknownRunError as exc:
            return {"error": "unknown", "message": str(exc)}
        except DuplicateFeedbackError as exc:
            return {"error": "duplicate", "message": str(exc)}

    async def state(self) -> dict[str, Any]:
        """The monitor's state (``/v1/monitor``) and the deployment's: replicas, requests
        in flight, places given up by dead replicas, late decisions."""
        state = dict(json_safe(self.monitor.state()))
        state["deployment"] = {
            "replicas": len(self._replicas),
            "in_flight": self.in_flight(),
            "dead_replicas": self.dead_replicas,
            "released_by_dead_replicas": self.released_by_death,
            "late_decisions": self.late_decisions,
            "redelivered_decisions": self.redelivered,
            "decisions_by_replica": dict(self.decisions_by_replica),
            "held": self.arrival.waiting,
            "step_record": self.steps.describe(),
            "health": self.arrival.health.describe(),
        }
        return state

    async def health(self) -> dict[str, Any]:
        """Whether every decision reached the journal and the log (``/readyz``'s
        ``monitor``)."""
        return self.arrival.describe_health()

    # --- step records (step gating) ------------------------------------------------------

    async def step_entries(self, keys: list[str]) -> dict[str, StepEntry]:
        """The step records kept under ``keys`` (any replica's)."""
        return self.steps.get_many(keys)

    async def store_step(self, key: str, entry: StepEntry) -> None:
        """Keep a replica's answered step under ``key``."""
        self.steps.put(key, entry)

    async def records(self) -> list[str]:
        """The run ids fed to the monitor, in order (what the log holds)."""
        return [r.run_id for r in self.monitor.records()]

    async def dashboard(self) -> str:
        """The deployment's ``/dashboard`` page (built off the actor's event loop)."""
        return await asyncio.to_thread(live_page, self.monitor)

    # --- metrics -------------------------------------------------------------------------

    async def request_done(self, path: str, status: int) -> None:
        self.metrics_.request_done(path, status)

    async def decided(self, decision: Decision | None, seconds: float, stream: bool) -> None:
        self.metrics_.decided(decision, seconds, stream)

    async def refused(self, outcome: str, reason: str) -> None:
        self.metrics_.refused(outcome, reason)

    async def metrics(self) -> bytes:
        return self.metrics_.render()


class RayMonitorLink:
    """A replica's :class:`~abstain_guard.serve.monitor_link.MonitorLink` to the monitor
    actor. Counting calls are sent without waiting; every other call is awaited for at most
    ``timeout_s`` seconds, and a call that times out or fails (the actor restarting, gone, a
    journal write that failed there) raises :class:`MonitorUnavailableError` (the app
    answers 503 with ``Retry-After``). A decision is awaited: the actor has journaled it
    before the replica answers.

    Args:
        actor: the monitor actor's handle.
        replica: this replica's id (its Ray actor id).
        handle: this replica's own actor handle (the monitor pings it).
        batch: this replica's model batch size.
        timeout_s: the longest wait for the actor.
    """

    monitored = True

    def __init__(
        self,
        actor: Any,
        replica: str,
        handle: Any,
        batch: int,
        timeout_s: float = MONITOR_TIMEOUT_S,
    ) -> None:
        self.actor = actor
        self.replica = replica
        self.handle = handle
        self.batch = batch
        self.timeout_s = timeout_s

    async def call(self, method: str, *args: Any) -> Any:
        """``actor.<method>.remote(*args)``, awaited for at most ``timeout_s``.

        Raises:
            MonitorUnavailableError: it timed out or failed.
        """
        try:
            return await asyncio.wait_for(getattr(self.actor, method).remote(*args), self.timeout_s)
        except asyncio.TimeoutError as exc:
            raise MonitorUnavailableError(
                f"the monitor actor did not answer {method} within {self.timeout_s:g} s "
                "(restarting or overloaded)"
            ) from exc
        except Exception as exc:  # RayActorError, RayTaskError (a journal write failed) ...
            raise MonitorUnavailableError(
                f"the monitor actor failed {method}: {type(exc).__name__}: {exc}"
            ) from exc

    async def register(self) -> dict[str, Any] | None:
        resumed: dict[str, Any] | None = await self.call(
            "register", self.replica, self.handle, self.batch
        )
        return resumed

    async def admit(self, key: str) -> None:
        if not await self.call("admit", key, self.replica):
            await self.register()

    async def finish(self, key: str, decision: Decision) -> None:
        await self.call("finish", key, decision)

    def release(self, key: str) -> None:
        self.actor.release.remote(key)

    async def feedback(self, run_id: str, correct: bool) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("feedback", run_id, correct)
        if result.get("error") == "unknown":
            raise UnknownRunError(result["message"])
        if result.get("error") == "duplicate":
            raise DuplicateFeedbackError(result["message"])
        body: dict[str, Any] = result["body"]
        return body

    async def state(self) -> dict[str, Any]:
        state: dict[str, Any] = await self.call("state")
        return state

    async def dashboard(self) -> str:
        page: str = await self.call("dashboard")
        return page

    def request_done(self, path: str, status: int) -> None:
        self.actor.request_done.remote(path, status)

    def decided(self, decision: Decision | None, seconds: float, stream: bool) -> None:
        self.actor.decided.remote(decision, seconds, stream)

    def refused(self, outcome: str, reason: str) -> None:
        self.actor.refused.remote(outcome, reason)

    async def metrics(self) -> bytes:
        text: bytes = await self.call("metrics")
        return text

    async def health(self) -> dict[str, Any]:
        try:
            health: dict[str, Any] = await self.call("health")
        except MonitorUnavailableError as exc:
            return {"ok": False, "error": str(exc)}
        return health


class ActorStepRecord:
    """The deployment's step record, kept in the monitor actor (a
    :class:`~abstain_guard.serve.step_record.StepStore`): any replica reads the steps
    another replica answered. Calls go through ``link`` (its timeout: 503 on a miss).

    Args:
        link: the replica's link to the monitor actor.
        limits: the actor's step record's limits (for messages).
    """

    def __init__(self, link: RayMonitorLink, limits: StepLimits | None = None) -> None:
        limits = limits or StepLimits()
        self.link = link
        self.max_entries = limits.max_entries
        self.ttl_s = float(limits.ttl_s)

    async def entries(self, keys: Sequence[str]) -> dict[str, StepEntry]:
        if not keys:
            return {}
        found: dict[str, StepEntry] = await self.link.call("step_entries", list(keys))
        return found

    async def store(self, key: str, entry: StepEntry) -> None:
        await self.link.call("store_step", key, entry)

    def describe(self) -> dict[str, Any]:
        return {
            "where": "monitor actor (shared by the replicas; its counts in /v1/monitor)",
            "max_entries": self.max_entries,
            "ttl_s": self.ttl_s,
        }
