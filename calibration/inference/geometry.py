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
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import xgboost as xgb
from scipy.linalg import solve_triangular
from sklearn.covariance import OAS, LedoitWolf
from sklearn.model_selection import train_test_split

from abstain_guard.calibration.measure import metrics
from abstain_guard.errors import (
    InsufficientDataError,
    InvalidInputError,
    NotFittedError,
    ScoringError,
)
from abstain_guard.scoring import ResponseLike, Scorer, ScorerState, response_metadata_of

Variant = Literal["paper", "raw"]
CovarianceKind = Literal["ledoit_wolf", "oas"]

FAMILIES: tuple[str, ...] = ("omega", "theta", "phi_in", "phi_out")
"""The four geometry families, in token-vector order."""

DEFAULT_XGB_PARAMS: dict[str, Any] = {
    "objective": "binary:logistic",
    "eval_metric": "logloss",
    "max_depth": 3,
    "eta": 0.05,
    "subsample": 0.8,
    "min_child_weight": 1.0,
    "lambda": 1.0,
    "tree_method": "hist",
    "nthread": 2,
}
"""XGBoost parameters used when ``xgb_params`` is not given (merged with user values)."""

PROB_FLOOR = 1e-6
"""Calibrated confidences are clipped to ``[PROB_FLOOR, 1]`` before the log."""


# --------------------------------------------------------------------------------------
# pure math
# --------------------------------------------------------------------------------------


def response_uncertainty(token_confidences: np.ndarray, floor: float = PROB_FLOOR) -> float:
    """Perplexity-style aggregate ``exp(−mean_t log clip(p̂_t, floor, 1))``.

    Args:
        token_confidences: ``[N]`` calibrated confidences, ``N ≥ 1``.

    Raises:
        ScoringError: for an empty array or a NaN confidence.
    """
    p = np.asarray(token_confidences, dtype=np.float64)
    if p.size == 0:
        raise ScoringError("Cannot aggregate zero token confidences (the response has no tokens).")
    if not np.all(np.isfinite(p)):
        raise ScoringError("A calibrated token confidence is NaN or infinite.")
    p = np.clip(p, floor, 1.0)
    return float(math.exp(-float(np.mean(np.log(p)))))


@dataclass(frozen=True)
class Gaussian:
    """A Gaussian with a precomputed whitening matrix (``d(ν) = ‖(ν − mean) @ whiten‖``).

    Attributes:
        mean: ``[F]``.
        whiten: ``[F, F]``, ``inv(chol(Σ)).T`` so that ``whiten @ whiten.T = Σ^{-1}``.
    """

    mean: np.ndarray
    whiten: np.ndarray

    def distance(self, x: np.ndarray) -> np.ndarray:
        """Mahalanobis distances of rows ``x`` ``[n, F]`` → ``[n]``."""
        z = (x - self.mean) @ self.whiten
        return np.sqrt(np.einsum("ij,ij->i", z, z))


