"""The one drift monitor of replicas on Ray Serve (``abstain-guard serve --replicas N``).

:class:`DeploymentMonitor` is the body of a Ray actor (one per deployment, named, on the
node that started the deployment, where ``--monitor-log`` is written). It holds what a single
server holds in its memory: the :class:`~abstain_guard.monitor.GuardMonitor` with its
anytime-valid tests and its append-only log, the admission order
(:class:`~abstain_guard.serve.arrival.ArrivalOrder`) and the Prometheus registry. Every
replica reaches it through a :class:`RayMonitorLink`:

* a request takes its place in the **deployment's** admission order when its replica admits
  it (``admit``: the order in which the admissions reach the actor), keyed by its
  completion id, so the tests see the deployment's traffic in one sequence and the
  false-alarm bound is the deployment's, not a replica's;
* the replica sends the decision (``finish``) and waits for the actor to hold it before it
  answers; the actor feeds it once every request admitted before it has ended, and the
  monitor appends it to the log;
* a replica that dies takes its requests in flight with it: the actor pings the replicas
  that hold places (every ``reap_s`` seconds) and gives up the places of a dead one, so it
  holds the sequence for about a second; its in-flight requests were never answered
  (the client got a 5xx), so no answered decision is missing;
* ``/v1/feedback``, ``/v1/monitor`` and ``/metrics`` of every replica answer from here.

A restarted actor (Ray restarts it) resumes from ``--monitor-log`` exactly as a restarted
server does; a decision whose place was taken before the restart is fed when it arrives
(counted in ``deployment.late_decisions`` of ``/v1/monitor``), so none is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from abstain_guard.artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.errors import DuplicateFeedbackError, UnknownRunError
from abstain_guard.monitor import GuardMonitor
from abstain_guard.serve.arrival import ArrivalOrder
from abstain_guard.serve.metrics import ServerMetrics
from abstain_guard.serve.monitor_link import feedback_body
from abstain_guard.serve.service import json_safe

__all__ = ["DeploymentMonitor", "RayMonitorLink"]

logger = logging.getLogger("abstain_guard.serve")

#: How long a ping of a replica may take before it counts as alive but busy.
PING_TIMEOUT_S = 10.0


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
        monitor_options: other :class:`~abstain_guard.monitor.GuardMonitor` settings.
        reap_s: seconds between checks of the replicas holding places (0: no checks).
    """

    def __init__(
        self,
        artifact: str,
        config: Mapping[str, Any],
        *,
        log_path: str | None = None,
        monitor_options: Mapping[str, Any] | None = None,
        reap_s: float = 1.0,
    ) -> None:
        self.monitor = GuardMonitor(log_path=log_path, **dict(monitor_options or {}))
        self.monitor.fit_artifact(GuardArtifact.load(artifact), GuardConfig.model_validate(config))
        self.arrival = ArrivalOrder(lambda decision, rid: self.monitor.observe(decision, rid))
        self.metrics_ = ServerMetrics(monitor=self.monitor, load=(self.in_flight, self.queued))
        self.reap_s = reap_s
        self._places: dict[str, tuple[int, str]] = {}  # completion id -> (ticket, replica)
        self._replicas: dict[str, _Replica] = {}
        self._reaper: asyncio.Task[None] | None = None
        self.late_decisions = 0
        self.decisions_by_replica: dict[str, int] = {}
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
        per: dict[str, int] = {}
        for _, replica in self._places.values():
            per[replica] = per.get(replica, 0) + 1
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

    def _fed_by(self, replica: str) -> None:
        self.decisions_by_replica[replica] = self.decisions_by_replica.get(replica, 0) + 1

    async def finish(self, key: str, decision: Mapping[str, Any]) -> None:
        """End request ``key`` with ``decision``: fed in admission order (at once if its
        place is unknown here: taken before a restart of this actor)."""
        place = self._places.pop(key, None)
        if place is not None:
            self._fed_by(place[1])
            self.arrival.finish(place[0], key, decision)
            return
        self.late_decisions += 1
        self.monitor.observe(decision, key)

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
            "decisions_by_replica": dict(self.decisions_by_replica),
        }
        return state

    async def records(self) -> list[str]:
        """The run ids fed to the monitor, in order (what the log holds)."""
        return [r.run_id for r in self.monitor.records()]

    # --- metrics -------------------------------------------------------------------------

    async def request_done(self, path: str, status: int) -> None:
        self.metrics_.requests.labels(path, str(status)).inc()

    async def decided(self, abstained: bool | None, seconds: float, stream: bool) -> None:
        self.metrics_.decided(abstained, seconds, stream)

    async def metrics(self) -> bytes:
        return self.metrics_.render()


class RayMonitorLink:
    """A replica's :class:`~abstain_guard.serve.monitor_link.MonitorLink` to the monitor
    actor. Counting calls are sent without waiting; a decision is awaited (the actor holds it
    before the replica answers).

    Args:
        actor: the monitor actor's handle.
        replica: this replica's id (its Ray actor id).
        handle: this replica's own actor handle (the monitor pings it).
        batch: this replica's model batch size.
    """

    monitored = True

    def __init__(self, actor: Any, replica: str, handle: Any, batch: int) -> None:
        self.actor = actor
        self.replica = replica
        self.handle = handle
        self.batch = batch

    async def register(self) -> dict[str, Any] | None:
        resumed: dict[str, Any] | None = await self.actor.register.remote(
            self.replica, self.handle, self.batch
        )
        return resumed

    async def admit(self, key: str) -> None:
        if not await self.actor.admit.remote(key, self.replica):
            await self.register()

    async def finish(self, key: str, decision: Mapping[str, Any]) -> None:
        await self.actor.finish.remote(key, dict(decision))

    def release(self, key: str) -> None:
        self.actor.release.remote(key)

    async def feedback(self, run_id: str, correct: bool) -> dict[str, Any]:
        result: dict[str, Any] = await self.actor.feedback.remote(run_id, correct)
        if result.get("error") == "unknown":
            raise UnknownRunError(result["message"])
        if result.get("error") == "duplicate":
            raise DuplicateFeedbackError(result["message"])
        body: dict[str, Any] = result["body"]
        return body

    async def state(self) -> dict[str, Any]:
        state: dict[str, Any] = await self.actor.state.remote()
        return state

    def request_done(self, path: str, status: int) -> None:
        self.actor.request_done.remote(path, status)

    def decided(self, abstained: bool | None, seconds: float, stream: bool) -> None:
        self.actor.decided.remote(abstained, seconds, stream)

    async def metrics(self) -> bytes:
        text: bytes = await self.actor.metrics.remote()
        return text
