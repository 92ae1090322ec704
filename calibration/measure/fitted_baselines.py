"""The baselines ``evaluate`` fits on the artifact's reference and train answers:
the hidden-state probes, likelihood + probe, the type-only floor (:class:`TypeFloor`) and
``geometry_plus``; never on calibration or test. Also what they read: each answer's question
type and the reference answers' hidden-state summaries.

``type_floor`` is a score that knows only the question's type: 1 − the accuracy of the
question's type on the fitting answers (Laplace-smoothed, ``(correct + 1) / (answers + 2)``;
a type never seen there gets the overall accuracy). It reads nothing the model produced, so
its AUROC is how much of any scorer's AUROC type detection alone buys on mixed data: report
it beside every pooled number. Within one type it is constant (within-type AUROC 0.5 by
construction), and on a set without types it is one constant (AUROC 0.5). It is a measuring
floor, not a scorer a guard could deploy (so not in the scorer registry): the type is read
from ``response_metadata["question_group"]``, which ``evaluate`` sets from the data set's type
field (:func:`with_groups`); a chat model never writes it. ``None`` there is a type of its own.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from abstain_guard.contract.metadata import (
    HIDDEN,
    QUESTION_GROUP,
    ResponseLike,
    response_metadata_of,
)
from abstain_guard.errors import AbstainGuardError, NotFittedError, ScoringError
from abstain_guard.scorers import ScorerState, build_scorer, scorer_names

from ..building.answering.answer_rows import STATES_NS, AnswerRow
from ..building.answering.online_geometry import reference_hidden
from ..building.questions.datasets import QAItem
from ..building.run.calibration_config import TYPE_FLOOR

logger = logging.getLogger("abstain_guard.calibration")

FITTED_BASELINES = (*scorer_names(family="probe"), TYPE_FLOOR, "geometry_plus")
"""Baselines fitted on the artifact's reference and train answers (never calibration): the
hidden-state probes, likelihood + probe, the type-only floor, and ``geometry_plus`` (on an
artifact of a geometry scorer, with its reference means)."""

_NONE = "\x00none"  # the JSON key of questions without a type


def question_group(response: ResponseLike) -> str:
    """The question's type as a string key (``None`` -> a key of its own).

    Raises:
        ScoringError: the response carries no ``question_group`` entry.
    """
    meta = response_metadata_of(getattr(response, "metadata", response))
    if QUESTION_GROUP not in meta:
        raise ScoringError(
            "type_floor scores the question's type, read from "
            "response_metadata['question_group'], which this response does not carry. It is "
            "a measuring floor (abstain-guard evaluate --baselines type_floor sets it), not a "
            "deployable guard."
        )
    group = meta[QUESTION_GROUP]
    return _NONE if group is None else str(group)


class TypeFloor:
    """1 − smoothed train accuracy of the question's type (higher = more uncertain).

    Fitted attributes: ``accuracy_`` (``{type: smoothed accuracy}``), ``overall_`` (the
    fitting answers' accuracy), ``counts_`` (``{type: [correct, answers]}``).
    """

    def _check_fitted(self) -> None:
        if not hasattr(self, "accuracy_"):
            raise NotFittedError("TypeFloor is not fitted: call fit(reference, train) first.")

    def fit(
        self,
        reference: Sequence[tuple[Any, bool]],
        train: Sequence[tuple[Any, bool]],
        *,
        reference_means: Any = None,
    ) -> TypeFloor:
        """Count correct answers per type over the reference and train answers."""
        del reference_means
        counts: dict[str, list[int]] = {}
        for response, correct in [*reference, *train]:
            c = counts.setdefault(question_group(response), [0, 0])
            c[0] += int(bool(correct))
            c[1] += 1
        total = sum(c[1] for c in counts.values())
        self.overall_ = sum(c[0] for c in counts.values()) / total if total else 0.5
        self.counts_ = counts
        self.accuracy_ = {g: (c[0] + 1) / (c[1] + 2) for g, c in counts.items()}
        return self

    def score(self, response: ResponseLike) -> float:
        """1 − the smoothed accuracy of the response's question type."""
        self._check_fitted()
        return float(1.0 - self.accuracy_.get(question_group(response), self.overall_))

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        """Scores ``[n]``."""
        return np.asarray([self.score(r) for r in responses], dtype=np.float64)

    def get_state(self) -> ScorerState:
        """The per-type counts and accuracies (JSON only; ``evaluate`` reports its size)."""
        self._check_fitted()
        params = {"overall": self.overall_, "counts": self.counts_, "accuracy": self.accuracy_}
        json.dumps(params)
        return ScorerState(kind=TYPE_FLOOR, params=params)


def with_groups(metadata: Sequence[dict[str, Any]], items: Sequence[QAItem]) -> list[Any]:
    """Copies of ``metadata`` with each question's type (``question_group``)."""
    return [{**m, QUESTION_GROUP: it.group} for m, it in zip(metadata, items, strict=True)]


def reference_metadata(answer: AnswerRow, store: Any) -> dict[str, Any]:
    """A reference answer's metadata for the fitted baselines: its likelihood metadata and
    the probe layers' summaries (from its row, or from its cached states)."""
    meta = dict(answer.get("metadata") or {})
    hidden = answer.get("hidden")
    if hidden is None:
        hidden = reference_hidden(answer, store.get_arrays(STATES_NS, answer["key"]))
    if hidden is not None:
        meta["geometry"] = {**(meta.get("geometry") or {}), HIDDEN: hidden}
    return meta


def cost(t0: float, n: int) -> dict[str, float]:
    """Seconds per answer of scoring ``n`` answers since ``t0`` (the answers' metadata
    already in memory: the scorer's own cost, not generation's)."""
    return {"seconds_per_answer": (time.perf_counter() - t0) / max(n, 1)}


def fitted_baseline_scores(held: Any, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Scores of the baselines fitted on the artifact's reference and train answers (the
    splits its geometry scorer was fitted on; never calibration). A baseline that cannot be
    fitted (answers without hidden states, too few of a class) is left out with a warning."""
    if held.train_metadata is None or held.train_correct is None:
        logger.warning("no train answers: %s need the artifact's own splits", list(names))
        return {}
    ref_correct = [] if held.reference_correct is None else held.reference_correct.tolist()
    ref = list(zip(held.reference_metadata or [], ref_correct, strict=True))
    train = list(zip(held.train_metadata, held.train_correct.tolist(), strict=True))
    out: dict[str, np.ndarray] = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            unfitted = TypeFloor() if name == TYPE_FLOOR else build_scorer(name)
            scorer = unfitted.fit(  # type: ignore[union-attr]
                ref, train, reference_means=held.reference_means
            )
            t1 = time.perf_counter()
            out[name] = np.asarray(scorer.score_many(held.metadata), dtype=np.float64)
        except AbstainGuardError as exc:  # no hidden states, too few of a class, no means
            logger.warning("baseline %s left out: %s", name, exc)
            continue
        held.costs[name] = {**cost(t1, len(held.metadata)), "fit_seconds": t1 - t0}
        state = scorer.get_state()
        held.costs[name]["state_bytes"] = int(
            sum(a.nbytes for a in state.arrays.values()) + len(json.dumps(state.params))
        )
        logger.info(
            "%s fitted on %d reference + %d train answers in %.1f s",
            name,
            len(ref),
            len(train),
            time.perf_counter() - t0,
        )
    return out
