"""A write-ahead journal of the decisions a server has acknowledged but not yet fed to its
drift monitor, and the sticky health alarm of the path from a decision to the monitor log.

Every decision is appended, flushed and ``fsync``-ed to the :class:`DecisionJournal` before
it is acknowledged, and marked ``fed`` once the monitor log has it; a process that starts on
the same journal feeds what it holds and the log does not (:func:`recover`). A failed write
is never swallowed: :class:`FeedHealth` logs and counts it and turns ``/readyz`` unready (503).
docs/serving.md, "The drift monitor, feedback and the API key".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard.errors import DecisionJournalError
from abstain_guard.guarantee.decision import Decision

logger = logging.getLogger("abstain_guard.serve")

#: The journal is started afresh once nothing is pending and it is at least this big.
COMPACT_BYTES = 1 << 20


def journal_path(log_path: str | Path | None) -> Path | None:
    """Where the journal of the monitor log ``log_path`` lives (``<log>.journal``); None
    without a log (the monitor then lives in memory and nothing is durable)."""
    return None if log_path is None else Path(f"{log_path}.journal")


@dataclass(frozen=True)
class HeldDecision:
    """A decision the journal holds: its run id, the decision and its admission ticket
    (None: fed out of turn, e.g. a place taken before a restart)."""

    run_id: str
    decision: Decision
    ticket: int | None = None

    def line(self) -> str:
        """The journal line that holds it."""
        event = {"event": "held", "run_id": self.run_id, "ticket": self.ticket}
        return json.dumps({**event, "decision": self.decision.to_dict()}, default=_jsonable) + "\n"


def _jsonable(value: Any) -> Any:
    """What ``json.dumps`` cannot write itself: numpy scalars as Python numbers, anything
    else as its text (the monitor reads only numbers, flags and names)."""
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


class FeedHealth:
    """Failures on the way from a decision to the monitor log: each is logged as an error
    and counted, and any one makes ``/readyz`` unready for the rest of the process (the
    in-memory monitor and its log may disagree until a restart replays the journal)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.journal_failures = 0
        self.log_failures = 0
        self.last_error: str | None = None

    def failed(self, where: str, run_id: str, exc: BaseException) -> None:
        """Count a failed write of decision ``run_id`` (``where``: ``"journal"`` or
        ``"monitor log"``) and log it as an error."""
        message = (
            f"decision {run_id} could not be written to the {where}: {type(exc).__name__}: "
            f"{exc}. /readyz reports unready until the server restarts (the journal is "
            "replayed then); fix the disk or path first."
        )
        with self._lock:
            if where == "journal":
                self.journal_failures += 1
            else:
                self.log_failures += 1
            self.last_error = message
        logger.error(message)

    def describe(self) -> dict[str, Any]:
        """``{"ok", "journal_failures", "log_failures", "error"}`` (``/readyz``'s
        ``monitor``)."""
        with self._lock:
            return {
                "ok": self.journal_failures == 0 and self.log_failures == 0,
                "journal_failures": self.journal_failures,
                "log_failures": self.log_failures,
                "error": self.last_error,
            }