def fit_gaussian(x: np.ndarray, covariance: CovarianceKind = "ledoit_wolf") -> Gaussian:
    """Fit mean and shrinkage covariance to rows ``x`` ``[n, F]`` (``n ≥ 2``).

    The covariance comes from scikit-learn's :class:`~sklearn.covariance.LedoitWolf` or
    :class:`~sklearn.covariance.OAS`; if it is still numerically singular a jitter of
    ``1e-9 · mean(diag)`` is added (reported nowhere else; it only happens with constant
    columns and no shrinkage).

    Raises:
        InsufficientDataError: fewer than two rows.
        InvalidInputError: NaN/inf values, or all rows identical (zero variance).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise InsufficientDataError(
            f"Need at least 2 token vectors to fit a Gaussian, got shape {x.shape}. "
            "Add more reference responses of this class."
        )
    if not np.all(np.isfinite(x)):
        raise InvalidInputError(
            "Token feature vectors contain NaN or infinite values (zero-norm hidden states?). "
            "Check the model's geometry output."
        )
    variances = x.var(axis=0)
    if float(variances.sum()) <= 0.0:
        raise InvalidInputError(
            "All token feature vectors are identical: a Gaussian cannot be fitted. "
            "The reference responses carry no geometric variation; use more varied data."
        )
    estimator = LedoitWolf() if covariance == "ledoit_wolf" else OAS()
    estimator.fit(x)
    cov = np.asarray(estimator.covariance_, dtype=np.float64)
    mean = np.asarray(estimator.location_, dtype=np.float64)
    jitter = 1e-9 * float(np.mean(np.diag(cov)))
    for _ in range(6):
        try:
            chol = np.linalg.cholesky(cov)
            break
        except np.linalg.LinAlgError:
            cov = cov + jitter * np.eye(cov.shape[0])
            jitter *= 100.0
    else:  # pragma: no cover - only for pathological inputs
        raise InvalidInputError("The feature covariance is singular even after regularization.")
    whiten = solve_triangular(chol, np.eye(chol.shape[0]), lower=True).T
    return Gaussian(mean=mean, whiten=np.ascontiguousarray(whiten))


def family_slices(num_layers: int) -> dict[str, slice]:
    """Column ranges of Ω, Θ, Φ^in, Φ^out in the ``8L−4`` token vector."""
    k = 2 * num_layers - 1
    return {name: slice(i * k, (i + 1) * k) for i, name in enumerate(FAMILIES)}


def auroc_auprc(uncertainty: np.ndarray, correct: np.ndarray) -> tuple[float, float]:
    """AUROC and AUPRC in the project's convention
    (:mod:`abstain_guard.calibration.measure.metrics`: AUROC for detecting incorrect
    answers, AUPRC of the confidence for correct ones)."""
    return float(metrics.auroc(uncertainty, correct)), float(metrics.auprc(uncertainty, correct))


# --------------------------------------------------------------------------------------
# reading responses
# --------------------------------------------------------------------------------------


@dataclass
class TokenBlock:
    """Per-token inputs of one response.

    Attributes:
        geometry: ``[N, 8L−4]`` (Ω, Θ, Φ^in, Φ^out).
        logprob: ``[N]`` log-probability of each generated token (EOS included when generated).
        entropy: ``[N]`` full-vocabulary entropy (NaN where the message has none).
    """

    geometry: np.ndarray
    logprob: np.ndarray
    entropy: np.ndarray


def _split_response(response: Any) -> tuple[Mapping[str, Any], Any]:
    """``(metadata, states_or_None)`` of a ReplayResult, message or metadata mapping."""
    if hasattr(response, "metadata") and hasattr(response, "states"):
        meta = response.metadata
        if not isinstance(meta, Mapping):
            raise InvalidInputError("ReplayResult.metadata must be a mapping.")
        return meta, response.states
    return response_metadata_of(response), None


def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").float().numpy()
    return np.asarray(x, dtype=np.float64)


def _geometry_of(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    geometry = meta.get("geometry")
    if not isinstance(geometry, Mapping):
        raise ScoringError(
            "The response carries no geometry (response_metadata['geometry'] is missing). "
            "Generate it with a GeometryChatModel from abstain_guard.adapters."
        )
    return geometry


def logprobs_of(meta: Mapping[str, Any]) -> np.ndarray:
    """``[N]`` token log-probabilities from OpenAI-style ``logprobs.content``.

    Raises:
        ScoringError: when the message has no logprobs.
    """
    lp = meta.get("logprobs")
    content = lp.get("content") if isinstance(lp, Mapping) else None
    if content is None:
        raise ScoringError(
            "The response has no token logprobs (response_metadata['logprobs']['content'])."
        )
    return np.asarray([float(item["logprob"]) for item in content], dtype=np.float64)


def token_block(
    response: Any,
    means: Any | None,
    *,
    require_states: bool = False,
) -> TokenBlock:
    """Assemble the per-token inputs of one response.

    Φ comes from the response's hidden states and ``means`` when it has states, otherwise
    from ``geometry['phi_in'/'phi_out']``.

    Raises:
        ScoringError: missing geometry, logprobs, Φ or states; inconsistent lengths;
            NaN/inf features.
    """
    meta, states = _split_response(response)
    geometry = _geometry_of(meta)
    omega = np.asarray(geometry.get("omega"), dtype=np.float64)
    theta = np.asarray(geometry.get("theta"), dtype=np.float64)
    n = omega.shape[0] if omega.ndim == 2 else 0
    logprob = logprobs_of(meta)
    if states is not None and means is not None:
        from abstain_guard.adapters.geometry import phi_from_states

        post_attn = _as_numpy(states.post_attn)
        post_mlp = _as_numpy(states.post_mlp)
        phi_in = _as_numpy(
            phi_from_states(post_attn, post_mlp, means.post_attn_in, means.post_mlp_in)
        )
        phi_out = _as_numpy(
            phi_from_states(post_attn, post_mlp, means.post_attn_out, means.post_mlp_out)
        )
    elif require_states:
        raise ScoringError(
            "Reference responses need hidden states to fit the mean directions: pass "
            "ReplayResults from model.replay(..., return_states=True)."
        )
    else:
        if geometry.get("phi_in") is None or geometry.get("phi_out") is None:
            raise ScoringError(
                "The response carries no Φ^in/Φ^out. Score messages produced by the model "
                "returned by scorer.prepare(model) (it calls model.with_reference(...)), or "
                "pass a ReplayResult with states."
            )
        phi_in = np.asarray(geometry["phi_in"], dtype=np.float64)
        phi_out = np.asarray(geometry["phi_out"], dtype=np.float64)
    if n == 0 or logprob.shape[0] == 0:
        raise ScoringError(
            "The response has no generated tokens; nothing to score. (An answer that is only "
            "an EOS token still has one token; a response with zero tokens has none.)"
        )
    parts = [omega, theta, phi_in, phi_out]
    width = omega.shape[1]
    if any(p.ndim != 2 or p.shape != (n, width) for p in parts) or logprob.shape[0] != n:
        raise ScoringError(
            "Inconsistent per-token shapes: omega "
            f"{omega.shape}, theta {theta.shape}, phi_in {phi_in.shape}, phi_out {phi_out.shape}, "
            f"logprobs {logprob.shape}. Each must have one row per generated token."
        )
    vec = np.concatenate(parts, axis=1)
    if not np.all(np.isfinite(vec)) or not np.all(np.isfinite(logprob)):
        raise ScoringError(
            "Token features contain NaN or inf (a zero-norm hidden state makes an angle "
            "undefined). This response cannot be scored by the geometry scorer."
        )
    ent = meta.get("entropy")
    entropy = (
        np.asarray(ent, dtype=np.float64)
        if ent is not None and len(ent) == n
        else np.full(n, np.nan, dtype=np.float64)
    )
    return TokenBlock(geometry=vec, logprob=logprob, entropy=entropy)


# --------------------------------------------------------------------------------------
# XGBoost helpers (shared with CalibratedScorer)
# --------------------------------------------------------------------------------------


def fit_xgb_calibrator(
    x: np.ndarray,
    y: np.ndarray,
    groups: np.ndarray,
    *,
    params: Mapping[str, Any],
    num_boost_round: int,
    early_stopping_rounds: int,
    validation_fraction: float,
    random_state: int,
) -> tuple[xgb.Booster, dict[str, Any]]:
    """Train ``binary:logistic`` XGBoost on rows ``x`` ``[n, F]`` with labels ``y`` ``[n]``.

    ``groups`` ``[n]`` names the response of each row; the early-stopping hold-out is a
    stratified ``validation_fraction`` of *responses* (never tokens of one response on both
    sides). With too few responses for a stratified hold-out (fewer than 2 of either class
    in it) training runs the full ``num_boost_round`` rounds without early stopping, which
    is recorded in the returned info.

    Returns:
        The booster (sliced to its best iteration) and a JSON-able info dict.

    Raises:
        InsufficientDataError: if ``y`` has a single class.
    """
    y = np.asarray(y, dtype=np.float64)
    if np.unique(y).size < 2:
        raise InsufficientDataError(
            "The training split has only one class (all correct or all incorrect); the "
            "calibrator needs both. Use a larger or more varied training split."
        )
    uniq, first = np.unique(groups, return_index=True)
    group_labels = y[first]
    info: dict[str, Any] = {"early_stopping": False}
    train_idx = np.arange(len(y))
    val_idx: np.ndarray | None = None
    n_val = round(validation_fraction * len(uniq))
    counts = np.bincount(group_labels.astype(int), minlength=2)
    if validation_fraction > 0 and n_val >= 2 and counts.min() >= 4:
        _, g_val = train_test_split(
            uniq, test_size=n_val, stratify=group_labels, random_state=random_state
        )
        val_mask = np.isin(groups, g_val)
        train_idx, val_idx = np.flatnonzero(~val_mask), np.flatnonzero(val_mask)
    p = dict(params)
    p.setdefault("seed", random_state)
    dtrain = xgb.DMatrix(x[train_idx], label=y[train_idx])
    if val_idx is not None and np.unique(y[val_idx]).size == 2:
        dval = xgb.DMatrix(x[val_idx], label=y[val_idx])
        booster = xgb.train(
            p,
            dtrain,
            num_boost_round=num_boost_round,
            evals=[(dval, "validation")],
            early_stopping_rounds=early_stopping_rounds,
            verbose_eval=False,
        )
        best = int(booster.best_iteration)
        booster = booster[: best + 1]
        info = {"early_stopping": True, "best_iteration": best}
    else:
        booster = xgb.train(p, dtrain, num_boost_round=num_boost_round, verbose_eval=False)
        info["best_iteration"] = num_boost_round - 1
    booster.set_param({"nthread": 1})
    return booster, info


def booster_to_bytes(booster: xgb.Booster) -> bytes:
    """Serialize with XGBoost's own UBJSON format (no pickle)."""
    return bytes(booster.save_raw("ubj"))


