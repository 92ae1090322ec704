"""Prometheus metrics of one server (its own registries, so several apps in one process —
tests — do not share counters). :class:`ServerMetrics` holds what the deployment counts:
requests by path and status, chat completions by outcome and reason, the scores decided,
latency, load and the drift monitor's state (``abstain_guard_monitor_*``, read from the
monitor at each scrape); with replicas it lives in the monitor actor. :class:`ServiceMetrics`
holds what each process knows of itself: ``build_info``, τ, the target and whether the
monitor answered the scrape. The list: docs/serving.md, "Metrics, logs and traces".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from abstain_guard._version import __version__
from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee.decision import Decision
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.serve.admission import Admission
from abstain_guard.serve.journal import FeedHealth
from abstain_guard.serve.step_gate import UNKNOWN_STEPS

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)

#: The ``reason`` label of a decision, by its :attr:`Decision.reason` (any other: ``other``).
REASONS = {
    "score <= threshold": "score",
    "score > threshold": "score",
    "scoring failed": "scoring_error",
    "input too long": "input_too_long",
    UNKNOWN_STEPS: "unknown_steps",
    "group without a rule: abstain": "no_group_rule",
}


def decision_reason(decision: Decision) -> tuple[str, str]:
    """``(outcome, reason)`` of a decision: ``answered`` / ``abstained``, and ``score`` (its
    score against τ), ``scoring_error`` (the capture, the backend's payload or the scorer
    failed), or the rule that abstained without a score."""
    outcome = "abstained" if decision.abstained else "answered"
    return outcome, REASONS.get(decision.reason, "other")


def score_buckets(scores: ArrayLike, threshold: float) -> list[float]:
    """The score histogram's bounds: the calibration scores' deciles and τ, so each bucket's
    share of live scores can be read against calibration's (about a tenth each)."""
    bounds = np.quantile(np.asarray(scores, dtype=float), np.linspace(0.1, 0.9, 9))
    return sorted({float(b) for b in [*bounds, threshold] if np.isfinite(b)})


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
        yield CounterMetricFamily(
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
        feedback = CounterMetricFamily(
            "abstain_guard_monitor_feedback", "Feedback received.", labels=["kind"]
        )
        for kind in ("answered", "abstained", "errors"):
            feedback.add_metric([kind], fb[kind])
        yield feedback
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


def group_families(groups: Mapping[str, Any]) -> Iterator[Metric]:
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
    decisions = CounterMetricFamily(
        "abstain_guard_monitor_group_decisions", "Decisions of the group.", labels=["group"]
    )
    for group, entry in groups.items():
        decisions.add_metric([str(group)], entry["decisions"])
    yield decisions
    rates = [([str(g)], _rate(e["answered_rate"])) for g, e in groups.items()]
    yield _family("group_answered_rate", "Live answered rate of the group.", ["group"], rates)


def service_load(service: Admission) -> tuple[Callable[[], int], Callable[[], int]]:
    """``service``'s requests in flight and those beyond its model's batch, as callables."""
    batch = int(getattr(service.chat_model, "max_batch_size", 1))
    return (lambda: service.in_flight), (lambda: max(0, service.in_flight - batch))


LOAD_GAUGES = (
    ("abstain_guard_in_flight", "Chat completion requests admitted and not yet decided."),
    ("abstain_guard_queue_depth", "Admitted requests beyond the model's batch size."),
)


class HealthCollector(Collector):
    """The failed writes of decisions on their way to the monitor log (``FeedHealth``)."""

    def __init__(self, health: FeedHealth) -> None:
        self.health = health

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "abstain_guard_monitor_write_failures",
            "Decisions that could not be written to the journal or the monitor log.",
            labels=["target"],
        )
        family.add_metric(["journal"], self.health.journal_failures)
        family.add_metric(["log"], self.health.log_failures)
        yield family


