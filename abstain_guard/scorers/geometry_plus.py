"""``geometry_plus``: the paper's geometry signals and the token likelihood, judged per response.

The paper's token vector ν and its Mahalanobis distances to the Gaussians of correct and
incorrect reference tokens (fitted on the reference split as :mod:`.geometry` does), with
the token likelihood, summarised per response by :data:`RESPONSE_FEATURES`; a regularised
logistic regression on the *train* split's responses (strength chosen by stratified
cross-validation on train, AUROC) gives the probability that the response is wrong. Nothing
is fitted on the calibration split. Why and how it compares: docs/baselines.md,
``geometry_plus``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from scipy.special import expit

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import (
    ArtifactSchemaError,
    InsufficientDataError,
    InvalidInputError,
    NotFittedError,
    ScoringError,
)
from abstain_guard.scorers._base import Scorer, ScorerState
from abstain_guard.scorers._calibrator import CovarianceKind, Gaussian, fit_gaussian
from abstain_guard.scorers._features import (
    ReferenceInputs,
    TokenBlock,
    install_reference,
    means_from_state,
    means_state,
    reference_inputs,
    token_block,
)
from abstain_guard.scorers._linear_probe import LinearProbe, check_cs, fit_linear_probe

if TYPE_CHECKING:
    from abstain_guard.adapters import ReferenceMeans

RESPONSE_FEATURES: tuple[str, ...] = (
    "logprob_mean",
    "logprob_min",
    "logprob_first",
    "entropy_mean",
    "entropy_max",
    "entropy_first",
    "d_corr_mean",
    "d_inc_mean",
    "margin_mean",
    "margin_min",
    "margin_max",
    "margin_first",
    "log_tokens",
)
"""The response summary the logistic model reads, in column order. ``margin`` is
``d_inc − d_corr`` per token (positive: the token looks more like correct reference tokens)."""

DEFAULT_CS: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
"""Inverse regularisation strengths the train-split cross-validation chooses from."""

_SETTINGS = ("covariance", "cv_folds", "min_reference_responses", "random_state")
"""The constructor's scalar settings a stored state records."""


def response_features(block: TokenBlock, corr: Gaussian, inc: Gaussian) -> np.ndarray:
    """One response's summary ``[len(RESPONSE_FEATURES)]`` from its token inputs.

    Args:
        block: ``geometry [N, 8L−4]``, ``logprob [N]``, ``entropy [N]`` of one response.
        corr, inc: Gaussians of correct / incorrect reference tokens.

    Raises:
        ScoringError: the response carries no entropy (a message written without it).
    """
    lp = block.logprob
    ent = block.entropy
    if not np.all(np.isfinite(ent)):
        raise ScoringError(
            "The response carries no token entropies; geometry_plus needs them. Score "
            "messages produced by GeometryChatModel (it writes response_metadata['entropy'])."
        )
    d_corr = corr.distance(block.geometry)
    d_inc = inc.distance(block.geometry)
    margin = d_inc - d_corr
    return np.asarray(
        [
            lp.mean(),
            lp.min(),
            lp[0],
            ent.mean(),
            ent.max(),
            ent[0],
            d_corr.mean(),
            d_inc.mean(),
            margin.mean(),
            margin.min(),
            margin.max(),
            margin[0],
            np.log1p(lp.size),
        ],
        dtype=np.float64,
    )


