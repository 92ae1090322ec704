"""Prometheus metrics of one server (its own registry, so several apps in one process —
tests — do not share counters): requests by path and status, decisions, chat completion
latency, requests in flight and waiting for the model, and the drift monitor's state
(``abstain_guard_monitor_*``, read from the monitor at each scrape)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from abstain_guard.errors import InvalidInputError
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.serve.admission import Admission

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


def _rate(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _family(
    name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]
) -> GaugeMetricFamily:
    """The gauge ``abstain_guard_monitor_<name>`` with one sample per ``(labels, value)``."""
    family = GaugeMetricFamily(f"abstain_guard_monitor_{name}", doc, labels=labels)
    for key, value in rows:
        family.add_metric(key, float(value))
    return family


class MonitorCollector(Collector):
    """The monitor's state as the ``abstain_guard_monitor_*`` gauges, computed at scrape
    time (the list: docs/serving.md, "Endpoints", ``GET /metrics``)."""

    def __init__(self, monitor: GuardMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Any]:
        state = self.monitor.state()
        tests = [([test], entry) for test, entry in state["tests"].items() if entry is not None]
        yield from _test_families(
            "",
            (
                "1 once a monitor test alarmed.",
                "E-value against the guarantee (alarm at the threshold).",
            ),
            ["test"],
            tests,
        )
        yield _family(
            "alarm_threshold",
            "E-value that alarms.",
            ["test"],
            [(key, entry["threshold"]) for key, entry in tests],
        )
        yield GaugeMetricFamily(
            "abstain_guard_monitor_decisions", "Decisions observed.", value=state["decisions"]
        )
        yield GaugeMetricFamily(
            "abstain_guard_monitor_answered_rate",
            "Live answered rate.",
            value=_rate(state["answered_rate"]),
        )
        yield GaugeMetricFamily(
            "abstain_guard_monitor_expected_participation",
            "Answered rate of traffic exchangeable with calibration, k/(n+1).",
            value=state["expected_participation"],
        )
        if state["band"] is not None:
            bounds = zip((["lower"], ["upper"]), state["band"], strict=True)
            yield _family("band", "Guaranteed participation band.", ["bound"], bounds)
        fb = state["feedback"]
        kinds = [([kind], fb[kind]) for kind in ("answered", "abstained", "errors")]
        yield _family("feedback", "Feedback received.", ["kind"], kinds)
        yield GaugeMetricFamily(
            "abstain_guard_monitor_error_rate",
            "Error rate among answered questions with feedback.",
            value=_rate(fb["error_rate"]),
        )
        if state.get("groups"):
            yield from group_families(state["groups"])


def _test_families(
    prefix: str,
    docs: tuple[str, str],
    labels: list[str],
    tests: list[tuple[list[str], Mapping[str, Any]]],
) -> Iterator[GaugeMetricFamily]:
    """The ``<prefix>alarm`` and ``<prefix>e_value`` gauges of ``tests`` (label values and a
    test's entry of the monitor's state)."""
    yield _family(f"{prefix}alarm", docs[0], labels, [(k, e["alarm"]) for k, e in tests])
    yield _family(f"{prefix}e_value", docs[1], labels, [(k, e["e_value"]) for k, e in tests])


def group_families(groups: Mapping[str, Any]) -> Iterator[GaugeMetricFamily]:
    """Each group's own tests and counts (``state["groups"]`` of a monitor with per-group
    rules), labeled ``group``."""
    tests = [
        ([str(group), test], found)
        for group, entry in groups.items()
        for test, found in entry["tests"].items()
        if found is not None
    ]
    yield from _test_families(
        "group_",
        (
            "1 once the group's own test alarmed.",
            "E-value of the group's own test against its guarantee.",
        ),
        ["group", "test"],
        tests,
    )
    decisions = [([str(g)], e["decisions"]) for g, e in groups.items()]
    yield _family("group_decisions", "Decisions of the group.", ["group"], decisions)
    rates = [([str(g)], _rate(e["answered_rate"])) for g, e in groups.items()]
    yield _family("group_answered_rate", "Live answered rate of the group.", ["group"], rates)


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
