"""A monitor's decisions as the time series an on-call engineer reads, and the page that
draws them: participation (cumulative and over the last decisions) against the rule's target,
each scope's conformal test martingale (the exchangeability drift statistic) against its
alarm threshold, and the decisions counted by reason. ``abstain-guard serve``'s
``/dashboard`` and ``abstain-guard monitor report`` render the same page
(``dashboard.html``: the series embedded as JSON, drawn as SVG by its own script)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib.resources import files
from typing import Any

import numpy as np

from abstain_guard.monitor.drift import JUMPER_EXPERTS, jumper_update
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.monitor.log import MonitorRecord, json_default
from abstain_guard.monitor.scope import json_round_trip


@dataclass(frozen=True)
class MonitorSeries:
    """A monitor's history at ``P`` points (each the end of a bin of decisions).

    Attributes:
        decisions, answered: counts over the whole history.
        at, time: each point's decision index and time ``[P]``.
        participation: the answered rate of decisions 1..at ``[P]``.
        recent: the answered rate of the last ``window`` decisions up to ``at`` ``[P]``.
        target: the participation rule's target (None in risk mode).
        drift: per scope ("all", or each tested group) the conformal test martingale's
            largest value within each point's bin ``[P]`` (empty when the history does not
            start at decision 1: the statistic cannot be recomputed); ``e_value`` its value
            after the last decision.
        complete: whether the history starts at decision 1 (a snapshot or a running monitor
            keeps only its last ``max_records``).
        threshold: the exchangeability test's alarm threshold.
        reasons: decisions counted by :func:`record_reason`.
        alarms: the alarms raised (``Alarm`` fields).
        source: the artifact the monitor watches (the log header's ``source``).
    """

    decisions: int
    answered: int
    at: list[int]
    time: list[str]
    participation: list[float]
    recent: list[float]
    window: int
    target: float | None
    drift: dict[str, list[float]]
    e_value: dict[str, float]
    complete: bool
    threshold: float
    reasons: dict[str, int]
    alarms: list[dict[str, Any]]
    source: dict[str, Any]


def record_reason(record: MonitorRecord) -> str:
    """A decision's outcome and reason, ``"answered · score"``: the label the record logs
    (``reason``) when it has one, else ``score`` for a scored decision and ``unscored`` for
    one decided without a score (the capture, the backend or the scorer failed, or a rule
    abstained before scoring)."""
    outcome = "abstained" if record.abstained else "answered"
    reason = getattr(record, "reason", None) or ("unscored" if record.score is None else "score")
    return f"{outcome} · {reason}"


def _martingales(
    records: Sequence[MonitorRecord], jump: float, grouped: bool
) -> dict[str, np.ndarray]:
    """Each scope's martingale after each decision ``[N]`` (its value carried over the
    decisions it did not test), replayed from the logged p-values with Vovk's Simple Jumper;
    the scope of a tested decision is its group with per-group rules, else ``"all"``."""
    capital: dict[str, np.ndarray] = {}
    steps: dict[str, tuple[list[int], list[float]]] = {}
    for i, r in enumerate(records):
        if r.p_value is None:
            continue
        name = str(r.group) if grouped else "all"
        start = np.full(len(JUMPER_EXPERTS), 1.0 / len(JUMPER_EXPERTS))
        capital[name] = jumper_update(capital.get(name, start), float(r.p_value), jump)
        at, value = steps.setdefault(name, ([], []))
        at.append(i)
        value.append(float(capital[name].sum()))
    values = {}
    for name, (at, value) in steps.items():
        last = np.searchsorted(at, np.arange(len(records)), side="right") - 1  # -1: none yet
        values[name] = np.where(last >= 0, np.asarray(value)[last], 1.0)
    return values


def monitor_series(
    header: Mapping[str, Any],
    records: Sequence[MonitorRecord],
    points: int = 400,
    window: int = 100,
) -> MonitorSeries:
    """The series of ``records`` (a monitor's decisions in order, as :func:`~.log.read_log`
    returns them with its ``header``), at most ``points`` points; ``window``: decisions in
    the recent answered rate."""
    n = len(records)
    answered = np.cumsum([not r.abstained for r in records], dtype=float)
    ends = np.unique(np.linspace(0, n, min(points, n) + 1).astype(int))[1:]  # bin ends (1..n)
    cum = np.concatenate([[0.0], answered])
    recent = (cum[ends] - cum[np.maximum(ends - window, 0)]) / np.minimum(ends, window)
    tests, rule = header["tests"], header["rule"]
    complete = all(r.index == i for i, r in enumerate(records, 1))
    values: dict[str, np.ndarray] = {}
    if complete:
        values = _martingales(records, float(tests["jump"]), bool(header.get("groups")))
    starts = np.concatenate([[0], ends[:-1]])
    return MonitorSeries(
        decisions=n,
        answered=int(answered[-1]) if n else 0,
        at=[records[e - 1].index for e in ends],
        time=[records[e - 1].time for e in ends],
        participation=(cum[ends] / ends).tolist(),
        recent=recent.tolist(),
        window=window,
        target=rule.get("target") if rule.get("mode") == "participation" else None,
        drift={name: np.maximum.reduceat(row, starts).tolist() for name, row in values.items()},
        e_value={name: float(row[-1]) for name, row in values.items()},
        complete=complete,
        threshold=float(tests["thresholds"]["exchangeability"]),
        reasons=dict(Counter(record_reason(r) for r in records)),
        alarms=list(header.get("alarms") or []),
        source=dict(header.get("source") or {}),
    )


def live_series(monitor: GuardMonitor) -> MonitorSeries:
    """:func:`monitor_series` of a running monitor: its log header, the decisions it keeps
    and its alarms (what its log would hold)."""
    alarms = [asdict(a) for a in monitor.alarms]
    header = json_round_trip({**monitor._header(), "alarms": alarms})
    return monitor_series(header, monitor.records())


def render_page(series: MonitorSeries, *, live: bool = False) -> str:
    """The dashboard page with ``series`` embedded (``live``: the page reloads itself)."""
    data = json.dumps({**asdict(series), "live": live}, default=json_default)
    template = files("abstain_guard.monitor").joinpath("dashboard.html").read_text("utf-8")
    return template.replace("__SERIES__", data.replace("<", "\\u003c"))


def live_page(monitor: GuardMonitor) -> str:
    """The dashboard of a running ``monitor`` (the page reloads itself). Its replay takes
    about 1 s per 100,000 decisions kept: callers on an event loop run it in a thread."""
    return render_page(live_series(monitor), live=True)