class GeometryPlusScorer(Scorer):
    """Geometry distances and likelihood summarised per response, logistic model on train.

    Args:
        covariance: shrinkage estimator of the reference Gaussians (``"ledoit_wolf"``/``"oas"``).
        features: the columns of :data:`RESPONSE_FEATURES` the model reads (all by default;
            a subset for ablations).
        cs: inverse regularisation strengths; cross-validation on train picks one.
        cv_folds: stratified folds of that cross-validation.
        min_reference_responses: fewest correct and incorrect reference responses each.
        random_state: seed of the cross-validation folds.

    Fitted attributes: ``reference_means_``, ``num_layers_``, ``gaussian_corr_``,
    ``gaussian_inc_``, ``model_`` (:class:`~._linear_probe.LinearProbe` on the standardised
    response summary: its strength ``C`` chosen by cross-validation), ``fit_info_``.
    """

    kind = "geometry_plus"
    family: ClassVar[str] = "geometry"
    reads: ClassVar[frozenset[str]] = frozenset({"geometry"})

    def __init__(
        self,
        covariance: CovarianceKind = "ledoit_wolf",
        features: Sequence[str] = RESPONSE_FEATURES,
        cs: Sequence[float] = DEFAULT_CS,
        cv_folds: int = 5,
        min_reference_responses: int = 2,
        random_state: int = 0,
    ) -> None:
        if covariance not in ("ledoit_wolf", "oas"):
            raise InvalidInputError(
                f"covariance must be 'ledoit_wolf' or 'oas', got {covariance!r}."
            )
        unknown = [f for f in features if f not in RESPONSE_FEATURES]
        if unknown or not features:
            raise InvalidInputError(
                f"features must be a non-empty subset of {list(RESPONSE_FEATURES)}; "
                f"unknown: {unknown}."
            )
        self.covariance: CovarianceKind = covariance
        self.features = tuple(f for f in RESPONSE_FEATURES if f in set(features))
        self.cs = check_cs(cs, cv_folds)
        self.cv_folds = int(cv_folds)
        self.min_reference_responses = int(min_reference_responses)
        self.random_state = int(random_state)

    # ---- fitting ---------------------------------------------------------------------

    def _check_fitted(self) -> None:
        if not hasattr(self, "model_"):
            raise NotFittedError(
                "GeometryPlusScorer is not fitted: call fit(reference, train) or load it "
                "from an artifact first."
            )

    def fit(
        self,
        reference: Sequence[tuple[Any, bool]],
        train: Sequence[tuple[Any, bool]],
        *,
        reference_means: ReferenceMeans | None = None,
    ) -> GeometryPlusScorer:
        """Fit means and Gaussians on ``reference``, the response model on ``train``.

        Args:
            reference: ``(ReplayResult with states, correct)`` pairs, or with
                ``reference_means`` any responses whose geometry carries Φ with them.
            train: ``(response, correct)`` pairs (Φ from states or from the geometry).
            reference_means: means already fitted on the reference states.

        Raises:
            InsufficientDataError: too few reference responses of a class, or fewer than
                ``cv_folds`` train responses of a class.
            ScoringError / InvalidInputError: as :func:`.features.reference_inputs`.
        """
        ref = reference_inputs(
            reference,
            reference_means=reference_means,
            min_responses=self.min_reference_responses,
        )
        tr = list(train)
        blocks = [token_block(r, ref.means) for r, _ in tr]
        return self.fit_blocks(ref, blocks, np.asarray([bool(c) for _, c in tr]))

    def fit_blocks(
        self, reference: ReferenceInputs, train_blocks: Sequence[TokenBlock], train_labels: Any
    ) -> GeometryPlusScorer:
        """:meth:`fit` from inputs already read: the reference split
        (:func:`.features.reference_inputs`) and the train split's token blocks with their
        labels ``[n_train]`` (Φ with ``reference.means``)."""
        y = np.asarray(train_labels, dtype=bool)
        counts = np.bincount(y.astype(int), minlength=2)
        if counts.min() < self.cv_folds:
            raise InsufficientDataError(
                f"The train split has {counts[1]} correct and {counts[0]} incorrect "
                f"responses; geometry_plus needs at least {self.cv_folds} of each for its "
                "cross-validation. Use a larger train split."
            )
        self.reference_means_ = reference.means
        self.num_layers_ = reference.num_layers
        self.gaussian_corr_ = fit_gaussian(reference.tokens(correct=True), self.covariance)
        self.gaussian_inc_ = fit_gaussian(reference.tokens(correct=False), self.covariance)
        self.model_ = fit_linear_probe(
            self._features(train_blocks),
            y,
            self.cs,
            self.cv_folds,
            self.random_state,
            "The geometry_plus scorer",
            max_iter=10_000,
        )
        self.fit_info_ = {
            **reference.counts(),
            "train_responses": [int(counts[1]), int(counts[0])],
            "C": self.model_.C,
            "cv_auroc_by_C": self.model_.cv_auroc,
        }
        return self

    def _features(self, blocks: Sequence[TokenBlock]) -> np.ndarray:
        """``[n, F]`` response summaries (the chosen :attr:`features` columns)."""
        columns = [RESPONSE_FEATURES.index(f) for f in self.features]
        rows = [response_features(b, self.gaussian_corr_, self.gaussian_inc_) for b in blocks]
        return np.stack(rows)[:, columns]

    # ---- scoring ---------------------------------------------------------------------

    def token_blocks(self, responses: Sequence[ResponseLike]) -> list[TokenBlock]:
        """The per-token inputs of each response (Φ with this scorer's means)."""
        self._check_fitted()
        blocks = [token_block(r, self.reference_means_) for r in responses]
        expected = 8 * self.num_layers_ - 4
        for b in blocks:
            if b.geometry.shape[1] != expected:
                raise ScoringError(
                    f"The response has token vectors of width {b.geometry.shape[1]} but the "
                    f"scorer was fitted for L={self.num_layers_} layers ({expected}). Use the "
                    "artifact calibrated for this model."
                )
        return blocks

    def scores_of(self, blocks: Sequence[TokenBlock]) -> np.ndarray:
        """P(wrong) ``[n]`` of responses given their token inputs."""
        self._check_fitted()
        if not blocks:
            return np.zeros(0, dtype=np.float64)
        return np.asarray(expit(-self.model_.logits(self._features(blocks))), dtype=np.float64)

    def score(self, response: ResponseLike) -> float:
        """Predicted probability that ``response`` is wrong (higher = more uncertain)."""
        return float(self.score_many([response])[0])

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        """Scores ``[n]``."""
        return self.scores_of(self.token_blocks(responses))

    def prepare(self, runnable: Any) -> Any:
        """Install the fitted means into every GeometryChatModel inside ``runnable``."""
        self._check_fitted()
        return install_reference(runnable, self.reference_means_)

    # ---- state -----------------------------------------------------------------------

    def get_state(self) -> ScorerState:
        """JSON params + arrays (means, Gaussians, standardisation, coefficients)."""
        self._check_fitted()
        params: dict[str, Any] = {
            **{name: getattr(self, name) for name in _SETTINGS},
            "cs": list(self.cs),
            "features": list(self.features),
            "num_layers": self.num_layers_,
            "fit_info": self.fit_info_,
            **self.model_.params(),
        }
        json.dumps(params)
        arrays = {
            **means_state(self.reference_means_),
            **self.gaussian_corr_.arrays("gaussian_corr"),
            **self.gaussian_inc_.arrays("gaussian_inc"),
            **self.model_.arrays("feature_"),
        }
        return ScorerState(kind=self.kind, params=params, arrays=arrays)

    @classmethod
    def from_state(cls, state: ScorerState) -> GeometryPlusScorer:
        """Rebuild a fitted scorer from :meth:`get_state` output.

        Raises:
            ArtifactSchemaError: the state is incomplete, reads features this version does not
                compute, or its coefficients do not match its features.
        """
        p = dict(state.params)
        a = state.arrays
        try:
            scorer = cls(**{name: p[name] for name in (*_SETTINGS, "cs", "features")})
            scorer.num_layers_ = int(p["num_layers"])
            scorer.fit_info_ = dict(p["fit_info"])
            scorer.reference_means_ = means_from_state(a)
            scorer.gaussian_corr_ = Gaussian.from_arrays(a, "gaussian_corr")
            scorer.gaussian_inc_ = Gaussian.from_arrays(a, "gaussian_inc")
        except (KeyError, InvalidInputError) as exc:
            raise ArtifactSchemaError(
                f"The geometry_plus scorer state is incomplete or malformed ({exc}); recalibrate."
            ) from exc
        scorer.model_ = LinearProbe.from_parts(p, a, "feature_")
        if scorer.model_.coef.shape != (len(scorer.features),):
            raise ArtifactSchemaError(
                f"geometry_plus coefficients must have {len(scorer.features)} entries; the "
                "artifact is corrupt."
            )
        return scorer
