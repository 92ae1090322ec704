"""Reading QA items from a JSON Lines or CSV/TSV file with a field mapping.

:func:`load_dataset` maps fields (dotted paths such as ``"question.stem"``) to
:class:`~abstain_guard.calibration.building.questions.datasets.QAItem`; rows without a question or
an answer are skipped and *reported* with their line numbers in :class:`DatasetReport` (and a
logging warning), never silently.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from abstain_guard.errors import DatasetError, InvalidInputError

from .conversations import conversation_fields, json_type_name
from .datasets import KINDS, Kind, QAItem, choice_letter
from .tool_labels import tool_label_fields

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SkippedRow:
    """A row that was not loaded: its 1-based line number and the reason."""

    line: int
    reason: str


@dataclass
class DatasetReport:
    """What a reader did: rows seen, items loaded, rows skipped (with line numbers and reasons)."""

    source: str
    rows: int = 0
    loaded: int = 0
    skipped: list[SkippedRow] = field(default_factory=list)
    limited: bool = False
    log: bool = field(default=True, repr=False, compare=False)


# --- field access ------------------------------------------------------------------------


_MISSING = object()


def _get_path(row: Any, path: str) -> Any:
    """Follow a dotted path (``"question.stem"``, ``"answers.0"``) into nested dicts/lists."""
    value = row
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif (
            isinstance(value, list)
            and part.lstrip("-").isdigit()
            and -len(value) <= int(part) < len(value)
        ):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def _field(row: Any, path: str) -> Any:
    """:func:`_get_path`, with None for a missing field."""
    value = _get_path(row, path)
    return None if value is _MISSING else value


def _is_blank(value: Any) -> bool:
    if value is _MISSING or value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, tuple)):
        return not any(not _is_blank(v) for v in value)
    return False


def _check_text(value: Any, what: str, *, numbers: bool = False) -> None:
    """Raise ValueError unless ``value`` is a string (or a number where ``numbers``): a JSON
    boolean, object or number would otherwise become a gold string such as ``"True"``."""
    if isinstance(value, str):
        return
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        return
    hint = " (or set kind: numeric for numeric answers)" if isinstance(value, (int, float)) else ""
    raise ValueError(
        f"{what} is a JSON {json_type_name(value)} ({str(value)[:40]!r}), not a string; write it "
        f"as a string{hint}"
    )


def _as_aliases(value: Any, sep: str | None) -> tuple[str, ...]:
    """Gold aliases from a string or a list of strings; de-duplicated, order kept.

    Raises:
        ValueError: an alias is a number, boolean, object or nested list.
    """
    if isinstance(value, (list, tuple)):
        for v in value:
            if not _is_blank(v):
                _check_text(v, "an answer alias")
        raw = [str(v) for v in value if not _is_blank(v)]
    elif sep is not None and isinstance(value, str):
        raw = value.split(sep)
    else:
        _check_text(value, "the answer")
        raw = [str(value)]
    out: list[str] = []
    for alias in raw:
        alias = alias.strip()
        if alias and alias not in out:
            out.append(alias)
    return tuple(out)


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


def _numeric_gold(value: Any) -> str:
    """The gold number of a numeric answer: the text after the last ``####`` (GSM8K) or the
    value itself, without thousands separators or a trailing ``.0``."""
    _check_text(value, "the answer", numbers=True)
    text = str(value).strip()
    m = _GSM8K_FINAL.search(text)
    if m:
        text = m.group(1)
    text = text.replace(",", "").replace("$", "").strip()
    try:
        number = float(text)
    except ValueError as exc:
        raise ValueError(f"numeric answer {str(value)[-40:]!r} has no final number") from exc
    if number.is_integer():
        return str(int(number))
    return repr(number)


def _choice_texts(value: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(labels, texts) from a list of strings or of ``{"label", "text"}`` dicts."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("choices must be a non-empty list")
    labels: list[str] = []
    texts: list[str] = []
    for i, c in enumerate(value):
        if isinstance(c, Mapping):
            text = c.get("text")
            label = c.get("label", choice_letter(i))
        else:
            text, label = c, choice_letter(i)
        if _is_blank(text):
            raise ValueError(f"option {i + 1} has no text")
        _check_text(text, f"option {i + 1}", numbers=True)
        labels.append(str(label).strip())
        texts.append(str(text).strip())
    return tuple(labels), tuple(texts)


def _choice_gold(value: Any, labels: Sequence[str], texts: Sequence[str]) -> tuple[str, str]:
    """(letter, option text) of the gold option, given as a label, a 0-based index or the text."""
    if isinstance(value, (list, tuple)):
        value = value[0]
    _check_text(value, "the gold option", numbers=True)
    if isinstance(value, int) and not isinstance(value, bool):
        index = value
    else:
        s = str(value).strip()
        if s in labels:
            index = list(labels).index(s)
        elif s.upper() in [lab.upper() for lab in labels]:
            index = [lab.upper() for lab in labels].index(s.upper())
        elif s in texts:
            index = list(texts).index(s)
        elif s.isdigit():
            index = int(s)
        else:
            raise ValueError(f"gold {s!r} is neither an option label, an index nor an option text")
    if not 0 <= index < len(texts):
        raise ValueError(f"gold option index {index} is outside the {len(texts)} options")
    return choice_letter(index), texts[index]


# --- row sources ---------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    """The file as text (UTF-8, an optional BOM dropped).

    Raises:
        DatasetError: the file cannot be read, or is not UTF-8 (naming the line and column
            of the first bad byte).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DatasetError(
            f"{path} line {line} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at byte "
            f"column {column}). Save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 "
            f"{path.name} > fixed{path.suffix}`."
        ) from exc


