"""Which questions a calibration run uses, checked before any model is loaded: loading them
from the built-in probe set, a named public set, a file or a list; dropping or refusing
questions no judge could grade; and the split sizes the targets need."""

from __future__ import annotations

import logging
import unicodedata
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from abstain_guard.errors import DatasetError, InsufficientDataError
from abstain_guard.guarantee import conformal
from abstain_guard.guarantee.conformal import ConformalWarning
from abstain_guard.guarantee.frontier import perfect_scorer_certifies

from ..run.calibration_config import FIT_SCORERS, CalibrationConfig
from ..run.store import content_key
from .agent_questions import LOOKUP_RELATIONS, lookup_questions
from .answer_text import alias_tokens
from .dataset_files import Fields, load_dataset
from .datasets import QAItem
from .named_datasets import NAMED_DATASETS, load_named_dataset
from .probe import builtin_probe_set

logger = logging.getLogger("abstain_guard.calibration")

BUILTIN_LOOKUP = "builtin-lookup"
"""The lookup agent's questions with their expected tool calls
(:func:`~.agent_questions.lookup_questions`, for ``examples/lookup_agent.py``);
``"builtin-lookup:capital,state_capital"``: those relations."""


def judges_without_reference(judge: Any) -> bool:
    """Whether the judge spec is an LLM judge, which can decide without a gold answer (a
    file's rows may then be questions only)."""
    name = judge if isinstance(judge, str) else (judge or {}).get("name", judge.get("type"))
    return str(name).strip().lower() == "llm"


def lookup_relations(data: str) -> list[str] | None:
    """The relations of ``"builtin-lookup"`` (all of them) or
    ``"builtin-lookup:capital,city_state"``; None for any other data."""
    name, sep, rest = data.partition(":")
    if name != BUILTIN_LOOKUP:
        return None
    chosen = [r.strip() for r in rest.split(",") if r.strip()] if sep else []
    return chosen or list(LOOKUP_RELATIONS)


def min_calibration_size(participation: float) -> int:
    """Smallest calibration split with a finite threshold at this participation target."""
    return conformal.min_calibration_size(1.0 - participation)


def named_spec(data: str) -> tuple[str, str] | None:
    """``("sciq", "/data/sciq")`` for ``"sciq=/data/sciq"`` when the name is a known format."""
    name, sep, root = data.partition("=")
    if sep and name in NAMED_DATASETS:
        return name, root
    return None


def builtin_relations(data: str) -> list[str] | None:
    """``["capital", "currency"]`` for ``"builtin:capital,currency"`` (some relations of the
    probe set), else None."""
    name, sep, rest = data.partition(":")
    if name != "builtin" or not sep:
        return None
    return [r.strip() for r in rest.split(",") if r.strip()]


def load_items(
    data: str | Path | Sequence[QAItem], config: CalibrationConfig
) -> tuple[list[QAItem], int]:
    """Questions from ``"builtin"`` (``"builtin:capital,currency"``: those relations),
    ``"builtin-lookup"`` (the lookup agent's questions with expected tool calls;
    ``"builtin-lookup:capital"``: a relation), ``"<name>=<path>"`` (a named reader such as
    ``sciq=/data/sciq``), a JSONL/CSV file, or a list; returns (items, skipped row count)."""
    if not isinstance(data, (str, Path)):
        items, skipped = _unique(list(data), config)
    elif (built := _builtin_items(str(data), config.seed)) is not None:
        items, skipped = _unique(built, config)
    elif (named := named_spec(str(data))) is not None:
        items, skipped = _named_items(*named, str(data))
    else:
        items, skipped = _file_items(Path(data), config)
    free = judges_without_reference(config.judge)  # question-only rows: an LLM judge
    _, bad = split_unjudgeable([it for it in items if it.answers or not free])
    if bad:
        raise DatasetError(
            f"{len(bad)} questions in {data} have gold answers that are empty or only articles "
            f"('the', 'a'), so no answer could ever be judged correct: {', '.join(bad[:10])}. "
            "Give them real gold answers or remove them."
        )
    if config.limit is not None:
        items = items[: config.limit]
    if not items:
        raise DatasetError(f"No usable questions in {data}.")
    return items, skipped


