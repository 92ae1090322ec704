"""``likelihood_probe``: the hidden-state probe and the token likelihood, stacked.

First stage: the ``probe_concat`` probe (:mod:`.probe`; both probe layers, mean over the
generated tokens). Second stage: a logistic regression on the probe's logit and the
response's likelihood summary — mean and minimum token log-probability, mean and maximum
token entropy, ``log(1 + N)`` — fitted on the probe's *out-of-fold* logits of the fitting
answers (5 stratified folds; the probe never scores an answer it was fitted on), so the
second stage learns how far to trust the probe. Both stages are fitted on the reference and
train splits only, strengths chosen by cross-validation there. Score: P(wrong).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from scipy.special import expit

from abstain_guard.contract.metadata import ResponseLike, ResponseMetadata
from abstain_guard.errors import ArtifactSchemaError, ScoringError
from abstain_guard.scorers._base import ScorerState
from abstain_guard.scorers._linear_probe import (
    LinearProbe,
    fit_linear_probe,
    out_of_fold_logits,
)
from abstain_guard.scorers.probe import ProbeScorerBase, hidden_features, labeled_responses

LIKELIHOOD_COLUMNS = ("logprob_mean", "logprob_min", "entropy_mean", "entropy_max", "log_tokens")
"""The likelihood summary beside the probe's logit, in column order."""

STACK_CS: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def likelihood_columns(response: ResponseLike) -> np.ndarray:
    """One response's :data:`LIKELIHOOD_COLUMNS`.

    Raises:
        ScoringError: no logprobs or no token entropies.
    """
    meta = ResponseMetadata.of(getattr(response, "metadata", response))
    lp = meta.logprobs()
    ent = meta.entropy()
    if ent is None or ent.shape != lp.shape or not np.all(np.isfinite(ent)):
        raise ScoringError(
            "The response carries no token entropies; likelihood_probe needs them (a "
            "GeometryChatModel writes response_metadata['entropy'])."
        )
    return np.asarray(
        [lp.mean(), lp.min(), ent.mean(), ent.max(), np.log1p(lp.size)], dtype=np.float64
    )


class LikelihoodProbeScorer(ProbeScorerBase):
    """Probe logit + likelihood summary -> logistic model -> P(wrong).

    Args:
        cs: the probe's inverse L2 strengths (cross-validated).
        cv_folds: folds of both cross-validations and of the out-of-fold logits.
        random_state: seed of the folds.

    Fitted attributes: ``probe_`` (first stage), ``stack_`` (second stage), ``width_``,
    ``fit_info_``.
    """

    kind = "likelihood_probe"
    family: ClassVar[str] = "probe"
    reads: ClassVar[frozenset[str]] = frozenset({"hidden", "logprobs", "entropy"})
    fitted_attr: ClassVar[str] = "stack_"

    @staticmethod
    def _hidden(responses: Sequence[Any]) -> np.ndarray:
        return np.stack([hidden_features(r, "concat", "mean") for r in responses])

    @staticmethod
    def _likelihood(responses: Sequence[Any]) -> np.ndarray:
        return np.stack([likelihood_columns(r) for r in responses])

    def fit(
        self,
        reference: Sequence[tuple[Any, bool]],
        train: Sequence[tuple[Any, bool]],
        *,
        reference_means: Any = None,
    ) -> LikelihoodProbeScorer:
        """Fit both stages on the reference and train answers (``reference_means`` unused).

        Raises:
            InsufficientDataError: fewer than ``cv_folds`` answers of a class.
            ScoringError: an answer without hidden states, logprobs or entropies.
        """
        del reference_means
        responses, y = labeled_responses(reference, train)
        h = self._hidden(responses)
        what = "The likelihood_probe scorer"
        self.probe_ = fit_linear_probe(h, y, self.cs, self.cv_folds, self.random_state, what)
        oof = out_of_fold_logits(h, y, self.probe_.C, self.cv_folds, self.random_state)
        x2 = np.column_stack([oof, self._likelihood(responses)])
        self.stack_ = fit_linear_probe(x2, y, STACK_CS, self.cv_folds, self.random_state, what)
        self.width_ = int(h.shape[1])
        self.fit_info_ = {
            "responses": [int(y.sum()), int((~y).sum())],
            "probe_C": self.probe_.C,
            "stack_C": self.stack_.C,
            "stack_coef": dict(
                zip(("probe_logit", *LIKELIHOOD_COLUMNS), self.stack_.coef.tolist(), strict=True)
            ),
        }
        return self

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        """Scores ``[n]``."""
        self._check_fitted()
        if not responses:
            return np.zeros(0, dtype=np.float64)
        h = self._hidden(responses)
        self._check_width(int(h.shape[1]))
        x2 = np.column_stack([self.probe_.logits(h), self._likelihood(responses)])
        return np.asarray(expit(-self.stack_.logits(x2)), dtype=np.float64)

    def get_state(self) -> ScorerState:
        """JSON params and both stages' arrays."""
        self._check_fitted()
        params: dict[str, Any] = {
            **self._settings(),
            "width": self.width_,
            "fit_info": self.fit_info_,
            "probe": self.probe_.params(),
            "stack": self.stack_.params(),
        }
        json.dumps(params)
        arrays = {**self.probe_.arrays("probe."), **self.stack_.arrays("stack.")}
        return ScorerState(kind=self.kind, params=params, arrays=arrays)

    @classmethod
    def from_state(cls, state: ScorerState) -> LikelihoodProbeScorer:
        """Rebuild a fitted scorer from :meth:`get_state` output."""
        p = dict(state.params)
        try:
            scorer = cls._unfitted(p)
            scorer.width_ = int(p["width"])
            scorer.probe_ = LinearProbe.from_parts(p["probe"], state.arrays, "probe.")
            scorer.stack_ = LinearProbe.from_parts(p["stack"], state.arrays, "stack.")
        except KeyError as exc:
            raise ArtifactSchemaError(
                f"The likelihood_probe state is missing {exc}; the artifact is incomplete."
            ) from exc
        scorer.fit_info_ = dict(p.get("fit_info", {}))
        if scorer.stack_.coef.shape != (1 + len(LIKELIHOOD_COLUMNS),):
            raise ArtifactSchemaError("The likelihood_probe second stage has the wrong width.")
        return scorer