def _iter_jsonl(path: Path, report: DatasetReport) -> Iterator[tuple[int, Any]]:
    for lineno, raw in enumerate(_read_text(path).split("\n"), start=1):
        raw = raw.rstrip("\r")  # the column of an error is then within the line
        if not raw.strip():
            continue
        report.rows += 1
        try:
            yield lineno, json.loads(raw)
        except json.JSONDecodeError as exc:
            _skip(report, lineno, f"invalid JSON ({exc.msg} at column {exc.colno})")


def _iter_csv(path: Path, report: DatasetReport, delimiter: str) -> Iterator[tuple[int, Any]]:
    with io.StringIO(_read_text(path), newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        if reader.fieldnames is None:
            return
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                report.rows += 1
                _skip(report, start, f"malformed CSV ({exc})")
                continue
            report.rows += 1
            yield start, row


def _skip(report: DatasetReport, line: int, reason: str) -> None:
    report.skipped.append(SkippedRow(line, reason))
    if report.log:
        logger.warning("%s line %d skipped: %s", report.source, line, reason)


def _rows(path: Path, report: DatasetReport) -> Iterator[tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        if suffix == ".json":
            with path.open(encoding="utf-8-sig") as f:
                head = f.read(64).lstrip()
            if head.startswith("["):
                raise DatasetError(
                    f"{path} is a JSON array; convert it to JSON Lines (one object per line), "
                    "e.g. with `jq -c '.[]' file.json > file.jsonl`"
                )
        return _iter_jsonl(path, report)
    if suffix == ".csv":
        return _iter_csv(path, report, ",")
    if suffix == ".tsv":
        return _iter_csv(path, report, "\t")
    raise DatasetError(
        f"cannot read {path}: unknown extension {suffix!r}; use .jsonl, .ndjson, .csv or .tsv"
    )


# --- the generic reader --------------------------------------------------------------------


@dataclass(frozen=True)
class Fields:
    """Where a row holds each part of a QA item: dotted paths such as ``"question.stem"``.

    Attributes:
        answers: a string or a list of string aliases (a number only for ``kind="numeric"``,
            or an option index for ``"choice"``; a boolean or an object is a malformed row).
        choices: the options (a list of strings or of ``{"label", "text"}``); makes the items
            ``kind="choice"``, the answer then being a label, index or text.
        kind: default ``"choice"`` when ``choices`` is given, else ``"open"``; for
            ``"numeric"`` the gold number is the text after the last ``####`` (GSM8K) or the
            answer itself.
        id_field: default ids are ``"<id_prefix>:<line>"``, the prefix defaulting to the file
            name without extension.
        answer_sep: split string answers on it (``"; "`` for TruthfulQA CSV).
        history, conversation_id: a conversation row's fields (docs/agents.md,
            'Conversations'); None: no such field.
        answers_optional: an open question without a gold answer is kept (an LLM judge
            decides without a reference) instead of skipped.
    """

    question: str = "question"
    answers: str = "answer"
    choices: str | None = None
    kind: Kind | None = None
    group_by: str | None = None
    id_field: str | None = None
    popularity: str | None = None
    answer_sep: str | None = None
    id_prefix: str | None = None
    history: str | None = "history"
    conversation_id: str | None = "conversation_id"
    answers_optional: bool = False

    def resolved(self, path: Path) -> Fields:
        """These fields with the kind, the id prefix and ``answers_optional`` settled.

        Raises:
            InvalidInputError: an unknown kind, or ``"choice"`` without a ``choices`` field.
        """
        if self.kind is not None and self.kind not in KINDS:
            raise InvalidInputError(f"kind must be one of {KINDS}, got {self.kind!r}")
        kind: Kind = self.kind or ("choice" if self.choices else "open")
        if kind == "choice" and not self.choices:
            raise InvalidInputError("kind='choice' needs the `choices` field")
        return replace(
            self,
            kind=kind,
            id_prefix=self.id_prefix or path.stem,
            answers_optional=self.answers_optional and kind == "open",
        )


def load_dataset(
    path: str | Path,
    fields: Fields | None = None,
    *,
    limit: int | None = None,
    log_skipped: bool = True,
) -> tuple[list[QAItem], DatasetReport]:
    """Read QA items from a JSON Lines or CSV/TSV file (``.jsonl``/``.ndjson``/``.json``
    lines, ``.csv``, ``.tsv``) whose rows hold them where ``fields`` says (default
    :class:`Fields`).

    ``limit`` stops after that many loaded items; ``log_skipped=False`` logs no warning per
    skipped row (for callers that report the rows themselves).

    Returns:
        ``(items, report)``; rows without a question or answer, or with a malformed value, are
        skipped and listed in ``report.skipped`` with their line numbers (and logged).

    Raises:
        DatasetError: the file is missing or unreadable (not UTF-8: naming the line), or no
            row could be used.
    """
    p = Path(path)
    if not p.is_file():
        raise DatasetError(
            f"data file {p} not found; pass a JSONL/CSV file path, or 'builtin' for the probe set"
        )
    if limit is not None and limit < 1:
        raise InvalidInputError(f"limit must be a positive integer, got {limit}")
    mapping = (fields or Fields()).resolved(p)
    report = DatasetReport(source=str(p), log=log_skipped)
    items: list[QAItem] = []
    try:
        for lineno, row in _rows(p, report):
            if limit is not None and len(items) >= limit:
                report.rows -= 1
                report.limited = True
                break
            try:
                items.append(_row_to_item(row, lineno, p, mapping))
            except _Skipped as exc:
                _skip(report, lineno, str(exc))
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read {p}: {exc}") from exc
    report.loaded = len(items)
    if not items:
        reasons = "; ".join(f"line {s.line}: {s.reason}" for s in report.skipped[:3])
        raise DatasetError(
            f"{p} has no usable rows ({report.rows} rows read"
            + (f"; e.g. {reasons}" if reasons else "")
            + f"). Check the field mapping: question={mapping.question!r}, "
            f"answers={mapping.answers!r}"
        )
    return items, report


class _Skipped(Exception):
    """A row that cannot become an item; the message is the reason reported for its line."""


def _row_to_item(row: Any, lineno: int, path: Path, fields: Fields) -> QAItem:
    """The item of one row under :meth:`Fields.resolved` fields.

    Raises:
        _Skipped: the row has no question or answer, or a malformed value.
    """
    if not isinstance(row, Mapping):
        raise _Skipped(f"row is a {type(row).__name__}, not an object")
    q = _get_path(row, fields.question)
    if _is_blank(q):
        raise _Skipped(f"missing question (field {fields.question!r})")
    if not isinstance(q, str):
        raise _Skipped(f"the question (field {fields.question!r}) is a JSON {json_type_name(q)}")
    aliases, option_texts = _gold(row, fields)
    try:
        turns, conversation = conversation_fields(
            {f: _field(row, f) for f in (fields.history, fields.conversation_id) if f is not None},
            fields.history,
            fields.conversation_id,
        )
        calls, ordered = tool_label_fields(
            {f: _field(row, f) for f in ("expected_tool_calls", "tool_calls_ordered")}
        )
    except ValueError as exc:
        raise _Skipped(str(exc)) from exc
    raw_id = _optional(row, fields.id_field)
    assert fields.kind is not None
    return QAItem(
        id=f"{fields.id_prefix}:{lineno}" if raw_id is None else str(raw_id),
        question=" ".join(str(q).split()),
        answers=aliases,
        kind=fields.kind,
        choices=option_texts,
        group=None if (g := _optional(row, fields.group_by)) is None else str(g),
        popularity=_popularity(_optional(row, fields.popularity)),
        source=str(path),
        line=lineno,
        history=turns,
        conversation=conversation,
        expected_tool_calls=calls,
        tool_calls_ordered=ordered,
    )


def _gold(row: Mapping[str, Any], fields: Fields) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(gold aliases, option texts)`` of a row (no option texts unless ``kind="choice"``).

    Raises:
        _Skipped: no answer (unless ``answers_optional``), no choices, or a malformed one.
    """
    missing = _Skipped(f"missing answer (field {fields.answers!r})")
    a = _get_path(row, fields.answers)
    if _is_blank(a) and not fields.answers_optional:
        raise missing
    option_texts: tuple[str, ...] = ()
    try:
        if fields.kind == "choice":
            assert fields.choices is not None
            c = _get_path(row, fields.choices)
            if _is_blank(c):
                raise _Skipped(f"missing choices (field {fields.choices!r})")
            labels, option_texts = _choice_texts(c)
            aliases: tuple[str, ...] = _choice_gold(a, labels, option_texts)
        elif fields.kind == "numeric":
            aliases = (_numeric_gold(a[0] if isinstance(a, (list, tuple)) else a),)
        else:
            aliases = () if _is_blank(a) else _as_aliases(a, fields.answer_sep)
    except ValueError as exc:
        raise _Skipped(f"malformed answer: {exc}") from exc
    if not aliases and not fields.answers_optional:
        raise missing
    return aliases, option_texts


def _optional(row: Mapping[str, Any], path: str | None) -> Any:
    """The value at ``path``, None where no path is given or the value is blank."""
    if path is None:
        return None
    value = _get_path(row, path)
    return None if _is_blank(value) else value


def _popularity(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None
