"""Writing and resuming a :class:`~abstain_guard.GuardMonitor`'s log.

:class:`MonitorLogMixin` holds the monitor's log methods: the ``start`` header (what a
resume must agree on), appending events as they happen (``log_path``), writing a snapshot
(:meth:`~MonitorLogMixin.write_log`), and resuming: reading an existing log, checking its
header against the monitor's settings and replaying its decisions and feedback in logged
order. The log's format and reader are :mod:`abstain_guard.monitor.log`.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from abstain_guard.errors import MonitorLogError
from abstain_guard.guarantee.decision import DecisionRule
from abstain_guard.monitor.log import LOG_FORMAT, MonitorRecord, json_default, write_events
from abstain_guard.monitor.scope import Alarm, Scope, json_round_trip, now

logger = logging.getLogger("abstain_guard")

#: The header fields a resumed log must agree on with the monitor that resumes it, named.
_RESUME_KEYS = {
    "seed": "seed",
    "rule": "rule",
    "groups": "set of group rules",
    "tests": "monitor settings (false_alarm, feedback_false_alarm, jump, risk_target, sharing)",
}


class MonitorLogMixin:
    """The log methods of :class:`~abstain_guard.GuardMonitor` (which sets the
    attributes annotated here in ``__init__`` and ``fit``)."""

    false_alarm: float
    feedback_false_alarm: float | None
    jump: float
    risk_target: float | None
    max_records: int
    log_path: str | Path | None
    seed_: int
    rule_: DecisionRule
    source_: dict[str, Any]
    grouped_: bool
    sharing_: str | None
    scopes_: dict[str | None, Scope]
    thresholds_: dict[str, float]
    records_: OrderedDict[str, MonitorRecord]
    alarms_: list[Alarm]
    decisions_: int
    _alarm_times: dict[tuple[str, str | None], str]

    if TYPE_CHECKING:

        def _fitted(self) -> None: ...

        def records(self) -> list[MonitorRecord]: ...

        @property
        def alarms(self) -> list[Alarm]: ...

        def _apply_decision(self, record: MonitorRecord) -> list[Alarm]: ...

        def _apply_feedback(
            self, record: MonitorRecord, correct: bool, time: str | None
        ) -> list[Alarm]: ...

    # --- the log -------------------------------------------------------------------------

    def _header(self, snapshot: bool = False) -> dict[str, Any]:
        """The log's ``start`` header: the artifact, the rule (and each tested group's), the
        tests' settings and the seed (what a resume must agree on). ``snapshot``: written
        by :meth:`write_log` (the kept records, not a history to resume)."""
        rule = self.rule_
        header: dict[str, Any] = {
            "format": LOG_FORMAT,
            "version": 2,
            "time": now(),
            "seed": self.seed_,
            "source": dict(self.source_),
            "rule": {"mode": rule.mode, "target": rule.target, "threshold": rule.threshold},
            "groups": None if not self.grouped_ else {
                str(s.name): s.describe() for s in self.scopes_.values()},
            "tests": {"false_alarm": self.false_alarm,
                      "feedback_false_alarm": self.feedback_false_alarm, "jump": self.jump,
                      "risk_target": self.risk_target, "sharing": self.sharing_,
                      "thresholds": dict(self.thresholds_)},
        }  # fmt: skip
        if snapshot:
            header["snapshot"] = True
        return header

    def _append(self, event: Mapping[str, Any]) -> None:
        assert self.log_path is not None
        with open(self.log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(event, default=json_default) + "\n")

    def write_log(self, path: str | Path) -> Path:
        """Write the kept records (decisions with their feedback) as a monitor log (JSONL:
        a ``start`` header, then ``decision`` and ``feedback`` events) — a snapshot for
        ``abstain-guard recalibrate``, not a log to resume from (``log_path`` is that)."""
        self._fitted()
        target = Path(path)
        with open(target, "w", encoding="utf-8") as fh:
            write_events(
                fh, self._header(snapshot=True), self.records(), [asdict(a) for a in self.alarms]
            )
        return target

    # --- resuming ------------------------------------------------------------------------

    def _read_events(self) -> list[dict[str, Any]]:
        """The events of the existing log at ``log_path`` in file order (``[]``: none).

        Raises:
            MonitorLogError: a line is not a JSON event, or the log does not open with the
                start header of a monitor log.
        """
        if self.log_path is None:
            return []
        path = Path(self.log_path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        except (OSError, UnicodeDecodeError) as exc:
            raise MonitorLogError(f"Cannot read the monitor log {path}: {exc}") from exc
        events: list[dict[str, Any]] = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                event["line"] = number
                if "event" not in event:
                    raise KeyError("event")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise MonitorLogError(
                    f"{path}:{number}: not a monitor log event ({exc}); the monitor resumes "
                    "from this log: fix or remove the line, or log to a new file."
                ) from exc
            events.append(event)
        if events and (events[0]["event"] != "start" or events[0].get("format") != LOG_FORMAT):
            raise MonitorLogError(f"{path}: not an abstain_guard monitor log (no start header).")
        return events

    def _check_header(self, event: Mapping[str, Any]) -> None:
        """Refuse to resume a log whose start header another artifact, rule or monitor
        setting wrote (its tests are not this monitor's), or a snapshot."""
        where = f"{self.log_path}:{event['line']}"
        new_log = "log to a new file (--monitor-log): "
        if event.get("snapshot"):
            raise MonitorLogError(
                f"{where}: a snapshot written by write_log (the kept records only) cannot be "
                f"resumed; {new_log}log_path is the log a monitor resumes from."
            )
        logged_sha = event.get("source", {}).get("calibration_sha256")
        if logged_sha != self.source_["calibration_sha256"]:
            raise MonitorLogError(
                f"{where}: this log monitors another artifact (another calibration set); "
                f"{new_log}one log per artifact."
            )
        mine = json_round_trip(self._header())
        for key, label in _RESUME_KEYS.items():
            if event.get(key) != mine[key]:
                raise MonitorLogError(
                    f"{where}: this log was written with another {label} ({event.get(key)!r}, now "
                    f"{mine[key]!r}); resuming it would change the tests midway. Restart with "
                    f"the same settings, or {new_log}one log per rule and monitor setting."
                )

    def _replay(self, events: list[dict[str, Any]]) -> dict[str, int]:
        """Replay the logged decisions and feedback in file order (the tests draw the same
        uniforms: the seed is the log's); alarms are recomputed, not raised again.

        Returns:
            ``{"decisions": d, "feedback": f, "alarms": a}`` replayed.

        Raises:
            MonitorLogError: a header another setting wrote, a gap in the decisions' indices,
                feedback for an unknown or labeled decision, or a p-value that does not replay.
        """
        fields = set(MonitorRecord.__dataclass_fields__)
        self._alarm_times = {
            (str(e.get("test")), e.get("group")): str(e.get("time"))
            for e in events if e["event"] == "alarm"
        }  # fmt: skip
        n_feedback = 0
        for event in events:
            kind, where = event["event"], f"{self.log_path}:{event['line']}"
            if kind == "start":
                self._check_header(event)
            elif kind == "decision":
                record = self._logged_record(event, fields, where)
                logged_p = record.p_value
                record.p_value = None
                self._apply_decision(record)
                if record.p_value != logged_p:
                    raise MonitorLogError(
                        f"{where}: the replayed p-value {record.p_value!r} is not the logged "
                        f"{logged_p!r}: the log was not written by this monitor's tests; log to "
                        "a new file."
                    )
                self.records_[record.run_id] = record
            elif kind == "feedback":
                labeled = self.records_.get(str(event.get("run_id")))
                if labeled is None or labeled.correct is not None:
                    why = "no earlier decision" if labeled is None else "an already labeled one"
                    raise MonitorLogError(f"{where}: feedback for {why} ({event.get('run_id')!r}).")
                self._apply_feedback(labeled, bool(event.get("correct")), event.get("time"))
                n_feedback += 1
            elif kind != "alarm":
                raise MonitorLogError(f"{where}: unknown event {kind!r}.")
        while len(self.records_) > int(self.max_records):
            self.records_.popitem(last=False)
        self._alarm_times = {}
        replayed = {"decisions": self.decisions_, "feedback": n_feedback,
                    "alarms": len(self.alarms_)}  # fmt: skip
        logger.info("abstain_guard monitor: resumed %s from %s", replayed, self.log_path)
        return replayed

    def _logged_record(
        self, event: Mapping[str, Any], fields: set[str], where: str
    ) -> MonitorRecord:
        """The decision record of a logged ``decision`` event, the next in index order."""
        try:
            record = MonitorRecord(**{k: v for k, v in event.items() if k in fields})
        except TypeError as exc:
            raise MonitorLogError(f"{where}: malformed decision ({exc}).") from exc
        if record.index != self.decisions_ + 1 or record.run_id in self.records_:
            raise MonitorLogError(
                f"{where}: decision {record.index} ({record.run_id!r}) does not follow decision "
                f"{self.decisions_}: the log is not one monitor's whole history; log to a new "
                "file."
            )
        return record