class ServerMetrics:
    """The deployment's counts (module docstring); :meth:`render` gives the text exposition.

    Args:
        service: the server's service, whose load the gauges read (or give ``load``).
        monitor: the drift monitor whose state is exported (None: none).
        load: ``(in_flight, queue_depth)`` callables instead of ``service``'s (the monitor
            actor of replicas on Ray Serve counts the deployment's).
        scores: the calibration scores (the score histogram's buckets; None: no histogram).
        health: the decisions' path to the monitor log, whose failed writes are counted.
    """

    def __init__(
        self,
        service: Admission | None = None,
        monitor: GuardMonitor | None = None,
        *,
        load: tuple[Callable[[], int], Callable[[], int]] | None = None,
        scores: ArrayLike | None = None,
        health: FeedHealth | None = None,
    ) -> None:
        if load is None:
            if service is None:
                raise InvalidInputError("ServerMetrics needs a service or its load callables.")
            load = service_load(service)
        self.registry = CollectorRegistry()
        if monitor is not None:
            self.registry.register(MonitorCollector(monitor))
        if health is not None:
            self.registry.register(HealthCollector(health))
        self.requests = Counter(
            "abstain_guard_requests",
            "HTTP requests by path and status code.",
            ["path", "status"],
            registry=self.registry,
        )
        self.grouped = bool(monitor is not None and getattr(monitor, "grouped_", False))
        self.completions = Counter(
            "abstain_guard_chat_completions",
            "Chat completions by how they ended (outcome: answered, abstained, refused, "
            "failed) and why (reason: score, scoring_error, ..., or the refusal's code).",
            ["outcome", "reason", "group"] if self.grouped else ["outcome", "reason"],
            registry=self.registry,
        )
        self.scores = None
        if scores is not None and monitor is not None:
            self.scores = Histogram(
                "abstain_guard_decision_score",
                "Scores of the scored decisions (buckets: calibration's deciles and τ).",
                buckets=score_buckets(scores, monitor.rule_.threshold),
                registry=self.registry,
            )
        self.latency = Histogram(
            "abstain_guard_chat_completion_seconds",
            "Time from a chat completion request to its decision, by whether it streamed.",
            ["stream"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        for (name, doc), read in zip(LOAD_GAUGES, load, strict=True):
            Gauge(name, doc, registry=self.registry).set_function(read)

    def request_done(self, path: str, status: int) -> None:
        """Count one HTTP request by path and status."""
        self.requests.labels(path, str(status)).inc()

    def decided(self, decision: Decision | None, seconds: float, stream: bool) -> None:
        """Count one answered chat completion: its decision (None: none ended the run, no
        guard or a tool call) by outcome and reason, with per-group rules under its group
        (``""``: none), and its score; and its latency."""
        if decision is not None:
            self._count(*decision_reason(decision), decision.group)
            if self.scores is not None and decision.score is not None:
                self.scores.observe(decision.score)
        self.latency.labels("true" if stream else "false").observe(seconds)

    def refused(self, outcome: str, reason: str) -> None:
        """Count a chat completion that was not answered: ``refused`` with its error code
        (4xx, 429, 503), or ``failed`` with its error (500)."""
        self._count(outcome, reason, None)

    def _count(self, outcome: str, reason: str, group: str | None) -> None:
        labels: tuple[str, ...] = (outcome, reason)
        if self.grouped:
            labels += ("" if group is None else str(group),)
        self.completions.labels(*labels).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class ServiceMetrics:
    """What one server process reports of itself, whatever its monitor's state:
    ``abstain_guard_build_info`` (version, artifact digest, scorer, mode) and, with a guard,
    τ and the target of its rule and ``abstain_guard_monitor_up`` (whether the monitor
    answered this scrape).

    Args:
        rule: the guard's decision rule (None: no guard, ``--no-guard``).
        artifact_sha256, scorer: the artifact's digest and the scorer's name.
    """

    def __init__(
        self, rule: Any = None, artifact_sha256: str | None = None, scorer: str = ""
    ) -> None:
        self.registry = CollectorRegistry()
        build = {"version": __version__, "artifact_sha256": artifact_sha256 or ""}
        build.update(scorer=scorer, mode="none" if rule is None else str(rule.mode))
        info = Info(
            "abstain_guard_build", "The server's version and guard.", registry=self.registry
        )
        info.info(build)
        self.monitor_up: Gauge | None = None
        if rule is None:
            return
        self.monitor_up = Gauge(
            "abstain_guard_monitor_up",
            "1 when the drift monitor answered this scrape (its metrics follow), else 0.",
            registry=self.registry,
        )
        gauges = {"threshold": "τ: answered when the score is at most τ.",
                  "target": "The rule's target: participation 1-α or risk ε."}  # fmt: skip
        for name, doc in gauges.items():
            gauge = Gauge(f"abstain_guard_{name}", doc, ["mode"], registry=self.registry)
            gauge.labels(build["mode"]).set(float(getattr(rule, name)))

    @classmethod
    def of(cls, service: Any) -> ServiceMetrics:
        """The metrics of ``service`` (a ``GuardService``, or the raw model's)."""
        guard = getattr(service, "guard", None)
        if guard is None:
            return cls()
        return cls(guard.decision_rule, guard.artifact.digest, guard.artifact.scorer.name)

    def render(self, monitor_up: bool) -> bytes:
        """The text exposition, with ``abstain_guard_monitor_up`` set to ``monitor_up``."""
        if self.monitor_up is not None:
            self.monitor_up.set(1 if monitor_up else 0)
        return generate_latest(self.registry)
