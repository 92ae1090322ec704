"""The paper's geometry scorer (§4.5): token geometry → Mahalanobis → XGBoost → perplexity.

Per generated token the chat model reports Ω and Θ (``response_metadata["geometry"]``);
Φ^in / Φ^out need the mean directions of correct (in) and incorrect (out) reference tokens,
so they are computed here from hidden states once those means are fitted. The token vector
``ν = (Ω, Θ, Φ^in, Φ^out) ∈ R^{8L−4}`` is turned into two Mahalanobis distances (to the
Gaussians of correct and incorrect reference tokens, shrinkage covariance), XGBoost maps
``[d_corr, d_inc, p(y_t)]`` to a calibrated token confidence ``p̂_t`` and the response
uncertainty is ``u = exp(−mean_t log p̂_t)``.

What a response may be (both in ``fit`` and in ``score``):

* a ``ReplayResult`` with ``states`` (from ``model.replay(..., return_states=True)``): Φ is
  computed here from the hidden states and the fitted means (required for the reference
  split, whose means are being fitted);
* an ``AIMessage`` (or its ``response_metadata``) whose ``geometry`` already carries
  ``phi_in`` / ``phi_out`` computed with **this scorer's** means — which is what a model
  returned by :meth:`GeometryScorer.prepare` (``model.with_reference(reference_means_)``)
  produces. A message without Φ cannot be scored: :class:`ScoringError` says so.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.errors import (
    ArtifactSchemaError,
    InvalidInputError,
    NotFittedError,
    ScoringError,
)
from abstain_guard.scorers._base import Scorer, ScorerState
from abstain_guard.scorers._calibrator import (
    XGB_SETTINGS,
    CovarianceKind,
    Gaussian,
    booster_from_bytes,
    booster_to_bytes,
    fit_gaussian,
    fit_xgb_calibrator,
    response_uncertainty,
    xgb_settings,
)
from abstain_guard.scorers._features import (
    CaptureMode,
    ReferenceInputs,
    TokenBlock,
    feature_width,
    install_reference,
    means_from_state,
    means_state,
    reference_inputs,
    token_block,
)

if TYPE_CHECKING:
    from abstain_guard.adapters import ReferenceMeans

Variant = Literal["paper", "raw"]

LabeledResponses = Sequence[tuple[Any, bool]]

_SETTINGS = ("variant", "covariance", "min_reference_responses", *XGB_SETTINGS)
"""The constructor's settings a stored state records (the capture mode is its kind)."""