def _builtin_items(data: str, seed: int) -> list[QAItem] | None:
    """The built-in questions ``data`` names, or None when it names none."""
    if data == "builtin":
        return builtin_probe_set(seed=seed)
    if (relations := builtin_relations(data)) is not None:
        return builtin_probe_set(relations=relations, seed=seed)
    if (relations := lookup_relations(data)) is not None:
        return lookup_questions(relations=relations, seed=seed)
    return None


def _unique(items: list[QAItem], config: CalibrationConfig) -> tuple[list[QAItem], int]:
    """Built-in or given questions without repeats (refused unless ``skip_bad_rows``)."""
    items, duplicates = split_duplicates(items)
    _reject_or_skip(duplicates, config, "the questions")
    return items, len(duplicates)


def _named_items(name: str, root: str, data: str) -> tuple[list[QAItem], int]:
    """A public set's questions: its broken golds and repeats dropped, counted and logged."""
    items, report = load_named_dataset(name, root)
    items, bad = split_unjudgeable(items)
    if bad:  # public data sets carry a few broken golds (NQ-open dev: "---", ")")
        logger.warning(
            "%s: skipped %d questions whose gold answers are empty or only articles (%s)",
            data,
            len(bad),
            ", ".join(bad[:10]),
        )
    items, duplicates = split_duplicates(items)
    if duplicates:
        logger.warning("%s: skipped %d duplicate questions", data, len(duplicates))
    return items, len(report.skipped) + len(bad) + len(duplicates)


def _file_items(path: Path, config: CalibrationConfig) -> tuple[list[QAItem], int]:
    """A JSONL/CSV file's questions under the config's field mapping; bad rows and repeats
    are refused unless ``skip_bad_rows``."""
    if not path.exists():
        raise DatasetError(
            f"Data file {path} does not exist. Pass a JSONL/CSV file with 'question' and "
            "'answer' fields, or --data builtin for the built-in probe set."
        )
    fields = Fields(
        question=config.question,
        answers=config.answers,
        choices=config.choices,
        kind=config.kind,
        group_by=config.group_by,
        answers_optional=judges_without_reference(config.judge),
    )
    items, report = load_dataset(path, fields, log_skipped=False)
    problems = [f"{path}:{s.line}: {s.reason}" for s in report.skipped]
    items, duplicates = split_duplicates(items)
    problems += duplicates
    _reject_or_skip(problems, config, str(path))
    return items, len(problems)


def question_key(item: QAItem) -> tuple[object, ...]:
    """What makes two questions the same: the text after Unicode (NFKC) normalisation,
    case folding, collapsed spaces and trailing ``?.!`` dropped, plus the options, plus the
    earlier turns for a conversation row (one follow-up question asked after different
    turns is a different question)."""
    text = " ".join(unicodedata.normalize("NFKC", item.question).casefold().split())
    options = tuple(" ".join(c.casefold().split()) for c in item.choices)
    if item.history:
        return text.rstrip(" ?.!"), options, item.history
    return text.rstrip(" ?.!"), options


def split_duplicates(items: Sequence[QAItem]) -> tuple[list[QAItem], list[str]]:
    """``(first occurrences, one message per repeat)``: a question asked twice (or an id used
    twice) would land in two splits, and a question in both train and calibration breaks the
    exchangeability the guarantee rests on."""

    def where(it: QAItem) -> str:
        return f"{it.source}:{it.line}" if it.line else repr(it.id)

    seen: dict[tuple[object, ...], QAItem] = {}
    ids: dict[str, QAItem] = {}
    good, bad = [], []
    for it in items:
        first = seen.get(question_key(it))
        same_id = ids.get(it.id)
        if first is not None:
            at = f"line {first.line}" if first.line and first.source == it.source else where(first)
            bad.append(
                f"{where(it)}: duplicate question (same as {at} after normalising case and spaces)"
            )
        elif same_id is not None:
            bad.append(f"{where(it)}: duplicate id {it.id!r} (also {where(same_id)})")
        else:
            seen[question_key(it)] = it
            ids[it.id] = it
            good.append(it)
    return good, bad


