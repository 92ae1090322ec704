"""The geometry scorer's calibrator: shrinkage Gaussians (Mahalanobis distances), the
XGBoost model from token features to a calibrated token confidence, and the perplexity-style
aggregate of token confidences into one response uncertainty (paper §4.5).

A Gaussian's distance and the aggregate are numpy; scikit-learn is imported to fit a
Gaussian, XGBoost to train or run the calibrator (:func:`xgboost_module`: refused by name,
with the extra that installs it, where it is missing)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from scipy.linalg import solve_triangular

from abstain_guard.errors import InsufficientDataError, InvalidInputError, ScoringError
from abstain_guard.scorers._base import optional_module

if TYPE_CHECKING:
    import xgboost as xgb

CovarianceKind = Literal["ledoit_wolf", "oas"]

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

XGB_SETTINGS = (
    "xgb_params",
    "num_boost_round",
    "early_stopping_rounds",
    "validation_fraction",
    "random_state",
)
"""The calibrator's fitting settings: what a scorer with an XGBoost calibrator takes, holds
as attributes, stores in its state and passes to :func:`fit_xgb_calibrator`."""


def xgb_settings(scorer: Any) -> dict[str, Any]:
    """``scorer``'s :data:`XGB_SETTINGS`, by name."""
    return {name: getattr(scorer, name) for name in XGB_SETTINGS}


PROB_FLOOR = 1e-6
"""Calibrated confidences are clipped to ``[PROB_FLOOR, 1]`` before the log."""


def xgboost_module() -> ModuleType:
    """``xgboost``, which the XGBoost calibrator needs to train and to score.

    Raises:
        MissingExtraError: it is not installed (naming the extra that installs it).
    """
    return optional_module("xgboost", "The XGBoost calibrator (geometry scorers, calibrated)")


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

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        """Its arrays as ``name.mean`` and ``name.whiten`` (for a scorer's state)."""
        return {f"{name}.mean": self.mean, f"{name}.whiten": self.whiten}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], name: str) -> Gaussian:
        """The Gaussian :meth:`arrays` stored under ``name`` (KeyError when one is missing)."""
        return cls(arrays[f"{name}.mean"], arrays[f"{name}.whiten"])


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
    shrinkage = optional_module("sklearn.covariance", "Fitting a Gaussian")
    estimator = shrinkage.LedoitWolf() if covariance == "ledoit_wolf" else shrinkage.OAS()
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


def fit_xgb_calibrator(
    x: np.ndarray,
    y: np.ndarray,
    groups: np.ndarray,
    *,
    xgb_params: Mapping[str, Any],
    num_boost_round: int,
    early_stopping_rounds: int,
    validation_fraction: float,
    random_state: int,
) -> tuple[xgb.Booster, dict[str, Any]]:
    """Train ``binary:logistic`` XGBoost (``xgb_params`` over :data:`DEFAULT_XGB_PARAMS`) on
    rows ``x`` ``[n, F]`` with labels ``y`` ``[n]``.

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
    boost = xgboost_module()
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
        selection = optional_module("sklearn.model_selection", "Training the calibrator")
        _, g_val = selection.train_test_split(
            uniq, test_size=n_val, stratify=group_labels, random_state=random_state
        )
        val_mask = np.isin(groups, g_val)
        train_idx, val_idx = np.flatnonzero(~val_mask), np.flatnonzero(val_mask)
    p = {**DEFAULT_XGB_PARAMS, **xgb_params}
    p.setdefault("seed", random_state)
    dtrain = boost.DMatrix(x[train_idx], label=y[train_idx])
    if val_idx is not None and np.unique(y[val_idx]).size == 2:
        dval = boost.DMatrix(x[val_idx], label=y[val_idx])
        booster = boost.train(
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
        booster = boost.train(p, dtrain, num_boost_round=num_boost_round, verbose_eval=False)
        info["best_iteration"] = num_boost_round - 1
    booster.set_param({"nthread": 1})
    return booster, info


def booster_to_bytes(booster: xgb.Booster) -> bytes:
    """Serialize with XGBoost's own UBJSON format (no pickle)."""
    return bytes(booster.save_raw("ubj"))


def booster_from_bytes(raw: bytes) -> xgb.Booster:
    """Load a booster written by :func:`booster_to_bytes`.

    Raises:
        MissingExtraError: XGBoost is not installed.
    """
    booster = xgboost_module().Booster()
    booster.load_model(bytearray(raw))
    booster.set_param({"nthread": 1})
    return booster