class DecisionJournal:
    """The write-ahead journal (see the module docstring): JSON lines ``{"event": "held",
    "run_id", "ticket", "decision"}`` and ``{"event": "fed", "run_id"}``.

    Args:
        path: the journal file (None: kept in memory only, nothing durable).
        fsync: whether each held decision is ``fsync``-ed before :meth:`hold` returns.
        compact_bytes: start the file afresh once nothing is pending and it is this big.
    """

    def __init__(
        self, path: str | Path | None, *, fsync: bool = True, compact_bytes: int = COMPACT_BYTES
    ) -> None:
        self.path = None if path is None else Path(path)
        self.fsync = fsync
        self.compact_bytes = compact_bytes
        self._lock = threading.Lock()
        self._pending: set[str] = set()

    @property
    def durable(self) -> bool:
        """Whether held decisions survive the process (a journal file)."""
        return self.path is not None

    def __len__(self) -> int:
        """Decisions held and not yet fed."""
        with self._lock:
            return len(self._pending)

    def _write(self, line: str, sync: bool) -> None:
        """Append one event ``line``; a write that fails is cut back off (so a later event
        never lands on a torn line)."""
        assert self.path is not None
        size = self.path.stat().st_size if self.path.exists() else 0
        try:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                if sync:
                    os.fsync(fh.fileno())
        except OSError:
            with contextlib.suppress(OSError):  # the error raised says what to fix
                os.truncate(self.path, size)
            raise

    def hold(self, run_id: str, decision: Decision, ticket: int | None = None) -> None:
        """Write ``decision`` (durably) before it is acknowledged.

        Raises:
            DecisionJournalError: it could not be written (the decision must not be
                acknowledged: answer the request 503).
        """
        with self._lock:
            if self.path is not None:
                try:
                    self._write(HeldDecision(run_id, decision, ticket).line(), self.fsync)
                except (OSError, TypeError, ValueError) as exc:
                    raise DecisionJournalError(
                        f"Cannot write decision {run_id} to the journal {self.path} ({exc}); "
                        "the request is refused so that no answer leaves unlogged. Fix the "
                        "disk or the --monitor-log path and restart the server."
                    ) from exc
            self._pending.add(run_id)

    def fed(self, run_id: str) -> None:
        """Mark ``run_id`` as in the monitor log (not ``fsync``-ed: a lost mark only makes
        :func:`recover` check the log for it).

        Raises:
            DecisionJournalError: the mark could not be written.
        """
        with self._lock:
            self._pending.discard(run_id)
            if self.path is None:
                return
            try:
                self._write(json.dumps({"event": "fed", "run_id": run_id}) + "\n", False)
                if not self._pending and self.path.stat().st_size >= self.compact_bytes:
                    self.path.write_text("", encoding="utf-8")
            except OSError as exc:
                raise DecisionJournalError(
                    f"Cannot mark decision {run_id} as logged in the journal {self.path} "
                    f"({exc}). Fix the disk or the --monitor-log path and restart the server."
                ) from exc

    def pending(self) -> list[HeldDecision]:
        """The decisions the journal file holds and has not marked fed, in admission order
        (ticket; those without one last, in journal order).

        Raises:
            DecisionJournalError: the file cannot be read or has a line that is not an event.
        """
        if self.path is None or not self.path.exists():
            return []
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise DecisionJournalError(f"Cannot read the journal {self.path}: {exc}") from exc
        held: dict[str, HeldDecision] = {}
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                kind, run_id = event["event"], str(event["run_id"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                if number == len(lines):  # a torn last line: its hold never returned
                    logger.warning("%s:%d: a torn last line is ignored", self.path, number)
                    continue
                raise DecisionJournalError(
                    f"{self.path}:{number}: not a journal event ({exc}); fix or remove the "
                    "line (the decisions it held may then be missing from the monitor log)."
                ) from exc
            if kind == "held":
                decision = Decision.from_dict(event["decision"])
                held[run_id] = HeldDecision(run_id, decision, event.get("ticket"))
            elif kind == "fed":
                held.pop(run_id, None)
        return sorted(held.values(), key=lambda h: (h.ticket is None, h.ticket or 0))

    def reset(self, keep: list[HeldDecision] | None = None) -> None:
        """Start the file afresh, holding only ``keep``."""
        with self._lock:
            self._pending = {h.run_id for h in keep or []}
            if self.path is None:
                return
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.writelines(h.line() for h in keep or [])
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)


def recover(
    journal: DecisionJournal,
    feed: Callable[[Decision, str], Any],
    logged: Callable[[str], bool],
) -> int:
    """Feed every decision ``journal`` holds that the monitor log does not (``logged(run_id)``
    False), in admission order, then start the journal afresh; returns how many were fed.

    Raises:
        DecisionJournalError: the journal cannot be read; or feeding failed (the decisions
            not yet fed stay in the journal for the next start).
    """
    held = journal.pending()
    fed = 0
    for i, entry in enumerate(held):
        if logged(entry.run_id):
            continue
        try:
            feed(entry.decision, entry.run_id)
        except Exception as exc:
            journal.reset(held[i:])
            raise DecisionJournalError(
                f"Replaying decision {entry.run_id} from the journal {journal.path} into the "
                f"monitor failed ({type(exc).__name__}: {exc}); it stays in the journal. Fix "
                "the monitor log's disk or path and start again."
            ) from exc
        fed += 1
    journal.reset()
    if fed:
        logger.warning(
            "the drift monitor fed %d decision(s) from the journal %s that were answered but "
            "not yet in the monitor log when the last process stopped",
            fed,
            journal.path,
        )
    return fed