def _reject_or_skip(problems: list[str], config: CalibrationConfig, source: str) -> None:
    """Raise DatasetError listing every bad row, unless ``config.skip_bad_rows``: then warn
    with their count."""
    if not problems:
        return
    if config.skip_bad_rows:
        logger.warning(
            "%s: skipped %d bad rows (skip_bad_rows): %s%s",
            source,
            len(problems),
            "; ".join(problems[:5]),
            " ..." if len(problems) > 5 else "",
        )
        return
    shown = "\n".join(f"    {p}" for p in problems[:20])
    more = f"\n    ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise DatasetError(
        f"{len(problems)} bad rows in {source}:\n{shown}{more}\n  Fix them, or pass "
        "--skip-bad-rows (config key skip_bad_rows: true) to skip them."
    )


def split_unjudgeable(items: Sequence[QAItem]) -> tuple[list[QAItem], list[str]]:
    """``(judgeable items, locations of the others)``: an open question whose gold aliases
    are all empty or only articles can never be judged correct (``source:line`` or id)."""
    good, bad = [], []
    for it in items:
        if it.kind == "open" and not any(alias_tokens(a) is not None for a in it.answers):
            bad.append(f"{it.source}:{it.line}" if it.line else it.id)
        else:
            good.append(it)
    return good, bad


def check_split_sizes(splits: dict[str, list[QAItem]], config: CalibrationConfig) -> None:
    """Fail before loading any model when a split is too small for the participation
    target; warn when the calibration split cannot certify ``config.risk_target`` even with
    a perfect scorer."""
    need = min_calibration_size(config.participation)
    n_cal = len(splits["calibration"])
    total = sum(len(v) for v in splits.values())
    ratios = ":".join(str(r) for r in config.ratios)
    if n_cal < need:
        raise InsufficientDataError(
            f"The calibration split has {n_cal} questions ({total} in all, split {ratios}), "
            f"but participation {config.participation} needs at least {need} for a finite "
            f"threshold. Use more questions, a larger calibration ratio, or lower the "
            "participation target."
        )
    eps = config.risk_target
    if eps is not None and not perfect_scorer_certifies(n_cal, eps, config.delta):
        note = (
            f"The calibration split has {n_cal} questions ({total} in all, split {ratios}): "
            f"too few to certify risk_target={eps:g} at delta={config.delta:g} even if every "
            "answer but one were right and the scorer ranked them perfectly. Use more "
            "questions or a larger calibration ratio, or aim for a larger risk target."
        )
        logger.warning(note)
        warnings.warn(note, ConformalWarning, stacklevel=3)
    if config.scorer not in FIT_SCORERS:  # a likelihood scorer fits nothing on them
        return
    for name in ("reference", "train"):
        if len(splits[name]) < 4:
            raise InsufficientDataError(
                f"The {name} split has only {len(splits[name])} questions; the scorer needs "
                "correct and incorrect answers in it. Use more questions."
            )


def items_digest(items: Sequence[QAItem]) -> str:
    """Content hash of the questions a run used: ids, texts, golds, choices, kinds, and only
    for the rows that have them the history and conversation, the expected tool calls and
    their order flag."""
    return content_key(
        "items",
        [
            [it.id, it.question, list(it.answers), list(it.choices), it.kind]
            + (
                [[list(t) for t in it.history], it.conversation]
                if it.history or it.conversation
                else []
            )
            + (
                [[c.to_json() for c in it.expected_tool_calls], it.tool_calls_ordered]
                if it.expected_tool_calls
                else []
            )
            for it in items
        ],
    )