class GeometryScorer(Scorer):
    """The paper's geometry-calibrated uncertainty (§4.5); higher = more uncertain.

    Args:
        capture: the token vector read (:func:`.features.token_block`): ``"full"`` (Ω, Θ, Φ,
            ``8L−4``; kind ``geometry``) or ``"fast"`` (ω_dir, Θ, Φ, ``7L−3``, what fast
            capture produces; kind ``geometry_fast``, whose :meth:`prepare` also switches
            every ``GeometryChatModel`` of the runnable to fast capture).
        variant: ``"paper"`` — XGBoost on ``[d_corr, d_inc, p(y_t)]`` (the reference);
            ``"raw"`` — XGBoost on the raw ``8L−4`` token vector plus log-probability and
            entropy (no Gaussians).
        covariance: shrinkage estimator of the Gaussians, ``"ledoit_wolf"`` or ``"oas"``.
        xgb_params: XGBoost parameters merged over :data:`DEFAULT_XGB_PARAMS`.
        num_boost_round: maximum boosting rounds.
        early_stopping_rounds: patience on the held-back part of the training split.
        validation_fraction: fraction of training *responses* held back for early stopping.
        min_reference_responses: minimum correct and incorrect reference responses each.
        random_state: seed of the hold-out split and XGBoost.

    Fitted attributes: ``reference_means_`` (the adapter's ``ReferenceMeans``),
    ``num_layers_``, ``gaussian_corr_``, ``gaussian_inc_`` (paper variant), ``booster_``,
    ``fit_info_``.
    """

    kind = "geometry"
    family: ClassVar[str] = "geometry"
    reads: ClassVar[frozenset[str]] = frozenset({"geometry"})
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "geometry": {"capture": "full"},
        "geometry_fast": {"capture": "fast"},
    }

    def __init__(
        self,
        variant: Variant = "paper",
        covariance: CovarianceKind = "ledoit_wolf",
        xgb_params: Mapping[str, Any] | None = None,
        num_boost_round: int = 500,
        early_stopping_rounds: int = 30,
        validation_fraction: float = 0.2,
        min_reference_responses: int = 2,
        random_state: int = 0,
        capture: CaptureMode = "full",
    ) -> None:
        if variant not in ("paper", "raw"):
            raise InvalidInputError(f"variant must be 'paper' or 'raw', got {variant!r}.")
        if covariance not in ("ledoit_wolf", "oas"):
            raise InvalidInputError(
                f"covariance must be 'ledoit_wolf' or 'oas', got {covariance!r}."
            )
        if not 0.0 <= validation_fraction < 1.0:
            raise InvalidInputError("validation_fraction must be in [0, 1).")
        if capture not in ("full", "fast"):
            raise InvalidInputError(f"capture must be 'full' or 'fast', got {capture!r}.")
        self.capture: CaptureMode = capture
        self.kind = "geometry" if capture == "full" else "geometry_fast"
        self.variant: Variant = variant
        self.covariance: CovarianceKind = covariance
        self.xgb_params = dict(xgb_params or {})
        self.num_boost_round = int(num_boost_round)
        self.early_stopping_rounds = int(early_stopping_rounds)
        self.validation_fraction = float(validation_fraction)
        self.min_reference_responses = int(min_reference_responses)
        self.random_state = int(random_state)

    @property
    def name(self) -> str:
        return self.kind if self.variant == "paper" else f"{self.kind}_raw"

    # ---- fitting ---------------------------------------------------------------------

    def _check_fitted(self) -> None:
        if not hasattr(self, "booster_"):
            raise NotFittedError(
                "GeometryScorer is not fitted: call fit(reference, train) or load it from "
                "an artifact first."
            )

    def fit(
        self,
        reference: LabeledResponses,
        train: LabeledResponses,
        *,
        reference_means: ReferenceMeans | None = None,
    ) -> GeometryScorer:
        """Fit reference means, Gaussians and the XGBoost calibrator.

        Args:
            reference: ``(ReplayResult with states, correct)`` pairs.
            train: ``(response, correct)`` pairs; each response a ReplayResult with states
                or a message whose geometry carries Φ computed with the means fitted here.
            reference_means: the means, already fitted on the reference responses' states
                (calibration streams them from its cache, one answer in memory at a time);
                the reference responses then need no states: their geometry carries Φ
                computed with these means.

        Raises:
            InsufficientDataError: too few correct/incorrect reference responses or tokens,
                or a single class in the training split.
            InvalidInputError: identical or NaN features.
            ScoringError: a response lacks what is needed (states, logprobs, geometry).
        """
        ref = reference_inputs(
            reference,
            reference_means=reference_means,
            min_responses=self.min_reference_responses,
            capture=self.capture,
        )
        tr = list(train)
        blocks = [token_block(r, ref.means, capture=self.capture) for r, _ in tr]
        return self.fit_blocks(ref, blocks, np.asarray([bool(c) for _, c in tr]))

    def fit_blocks(
        self, reference: ReferenceInputs, train_blocks: Sequence[TokenBlock], train_labels: Any
    ) -> GeometryScorer:
        """:meth:`fit` from inputs already read: the reference split
        (:func:`.features.reference_inputs`) and the train split's token blocks with their
        labels ``[n_train]`` (Φ with ``reference.means``)."""
        ref = reference
        self.reference_means_ = ref.means
        self.num_layers_ = ref.num_layers
        if self.variant == "paper":
            self.gaussian_corr_ = fit_gaussian(ref.tokens(correct=True), self.covariance)
            self.gaussian_inc_ = fit_gaussian(ref.tokens(correct=False), self.covariance)
        blocks = list(train_blocks)
        labels = np.asarray(train_labels, dtype=bool)
        x = np.concatenate([self._calibrator_features(b) for b in blocks])
        y = np.concatenate(
            [np.full(b.logprob.shape[0], float(c)) for b, c in zip(blocks, labels, strict=True)]
        )
        groups = np.concatenate([np.full(b.logprob.shape[0], i) for i, b in enumerate(blocks)])
        if self.variant == "raw":
            self._check_raw_features(x)
        self.booster_, info = fit_xgb_calibrator(x, y, groups, **xgb_settings(self))
        self.fit_info_ = {
            **info,
            **ref.counts(),
            "train_responses": len(blocks),
            "train_tokens": int(x.shape[0]),
        }
        return self

    @staticmethod
    def _check_raw_features(x: np.ndarray) -> None:
        finite = np.isfinite(x[:, :-1]).all()
        if not finite:
            raise InvalidInputError("Raw token features contain NaN or inf.")
        if float(np.nanvar(x, axis=0).sum()) <= 0.0:
            raise InvalidInputError("All training token features are identical.")

    def _calibrator_features(self, block: TokenBlock) -> np.ndarray:
        """``[N, 3]`` (paper: d_corr, d_inc, p) or ``[N, 8L−2]`` (raw: ν, log p, entropy)."""
        if self.variant == "paper":
            return np.column_stack(
                [
                    self.gaussian_corr_.distance(block.geometry),
                    self.gaussian_inc_.distance(block.geometry),
                    np.exp(block.logprob),
                ]
            )
        return np.column_stack([block.geometry, block.logprob, block.entropy])

    # ---- scoring ---------------------------------------------------------------------

    def token_confidences(self, response: ResponseLike) -> np.ndarray:
        """Calibrated confidences ``p̂_t`` ``[N]`` of one response's tokens."""
        self._check_fitted()
        block = token_block(response, self.reference_means_, capture=self.capture)
        width = feature_width(self.num_layers_, self.capture)
        if width != block.geometry.shape[1]:
            raise ScoringError(
                f"The response has token vectors of width {block.geometry.shape[1]} but the "
                f"scorer was fitted for L={self.num_layers_} layers ({width})."
                " Use the artifact calibrated for this model."
            )
        return self._predict(self._calibrator_features(block))

    def _predict(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self.booster_.inplace_predict(x), dtype=np.float64)

    def score(self, response: ResponseLike) -> float:
        """``u = exp(−mean_t log p̂_t)`` (≥ 1; higher = more uncertain)."""
        return response_uncertainty(self.token_confidences(response))

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        """Scores ``[n]``, with one XGBoost call for all tokens."""
        return self.scores_of(self.token_blocks(responses))

    def token_blocks(self, responses: Sequence[ResponseLike]) -> list[TokenBlock]:
        """The per-token inputs of each response (Φ with this scorer's means)."""
        self._check_fitted()
        return [token_block(r, self.reference_means_, capture=self.capture) for r in responses]

    def scores_of(self, blocks: Sequence[TokenBlock]) -> np.ndarray:
        """Scores ``[n]`` of per-token inputs (:meth:`token_blocks`), one XGBoost call."""
        self._check_fitted()
        if not blocks:
            return np.zeros(0, dtype=np.float64)
        x = np.concatenate([self._calibrator_features(b) for b in blocks])
        p = self._predict(x)
        bounds = np.cumsum([0] + [b.logprob.shape[0] for b in blocks])
        return np.asarray(
            [response_uncertainty(p[a:b]) for a, b in itertools.pairwise(bounds)],
            dtype=np.float64,
        )

    def prepare(self, runnable: Any) -> Any:
        """Install the fitted means into every GeometryChatModel inside ``runnable`` (so the
        messages it produces carry Φ^in/Φ^out), switched to fast capture for ``"fast"``."""
        self._check_fitted()
        fast = self.capture if self.capture == "fast" else None
        return install_reference(runnable, self.reference_means_, capture=fast)

    # ---- state -----------------------------------------------------------------------

    def get_state(self) -> ScorerState:
        """JSON params + arrays (means, Gaussians) + ``calibrator.ubj``."""
        self._check_fitted()
        params: dict[str, Any] = {
            **{name: getattr(self, name) for name in _SETTINGS},
            "num_layers": self.num_layers_,
            "fit_info": self.fit_info_,
        }
        json.dumps(params)  # fail early on a non-JSON xgb parameter
        arrays = means_state(self.reference_means_)
        if self.variant == "paper":
            arrays.update(self.gaussian_corr_.arrays("gaussian_corr"))
            arrays.update(self.gaussian_inc_.arrays("gaussian_inc"))
        return ScorerState(
            kind=self.kind,
            params=params,
            arrays=arrays,
            files={"calibrator.ubj": booster_to_bytes(self.booster_)},
        )

    @classmethod
    def from_state(cls, state: ScorerState) -> GeometryScorer:
        """Rebuild a fitted scorer from :meth:`get_state` output."""
        p = dict(state.params)
        try:
            scorer = cls(
                **{name: p[name] for name in _SETTINGS},
                capture="fast" if state.kind == "geometry_fast" else "full",
            )
            scorer.num_layers_ = int(p["num_layers"])
            scorer.fit_info_ = dict(p["fit_info"])
            scorer.reference_means_ = means_from_state(state.arrays)
            if scorer.variant == "paper":
                scorer.gaussian_corr_ = Gaussian.from_arrays(state.arrays, "gaussian_corr")
                scorer.gaussian_inc_ = Gaussian.from_arrays(state.arrays, "gaussian_inc")
            scorer.booster_ = booster_from_bytes(state.files["calibrator.ubj"])
        except KeyError as exc:
            raise ArtifactSchemaError(
                f"Geometry scorer state is missing {exc}; the artifact is incomplete."
            ) from exc
        return scorer
