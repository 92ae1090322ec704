"""Fitting the calibrated scorer on the reference and train answers and scoring the
calibration answers as the deployed guard scores them (replayed from their token ids, or
read from an API model's metadata), and the calibration answers' groups."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from abstain_guard.contract.chat_model_specs import ChatModelSpec
from abstain_guard.scorers import build_scorer

from .answering.answer_rows import AnswerRows
from .answering.answers import generated_pairs, replay_as_deployed
from .answering.api_generation import api_labeled, measure_live_bound, score_api_answers
from .judges.judging import Verdicts, check_two_classes, labels
from .questions.datasets import QAItem
from .run.calibration_config import FIT_SCORERS, CalibrationConfig

logger = logging.getLogger("abstain_guard.calibration")


def make_scorer(config: CalibrationConfig) -> Any:
    """A new, unfitted scorer of ``config.scorer`` with ``config.scorer_params``."""
    return build_scorer(config.scorer, **config.scorer_params)


def calibration_groups(items: Sequence[QAItem]) -> list[str] | None:
    """Each calibration answer's group (the probe relation, or the data's ``group_by``
    field), stored in the artifact for per-group rules; None when no item has one. Items
    without a group among items with one: not stored, with a warning naming how many."""
    groups = [it.group for it in items]
    if all(g is None for g in groups):
        return None
    missing = sum(g is None for g in groups)
    if missing:
        logger.warning(
            "%d of %d calibration questions have no group (%s empty): the artifact records "
            "no groups, so per-group rules (GuardConfig(group_by=...)) are unavailable. Give "
            "every row a group to record them.",
            missing,
            len(groups),
            "the group_by field",
        )
        return None
    return [str(g) for g in groups]


def fit_and_score(
    model: Any,
    labeled: dict[str, list[QAItem]],
    answers: AnswerRows,
    judgments: Verdicts,
    config: CalibrationConfig,
    *,
    progress: bool = True,
) -> tuple[Any, np.ndarray]:
    """Fit the configured scorer on reference/train and score the calibration split, reading
    the geometry by replay (answers generated without capture). An API model's answers are
    scored from their own metadata (what the live guard reads; no replay)."""
    check_two_classes(labeled, judgments, config)
    if isinstance(config.model, ChatModelSpec):  # scored, and fitted, from their metadata
        scorer = make_scorer(config)
        if config.scorer in FIT_SCORERS:
            scorer.fit(
                api_labeled(labeled["reference"], answers, judgments),
                api_labeled(labeled["train"], answers, judgments),
            )
        scores = score_api_answers(scorer, labeled["calibration"], answers)
        if callable(getattr(model, "record_live_bound", None)):  # a server that batches
            model.record_live_bound(
                measure_live_bound(model, scorer, labeled["calibration"], answers, config)
            )
        return scorer, scores

    def pairs(name: str) -> list[tuple[Any, list[int]]]:
        return generated_pairs(labeled[name], answers, config)

    def split_labels(name: str) -> list[bool]:
        return labels(labeled[name], judgments)

    bs = config.replay_batch_size
    scorer = make_scorer(config)
    if config.scorer in FIT_SCORERS:
        ref = model.replay_batch(
            pairs("reference"), batch_size=bs, return_states=True, progress=progress
        )
        train = model.replay_batch(
            pairs("train"), batch_size=bs, return_states=True, progress=progress
        )
        scorer.fit(
            list(zip(ref, split_labels("reference"), strict=True)),
            list(zip(train, split_labels("train"), strict=True)),
        )
        del ref, train
    scoring_model = scorer.prepare(model)
    cal = replay_as_deployed(scoring_model, labeled["calibration"], answers, config, progress)
    scores = scorer.score_many(cal)
    return scorer, np.asarray(scores, dtype=np.float64)
