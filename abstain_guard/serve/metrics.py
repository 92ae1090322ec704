"""Prometheus metrics of one server (its own registry, so several apps in one process —
tests — do not share counters): requests by path and status, decisions, chat completion
latency, requests in flight and waiting for the model."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from abstain_guard.serve.service import Admission

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


class ServerMetrics:
    """The server's metrics; :meth:`render` gives the Prometheus text exposition."""

    def __init__(self, service: Admission) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "abstain_guard_requests",
            "HTTP requests by path and status code.",
            ["path", "status"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "abstain_guard_decisions",
            "Guard decisions: answered or abstained.",
            ["outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "abstain_guard_chat_completion_seconds",
            "Time from a chat completion request to its decision, by whether it streamed.",
            ["stream"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        in_flight = Gauge(
            "abstain_guard_in_flight",
            "Chat completion requests admitted and not yet decided.",
            registry=self.registry,
        )
        in_flight.set_function(lambda: service.in_flight)
        batch = int(getattr(service.chat_model, "max_batch_size", 1))
        depth = Gauge(
            "abstain_guard_queue_depth",
            "Admitted requests beyond the model's batch size (waiting for a place in it).",
            registry=self.registry,
        )
        depth.set_function(lambda: max(0, service.in_flight - batch))

    def decided(self, abstained: bool | None, seconds: float, stream: bool) -> None:
        """Count one decision (None: answered without a guard, not counted) and its
        latency."""
        if abstained is not None:
            self.decisions.labels("abstained" if abstained else "answered").inc()
        self.latency.labels("true" if stream else "false").observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
