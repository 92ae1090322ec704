"""Prometheus metrics of one server (its own registry, so several apps in one process —
tests — do not share counters): requests by path and status, decisions, chat completion
latency, requests in flight and waiting for the model, and the drift monitor's state
(``abstain_guard_monitor_*``, read from the monitor at each scrape)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from abstain_guard.errors import InvalidInputError
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.serve.admission import Admission

__all__ = [
    "CONTENT_TYPE_LATEST",
    "MonitorCollector",
    "ServerMetrics",
    "group_families",
    "service_load",
]

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


class MonitorCollector(Collector):
    """The monitor's state as gauges, computed at scrape time:

    * ``abstain_guard_monitor_alarm{test}``: 1 once the test alarmed (it stays 1);
    * ``abstain_guard_monitor_e_value{test}`` and ``..._alarm_threshold{test}``: the evidence
      against the guarantee and the value that raises the alarm;
    * ``abstain_guard_monitor_answered_rate``, ``..._expected_participation`` (k/(n+1), what
      exchangeable traffic is answered at) and ``..._band{bound}`` (participation mode);
    * ``abstain_guard_monitor_decisions``, ``..._feedback{kind}`` and ``..._error_rate``;
    * with per-group rules, each group's own: ``abstain_guard_monitor_group_alarm{group,test}``,
      ``..._group_e_value{group,test}``, ``..._group_decisions{group}`` and
      ``..._group_answered_rate{group}`` (the unlabeled ones above are over all groups).
    """

    def __init__(self, monitor: GuardMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Any]:
        state = self.monitor.state()
        alarm = GaugeMetricFamily(
            "abstain_guard_monitor_alarm", "1 once a monitor test alarmed.", labels=["test"]
        )
        value = GaugeMetricFamily(
            "abstain_guard_monitor_e_value",
            "E-value against the guarantee (alarm at the threshold).",
            labels=["test"],
        )
        threshold = GaugeMetricFamily(
            "abstain_guard_monitor_alarm_threshold", "E-value that alarms.", labels=["test"]
        )
        for test, entry in state["tests"].items():
            if entry is None:
                continue
            alarm.add_metric([test], float(entry["alarm"]))
            value.add_metric([test], float(entry["e_value"]))
            threshold.add_metric([test], float(entry["threshold"]))
        yield from (alarm, value, threshold)
        yield GaugeMetricFamily(
            "abstain_guard_monitor_decisions", "Decisions observed.", value=state["decisions"]
        )
        rate = state["answered_rate"]
        yield GaugeMetricFamily(
            "abstain_guard_monitor_answered_rate",
            "Live answered rate.",
            value=float("nan") if rate is None else rate,
        )
        yield GaugeMetricFamily(
            "abstain_guard_monitor_expected_participation",
            "Answered rate of traffic exchangeable with calibration, k/(n+1).",
            value=state["expected_participation"],
        )
        if state["band"] is not None:
            band = GaugeMetricFamily(
                "abstain_guard_monitor_band", "Guaranteed participation band.", labels=["bound"]
            )
            band.add_metric(["lower"], float(state["band"][0]))
            band.add_metric(["upper"], float(state["band"][1]))
            yield band
        fb = state["feedback"]
        counts = GaugeMetricFamily(
            "abstain_guard_monitor_feedback", "Feedback received.", labels=["kind"]
        )
        for kind in ("answered", "abstained", "errors"):
            counts.add_metric([kind], float(fb[kind]))
        yield counts
        error = fb["error_rate"]
        yield GaugeMetricFamily(
            "abstain_guard_monitor_error_rate",
            "Error rate among answered questions with feedback.",
            value=float("nan") if error is None else error,
        )
        if state.get("groups"):
            yield from group_families(state["groups"])


def group_families(groups: Mapping[str, Any]) -> Iterator[GaugeMetricFamily]:
    """Each group's own tests and counts (``state["groups"]`` of a monitor with per-group
    rules), labeled ``group``."""
    alarm = GaugeMetricFamily(
        "abstain_guard_monitor_group_alarm",
        "1 once the group's own test alarmed.",
        labels=["group", "test"],
    )
    value = GaugeMetricFamily(
        "abstain_guard_monitor_group_e_value",
        "E-value of the group's own test against its guarantee.",
        labels=["group", "test"],
    )
    decisions = GaugeMetricFamily(
        "abstain_guard_monitor_group_decisions", "Decisions of the group.", labels=["group"]
    )
    answered = GaugeMetricFamily(
        "abstain_guard_monitor_group_answered_rate",
        "Live answered rate of the group.",
        labels=["group"],
    )
    for group, entry in groups.items():
        for test, found in entry["tests"].items():
            if found is None:
                continue
            alarm.add_metric([str(group), test], float(found["alarm"]))
            value.add_metric([str(group), test], float(found["e_value"]))
        decisions.add_metric([str(group)], float(entry["decisions"]))
        rate = entry["answered_rate"]
        answered.add_metric([str(group)], float("nan") if rate is None else float(rate))
    yield from (alarm, value, decisions, answered)


def service_load(service: Admission) -> tuple[Callable[[], int], Callable[[], int]]:
    """``service``'s requests in flight and those beyond its model's batch, as callables."""
    batch = int(getattr(service.chat_model, "max_batch_size", 1))
    return (lambda: service.in_flight), (lambda: max(0, service.in_flight - batch))


class ServerMetrics:
    """The server's metrics; :meth:`render` gives the Prometheus text exposition.

    Args:
        service: the server's service, whose load the gauges read (or give ``load``).
        monitor: the drift monitor whose state is exported (None: none).
        load: ``(in_flight, queue_depth)`` callables instead of ``service``'s (the monitor
            actor of replicas on Ray Serve counts the deployment's).
    """

    def __init__(
        self,
        service: Admission | None = None,
        monitor: GuardMonitor | None = None,
        *,
        load: tuple[Callable[[], int], Callable[[], int]] | None = None,
    ) -> None:
        if load is None:
            if service is None:
                raise InvalidInputError("ServerMetrics needs a service or its load callables.")
            load = service_load(service)
        self.registry = CollectorRegistry()
        if monitor is not None:
            self.registry.register(MonitorCollector(monitor))
        self.requests = Counter(
            "abstain_guard_requests",
            "HTTP requests by path and status code.",
            ["path", "status"],
            registry=self.registry,
        )
        self.grouped = bool(monitor is not None and getattr(monitor, "grouped_", False))
        self.decisions = Counter(
            "abstain_guard_decisions",
            "Guard decisions: answered or abstained (by group, with per-group rules).",
            ["outcome", "group"] if self.grouped else ["outcome"],
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
        in_flight.set_function(load[0])
        depth = Gauge(
            "abstain_guard_queue_depth",
            "Admitted requests beyond the model's batch size (waiting for a place in it).",
            registry=self.registry,
        )
        depth.set_function(load[1])

    def request_done(self, path: str, status: int) -> None:
        """Count one HTTP request by path and status."""
        self.requests.labels(path, str(status)).inc()

    def decided(
        self, abstained: bool | None, seconds: float, stream: bool, group: str | None = None
    ) -> None:
        """Count one decision (None: answered without a guard, not counted) and its
        latency; with per-group rules under its ``group`` (``""``: none, an unknown group)."""
        if abstained is not None:
            outcome = "abstained" if abstained else "answered"
            labels = (outcome, "" if group is None else str(group)) if self.grouped else (outcome,)
            self.decisions.labels(*labels).inc()
        self.latency.labels("true" if stream else "false").observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
