"""``type_floor``: a score that knows only the question's type.

Score = 1 − the accuracy of the question's type on the fitting answers (reference and
train splits; Laplace-smoothed, ``(correct + 1) / (answers + 2)``; a type never seen there
gets the overall accuracy). It reads nothing the model produced, so its AUROC is how much
of any scorer's AUROC type detection alone buys on mixed data: report it beside every pooled
number. Within one type it is constant (within-type AUROC 0.5 by construction), and on a set
without types it is one constant (AUROC 0.5).

It is a measuring floor, not a guard: the type is read from
``response_metadata["question_group"]`` (:data:`abstain_guard.contract.metadata.QUESTION_GROUP`),
which ``abstain-guard evaluate`` sets from the data set's type field; a chat model never
writes it. ``None`` there is a type of its own (questions without a type).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from abstain_guard.contract.metadata import QUESTION_GROUP, ResponseLike, response_metadata_of
from abstain_guard.errors import ArtifactSchemaError, NotFittedError, ScoringError
from abstain_guard.scorers._base import Scorer, ScorerState

__all__ = ["TypeFloorScorer", "question_group"]

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


class TypeFloorScorer(Scorer):
    """1 − smoothed train accuracy of the question's type.

    Fitted attributes: ``accuracy_`` (``{type: smoothed accuracy}``), ``overall_`` (the
    fitting answers' accuracy), ``counts_`` (``{type: [correct, answers]}``).
    """

    kind: ClassVar[str] = "type_floor"

    def _check_fitted(self) -> None:
        if not hasattr(self, "accuracy_"):
            raise NotFittedError(
                "TypeFloorScorer is not fitted: call fit(reference, train) or load it from "
                "an artifact first."
            )

    def fit(
        self,
        reference: Sequence[tuple[Any, bool]],
        train: Sequence[tuple[Any, bool]],
        *,
        reference_means: Any = None,
    ) -> TypeFloorScorer:
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

    def get_state(self) -> ScorerState:
        """The per-type counts and accuracies (JSON only)."""
        self._check_fitted()
        params = {"overall": self.overall_, "counts": self.counts_, "accuracy": self.accuracy_}
        json.dumps(params)
        return ScorerState(kind=self.kind, params=params)

    @classmethod
    def from_state(cls, state: ScorerState) -> TypeFloorScorer:
        """Rebuild from :meth:`get_state` output."""
        p = state.params
        acc = p.get("accuracy")
        if not isinstance(acc, Mapping) or "overall" not in p:
            raise ArtifactSchemaError("The type_floor state is missing its per-type accuracy.")
        scorer = cls()
        scorer.overall_ = float(p["overall"])
        scorer.accuracy_ = {str(k): float(v) for k, v in acc.items()}
        scorer.counts_ = {str(k): [int(x) for x in v] for k, v in p.get("counts", {}).items()}
        return scorer

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        """Scores ``[n]``."""
        return np.asarray([self.score(r) for r in responses], dtype=np.float64)