def booster_from_bytes(raw: bytes) -> xgb.Booster:
    """Load a booster written by :func:`booster_to_bytes`."""
    booster = xgb.Booster()
    booster.load_model(bytearray(raw))
    booster.set_param({"nthread": 1})
    return booster


# --------------------------------------------------------------------------------------
# the scorer
# --------------------------------------------------------------------------------------


@dataclass
class FeatureImportance:
    """Permutation ablation result (paper §5.3).

    Attributes:
        auroc: AUROC of the unpermuted scores; ``auprc`` likewise.
        drops: per family, ``{"auroc_mean", "auroc_sd", "auprc_mean", "auprc_sd"}`` of the
            drop (unpermuted − permuted) over ``n_repeats`` permutations.
    """

    auroc: float
    auprc: float
    drops: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"auroc": self.auroc, "auprc": self.auprc, "drops": self.drops}


LabeledResponses = Sequence[tuple[Any, bool]]


class GeometryScorer(Scorer):
    """The paper's geometry-calibrated uncertainty (§4.5); higher = more uncertain.

    Args:
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

    kind: ClassVar[str] = "geometry"

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
    ) -> None:
        if variant not in ("paper", "raw"):
            raise InvalidInputError(f"variant must be 'paper' or 'raw', got {variant!r}.")
        if covariance not in ("ledoit_wolf", "oas"):
            raise InvalidInputError(
                f"covariance must be 'ledoit_wolf' or 'oas', got {covariance!r}."
            )
        if not 0.0 <= validation_fraction < 1.0:
            raise InvalidInputError("validation_fraction must be in [0, 1).")
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
        return "geometry" if self.variant == "paper" else "geometry_raw"

    # ---- fitting ---------------------------------------------------------------------

    def _check_fitted(self) -> None:
        if not hasattr(self, "booster_"):
            raise NotFittedError(
                "GeometryScorer is not fitted: call fit(reference, train) or load it from "
                "an artifact first."
            )

    def fit(self, reference: LabeledResponses, train: LabeledResponses) -> GeometryScorer:
        """Fit reference means, Gaussians and the XGBoost calibrator.

        Args:
            reference: ``(ReplayResult with states, correct)`` pairs.
            train: ``(response, correct)`` pairs; each response a ReplayResult with states
                or a message whose geometry carries Φ computed with the means fitted here
                (in practice: ReplayResults with states).

        Raises:
            InsufficientDataError: too few correct/incorrect reference responses or tokens,
                or a single class in the training split.
            InvalidInputError: identical or NaN features.
            ScoringError: a response lacks what is needed (states, logprobs, geometry).
        """
        from abstain_guard.adapters import ReferenceMeans

        ref = list(reference)
        correct_states = [r.states for r, c in ref if c and getattr(r, "states", None) is not None]
        incorrect_states = [
            r.states for r, c in ref if not c and getattr(r, "states", None) is not None
        ]
        n_c = sum(1 for _, c in ref if c)
        n_i = len(ref) - n_c
        if n_c < self.min_reference_responses or n_i < self.min_reference_responses:
            raise InsufficientDataError(
                f"The reference split has {n_c} correct and {n_i} incorrect responses; at "
                f"least {self.min_reference_responses} of each are needed to fit the mean "
                "directions and Gaussians. Use a larger reference split."
            )
        if len(correct_states) != n_c or len(incorrect_states) != n_i:
            raise ScoringError(
                "Every reference response must carry hidden states: pass ReplayResults from "
                "model.replay(..., return_states=True)."
            )
        means = ReferenceMeans.from_states(correct_states, incorrect_states)
        self.reference_means_ = means
        ref_blocks = [token_block(r, means, require_states=True) for r, _ in ref]
        width = ref_blocks[0].geometry.shape[1]
        if (width + 4) % 8 != 0:
            raise InvalidInputError(f"Token vectors of width {width} are not 8L−4 wide.")
        self.num_layers_ = (width + 4) // 8
        ref_labels = np.asarray([bool(c) for _, c in ref])
        if self.variant == "paper":
            x_c = np.concatenate(
                [b.geometry for b, c in zip(ref_blocks, ref_labels, strict=True) if c]
            )
            x_i = np.concatenate(
                [b.geometry for b, c in zip(ref_blocks, ref_labels, strict=True) if not c]
            )
            self.gaussian_corr_ = fit_gaussian(x_c, self.covariance)
            self.gaussian_inc_ = fit_gaussian(x_i, self.covariance)

        tr = list(train)
        blocks = [token_block(r, means) for r, _ in tr]
        x = np.concatenate([self._calibrator_features(b) for b in blocks])
        y = np.concatenate(
            [
                np.full(b.logprob.shape[0], float(bool(c)))
                for b, (_, c) in zip(blocks, tr, strict=True)
            ]
        )
        groups = np.concatenate([np.full(b.logprob.shape[0], i) for i, b in enumerate(blocks)])
        if self.variant == "raw":
            self._check_raw_features(x)
        params = {**DEFAULT_XGB_PARAMS, **self.xgb_params}
        self.booster_, info = fit_xgb_calibrator(
            x,
            y,
            groups,
            params=params,
            num_boost_round=self.num_boost_round,
            early_stopping_rounds=self.early_stopping_rounds,
            validation_fraction=self.validation_fraction,
            random_state=self.random_state,
        )
        self.fit_info_ = {
            **info,
            "reference_responses": [int(n_c), int(n_i)],
            "reference_tokens": [
                int(sum(b.logprob.size for b, c in zip(ref_blocks, ref_labels, strict=True) if c)),
                int(
                    sum(
                        b.logprob.size for b, c in zip(ref_blocks, ref_labels, strict=True) if not c
                    )
                ),
            ],
            "train_responses": len(tr),
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
        block = token_block(response, self.reference_means_)
        if self.num_layers_ * 8 - 4 != block.geometry.shape[1]:
            raise ScoringError(
                f"The response has token vectors of width {block.geometry.shape[1]} but the "
                f"scorer was fitted for L={self.num_layers_} layers ({8 * self.num_layers_ - 4})."
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
        self._check_fitted()
        blocks = [token_block(r, self.reference_means_) for r in responses]
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
        messages it produces carry Φ^in/Φ^out)."""
        self._check_fitted()
        from abstain_guard.runnables import map_chat_models

        means = self.reference_means_

        def install(model: Any) -> Any:
            return model.with_reference(means) if hasattr(model, "with_reference") else model

        return map_chat_models(runnable, install)

    # ---- analysis --------------------------------------------------------------------

    def feature_importance(
        self,
        responses: Sequence[ResponseLike],
        labels: Sequence[bool],
        n_repeats: int = 5,
        random_state: int = 0,
    ) -> FeatureImportance:
        """Permutation ablation: permute each of Ω, Θ, Φ^in, Φ^out across all tokens of
        ``responses`` (rows of that family's block shuffled together) and report the drop
        in AUROC/AUPRC (mean and sd over ``n_repeats``)."""
        self._check_fitted()
        correct = np.asarray(labels, dtype=bool)
        if len(correct) != len(responses):
            raise InvalidInputError("responses and labels must have the same length.")
        blocks = [token_block(r, self.reference_means_) for r in responses]
        bounds = np.cumsum([0] + [b.logprob.shape[0] for b in blocks])
        geom = np.concatenate([b.geometry for b in blocks])
        logprob = np.concatenate([b.logprob for b in blocks])
        entropy = np.concatenate([b.entropy for b in blocks])

        def scores_for(g: np.ndarray) -> np.ndarray:
            p = self._predict(
                self._calibrator_features(TokenBlock(geometry=g, logprob=logprob, entropy=entropy))
            )
            return np.asarray([response_uncertainty(p[a:b]) for a, b in itertools.pairwise(bounds)])

        base_auroc, base_auprc = auroc_auprc(scores_for(geom), correct)
        rng = np.random.default_rng(random_state)
        result = FeatureImportance(auroc=base_auroc, auprc=base_auprc)
        for fam, sl in family_slices(self.num_layers_).items():
            d_roc, d_prc = [], []
            for _ in range(n_repeats):
                g = geom.copy()
                g[:, sl] = geom[rng.permutation(geom.shape[0]), sl]
                a, p = auroc_auprc(scores_for(g), correct)
                d_roc.append(base_auroc - a)
                d_prc.append(base_auprc - p)
            result.drops[fam] = {
                "auroc_mean": float(np.mean(d_roc)),
                "auroc_sd": float(np.std(d_roc, ddof=1)) if n_repeats > 1 else 0.0,
                "auprc_mean": float(np.mean(d_prc)),
                "auprc_sd": float(np.std(d_prc, ddof=1)) if n_repeats > 1 else 0.0,
            }
        return result

    # ---- state -----------------------------------------------------------------------

    def get_state(self) -> ScorerState:
        """JSON params + arrays (means, Gaussians) + ``calibrator.ubj``."""
        self._check_fitted()
        params: dict[str, Any] = {
            "variant": self.variant,
            "covariance": self.covariance,
            "xgb_params": self.xgb_params,
            "num_boost_round": self.num_boost_round,
            "early_stopping_rounds": self.early_stopping_rounds,
            "validation_fraction": self.validation_fraction,
            "min_reference_responses": self.min_reference_responses,
            "random_state": self.random_state,
            "num_layers": self.num_layers_,
            "fit_info": self.fit_info_,
        }
        json.dumps(params)  # fail early on a non-JSON xgb parameter
        arrays = {
            f"reference_means.{k}": np.asarray(v)
            for k, v in self.reference_means_.to_arrays().items()
        }
        if self.variant == "paper":
            arrays.update(
                {
                    "gaussian_corr.mean": self.gaussian_corr_.mean,
                    "gaussian_corr.whiten": self.gaussian_corr_.whiten,
                    "gaussian_inc.mean": self.gaussian_inc_.mean,
                    "gaussian_inc.whiten": self.gaussian_inc_.whiten,
                }
            )
        return ScorerState(
            kind=self.kind,
            params=params,
            arrays=arrays,
            files={"calibrator.ubj": booster_to_bytes(self.booster_)},
        )

    @classmethod
    def from_state(cls, state: ScorerState) -> GeometryScorer:
        """Rebuild a fitted scorer from :meth:`get_state` output."""
        from abstain_guard.adapters import ReferenceMeans

        p = dict(state.params)
        try:
            scorer = cls(
                variant=p["variant"],
                covariance=p["covariance"],
                xgb_params=p.get("xgb_params"),
                num_boost_round=p.get("num_boost_round", 500),
                early_stopping_rounds=p.get("early_stopping_rounds", 30),
                validation_fraction=p.get("validation_fraction", 0.2),
                min_reference_responses=p.get("min_reference_responses", 2),
                random_state=p.get("random_state", 0),
            )
            scorer.num_layers_ = int(p["num_layers"])
            scorer.fit_info_ = dict(p.get("fit_info", {}))
            prefix = "reference_means."
            scorer.reference_means_ = ReferenceMeans.from_arrays(
                {k[len(prefix) :]: v for k, v in state.arrays.items() if k.startswith(prefix)}
            )
            if scorer.variant == "paper":
                scorer.gaussian_corr_ = Gaussian(
                    state.arrays["gaussian_corr.mean"], state.arrays["gaussian_corr.whiten"]
                )
                scorer.gaussian_inc_ = Gaussian(
                    state.arrays["gaussian_inc.mean"], state.arrays["gaussian_inc.whiten"]
                )
            scorer.booster_ = booster_from_bytes(state.files["calibrator.ubj"])
        except KeyError as exc:
            from abstain_guard.errors import ArtifactSchemaError

            raise ArtifactSchemaError(
                f"Geometry scorer state is missing {exc}; the artifact is incomplete."
            ) from exc
        return scorer
