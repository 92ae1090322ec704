"""The monitor log: a JSONL file of a :class:`~abstain_guard.GuardMonitor`'s events
(``start`` headers naming the artifact's calibration set and rule, ``decision`` records,
``feedback`` labels, ``alarm`` events), appended as they happen (``log_path``) or written at
once (``GuardMonitor.write_log``); ``abstain-guard recalibrate`` reads it."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from abstain_guard.errors import MonitorLogError

LOG_FORMAT = "abstain_guard.monitor_log"


@dataclass
class MonitorRecord:
    """One observed decision (and its feedback, once given).

    ``censored``: the score is a lower bound (a step-gated agent run stopped before its end:
    its running maximum so far); the exchangeability test ranks it only as above
    ``threshold``. ``action``: where a stopped run went (``"end"``, ``"interrupt"`` when a
    human approved or edited it, ``"fallback"``).
    """

    index: int
    run_id: str
    time: str
    score: float | None
    abstained: bool
    threshold: float
    group: str | None = None
    action: str | None = None
    p_value: float | None = None
    correct: bool | None = None
    feedback_time: str | None = None
    censored: bool = False


def json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON-serializable: {type(value).__name__}")


def write_events(
    fh: IO[str],
    header: Mapping[str, Any],
    records: list[MonitorRecord],
    alarms: Sequence[Mapping[str, Any]] = (),
) -> None:
    """Write a whole log: the ``start`` header, each decision (and its feedback), then the
    alarms raised."""
    fh.write(json.dumps({"event": "start", **header}, default=json_default) + "\n")
    for rec in records:
        fh.write(json.dumps({"event": "decision", **asdict(rec)}, default=json_default) + "\n")
        if rec.correct is not None:
            feedback = {"event": "feedback", "run_id": rec.run_id, "correct": rec.correct,
                        "time": rec.feedback_time}  # fmt: skip
            fh.write(json.dumps(feedback) + "\n")
    for alarm in alarms:
        fh.write(json.dumps({"event": "alarm", **alarm}, default=json_default) + "\n")


def read_log(path: str | Path) -> tuple[dict[str, Any], list[MonitorRecord]]:
    """The header (with the log's ``alarms``) and the decisions (feedback joined) of a
    monitor log.

    A log appended across restarts holds several ``start`` headers; they must name the
    same calibration set (one artifact), and the decisions are returned in file order.

    Raises:
        MonitorLogError: unreadable, not a monitor log, mixed artifacts, feedback for an
            unknown run id, or a malformed line (named by its line number).
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise MonitorLogError(f"Cannot read the monitor log {p}: {exc}") from exc
    header: dict[str, Any] | None = None
    records: dict[str, MonitorRecord] = {}
    fields = set(MonitorRecord.__dataclass_fields__)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{number}"
        try:
            event = json.loads(line)
            kind = event.pop("event")
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
            raise MonitorLogError(f"{where}: not a monitor log event ({exc}).") from exc
        if kind == "start":
            if event.get("format") != LOG_FORMAT:
                raise MonitorLogError(f"{where}: not an abstain_guard monitor log.")
            if header is not None and event.get("source", {}).get(
                "calibration_sha256"
            ) != header.get("source", {}).get("calibration_sha256"):
                raise MonitorLogError(
                    f"{where}: this log mixes decisions of two artifacts (another calibration "
                    "set starts here); split it, one log per artifact."
                )
            header = header or event
        elif header is None:
            raise MonitorLogError(f"{where}: a {kind!r} event before the log's start header.")
        elif kind == "decision":
            try:
                rec = MonitorRecord(**{k: v for k, v in event.items() if k in fields})
            except TypeError as exc:
                raise MonitorLogError(f"{where}: malformed decision ({exc}).") from exc
            records[rec.run_id] = rec
        elif kind == "feedback":
            labeled = records.get(str(event.get("run_id")))
            if labeled is None:
                raise MonitorLogError(
                    f"{where}: feedback for run id {event.get('run_id')!r}, which no earlier "
                    "decision in the log has."
                )
            labeled.correct = bool(event.get("correct"))
            labeled.feedback_time = event.get("time")
        elif kind == "alarm":
            header.setdefault("alarms", []).append(event)
        else:
            raise MonitorLogError(f"{where}: unknown event {kind!r}.")
    if header is None:
        raise MonitorLogError(f"{p} has no start header: not a monitor log.")
    return header, list(records.values())
