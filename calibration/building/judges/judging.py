"""Judging a run's answers, and the labels that come out of it (a run's verdicts are
:data:`Verdicts`, ``{item.id: Judgment}``), for the pipeline, agent calibration and the
measuring commands alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from abstain_guard.errors import CalibrationError

from ..questions.datasets import QAItem
from ..run.calibration_config import FIT_SCORERS, CalibrationConfig
from ..run.store import RunStore
from .base import Judgment
from .cache import CachedJudge, JudgmentCache
from .registry import make_judge

#: A run's verdicts, ``{item.id: Judgment}``.
Verdicts = dict[str, Judgment]

#: One verdict as a reader accepts it: a :class:`Judgment` or its JSON form (a cached row).
VerdictLike = Union[Judgment, Mapping[str, Any]]  # noqa: UP007 (a runtime alias)


def build_judges(
    config: CalibrationConfig,
    cache_path: Path,
    chat_models: dict[str, Any] | None = None,
    *,
    read_from: Sequence[RunStore] = (),
) -> dict[str, Any]:
    """One cached judge per question kind: the configured judge for open questions; the
    choice and numeric judges for multiple-choice and math questions (unless the config
    names one of those). Built and validated before any model is loaded. ``read_from``:
    read-only judgment stores whose verdicts are reused (new ones go to ``cache_path``)."""
    configured = make_judge(config.judge, chat_models=chat_models)
    name = config.judge if isinstance(config.judge, str) else config.judge.get("name")
    by_kind = {"open": configured, "choice": configured, "numeric": configured}
    if name not in ("choice", "numeric"):
        by_kind["choice"] = make_judge("choice")
        by_kind["numeric"] = make_judge("numeric")
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    cache = JudgmentCache(cache_path, read_from=read_from)
    return {kind: CachedJudge(judge, cache) for kind, judge in by_kind.items()}


def judge_answers(
    judges: dict[str, Any],
    items: Sequence[QAItem],
    answers: Mapping[str, Mapping[str, Any]],
    *,
    max_concurrency: int = 4,
    progress: bool = True,
) -> Verdicts:
    """Verdicts ``{item.id: Judgment}`` (``correct``: bool or None, ``score``,
    ``rationale``, ``refusal``).

    ``answers``: each item's answer row (:class:`~..answering.answer_rows.AnswerRow`; only
    ``"text"`` is read). ``judges`` maps a question kind (``"open"``, ``"choice"``, ``"numeric"``)
    to its judge (see :func:`build_judges`); caching lives in the judges (``CachedJudge``).
    """
    out: Verdicts = {}
    for kind in sorted({it.kind for it in items}):
        subset = [it for it in items if it.kind == kind]
        inputs = [
            (it.question, list(it.answers), answers[it.id]["text"], list(it.choices))
            if kind == "choice"
            else (it.question, list(it.answers), answers[it.id]["text"])
            for it in subset
        ]
        results = judges[kind].judge_many(
            inputs, max_concurrency=max_concurrency, progress=progress
        )
        for it, j in zip(subset, results, strict=True):
            out[it.id] = j
    return out


def is_correct(verdict: VerdictLike) -> bool | None:
    """The verdict's ``correct`` (True, False, or None when none could be made); accepts a
    :class:`Judgment` or its JSON form."""
    if isinstance(verdict, Judgment):
        return verdict.correct
    value = verdict.get("correct")
    return None if value is None else bool(value)


def labeled_items(items: Sequence[QAItem], verdicts: Mapping[str, VerdictLike]) -> list[QAItem]:
    """``items`` that were judged (a verdict that could not be made is dropped)."""
    return [it for it in items if is_correct(verdicts[it.id]) is not None]


def labeled_splits(
    splits: Mapping[str, Sequence[QAItem]], verdicts: Mapping[str, VerdictLike]
) -> dict[str, list[QAItem]]:
    """Each split's items that were judged (:func:`labeled_items`)."""
    return {name: labeled_items(splits[name], verdicts) for name in splits}


def labels(items: Sequence[QAItem], verdicts: Mapping[str, VerdictLike]) -> list[bool]:
    """The correctness label of each of ``items`` (judged ones: see :func:`labeled_items`)."""
    return [bool(is_correct(verdicts[it.id])) for it in items]


def check_two_classes(
    labeled: Mapping[str, Sequence[QAItem]],
    verdicts: Mapping[str, VerdictLike],
    config: CalibrationConfig,
) -> None:
    """A fitted scorer needs correct and incorrect answers in its reference / train splits."""
    for name in ("reference", "train"):
        if name not in labeled or config.scorer not in FIT_SCORERS:
            continue
        seen = set(labels(labeled[name], verdicts))
        if len(seen) < 2:
            raise CalibrationError(
                f"Every answer in the {name} split was judged "
                f"{'correct' if True in seen else 'incorrect'}; the {config.scorer} scorer "
                "needs both. Use questions the model sometimes gets right and sometimes wrong "
                "(the built-in probe set is such a set for the default model)."
            )
