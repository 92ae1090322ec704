"""The selection ledger: every scorer and rule evaluated on an artifact's calibration
answers, so that K in δ/K is counted from a record, not by hand (:mod:`.selection`).

A JSON-lines file beside the artifact's files (``ledger.jsonl``), appended to and never
checksummed; one line is one :class:`LedgerEntry`. Looks made outside the library are added
by hand as ``by: "audit"`` entries with their evidence (docs/guarantees.md, "K from a
record: the selection ledger").
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

from abstain_guard.errors import InvalidInputError

CALIBRATION_ANSWERS = "calibration"
"""``answers`` of an entry that read the calibration answers (with or without others)."""

KINDS = ("scorer", "rule")


@dataclass(frozen=True)
class LedgerEntry:
    """One scorer or rule evaluated on (some of) an artifact's answers.

    Attributes:
        name: the scorer kind (``probe_mid``) or a rule's name (``chunk_rule:every_8``);
            one candidate however often it is evaluated.
        kind, by, at: ``"scorer"`` or ``"rule"``; what evaluated it (``"evaluate"``,
            ``"audit"``, ...); when (ISO-8601 UTC).
        answers: ``"calibration"`` (with or without others) counts towards K; ``"test"``
            or ``"selection"`` does not.
        evidence: for an audit entry, where the evaluation is recorded.
    """

    name: str
    kind: Literal["scorer", "rule"]
    by: str
    at: str
    answers: str = CALIBRATION_ANSWERS
    evidence: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise InvalidInputError(f"a ledger entry needs a non-empty name, got {self.name!r}.")
        if self.kind not in KINDS:
            raise InvalidInputError(
                f"ledger entry {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}."
            )

    @property
    def reads_calibration(self) -> bool:
        """Whether this evaluation read calibration answers (it then counts towards K)."""
        return CALIBRATION_ANSWERS in self.answers.split("+")

    @classmethod
    def now(
        cls,
        name: str,
        *,
        by: str,
        kind: Literal["scorer", "rule"] = "scorer",
        answers: str = CALIBRATION_ANSWERS,
        evidence: str = "",
    ) -> LedgerEntry:
        """An entry stamped with the current UTC time."""
        at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        return cls(name=name, kind=kind, by=by, at=at, answers=answers, evidence=evidence)


def parse_ledger(text: str, source: str = "ledger.jsonl") -> list[LedgerEntry]:
    """The entries of a JSON-lines ledger (blank lines skipped).

    Raises:
        InvalidInputError: a line that is not a JSON object with the entry's fields.
    """
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            entries.append(
                LedgerEntry(
                    name=row["name"],
                    kind=row["kind"],
                    by=str(row["by"]),
                    at=str(row["at"]),
                    answers=str(row.get("answers", CALIBRATION_ANSWERS)),
                    evidence=str(row.get("evidence", "")),
                )
            )
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidInputError(
                f"{source} line {number} is not a ledger entry ({exc!r}): each line must be a "
                'JSON object with "name", "kind", "by" and "at". Repair or remove that line; '
                "removing entries lowers K below what was looked at."
            ) from exc
    return entries


def ledger_lines(entries: Iterable[LedgerEntry]) -> str:
    """``entries`` as JSON lines (the inverse of :func:`parse_ledger`)."""
    return "".join(json.dumps(asdict(e), sort_keys=True) + "\n" for e in entries)


def looked_at(entries: Iterable[LedgerEntry]) -> tuple[str, ...]:
    """The distinct names of the entries that read calibration answers, first seen first."""
    names: dict[str, None] = {}
    for entry in entries:
        if entry.reads_calibration:
            names.setdefault(entry.name, None)
    return tuple(names)
