"""A standardised L2 logistic regression whose strength is chosen by stratified
cross-validation on the fitting answers only, stored as plain arrays (no pickle), scored
row by row with an exactly rounded sum (:func:`row_dot`) so a response scored alone gets
bitwise its score in a batch, on any processor.

Scoring is numpy alone, in the core install and the full one the same way; scikit-learn is
imported only to fit (:func:`fit_linear_probe`, :func:`out_of_fold_logits`). Shared by the
hidden-state probes (:mod:`.probe`), :mod:`.likelihood_probe` and :mod:`.geometry_plus`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from abstain_guard.errors import ArtifactSchemaError, InsufficientDataError, InvalidInputError
from abstain_guard.scorers._base import optional_module

PROBE_CS: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
"""Inverse L2 strengths the cross-validation chooses from (features standardised)."""


def row_dot(z: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """``Σ_j z[i, j]·coef[j]`` per row: ``z [n, F]``, ``coef [F]`` → ``[n]``.

    Each product is one IEEE multiplication and each row's sum is exactly rounded
    (:func:`math.fsum`), so a row's value does not depend on the order of the additions:
    not on the number of rows, numpy's SIMD width (AVX2 and AVX-512 reduce in other orders,
    so a plain ``(z * coef).sum(axis=1)`` differs in the last bit between a batch and a lone
    row) or a BLAS kernel. A response scored alone gets bitwise the score calibration gave
    it in a batch, on every processor."""
    prod = np.asarray(z, dtype=np.float64) * np.asarray(coef, dtype=np.float64)
    if prod.ndim != 2:
        raise InvalidInputError(f"row_dot needs rows [n, F], got shape {prod.shape}.")
    return np.fromiter(
        (math.fsum(row) for row in prod.tolist()), dtype=np.float64, count=prod.shape[0]
    )


def check_cs(cs: Sequence[float], cv_folds: int) -> tuple[float, ...]:
    """``cs`` as positive floats; raises InvalidInputError for a bad grid or fold count."""
    out = tuple(float(c) for c in cs)
    if not out or any(not np.isfinite(c) or c <= 0 for c in out):
        raise InvalidInputError(f"cs must be positive finite numbers, got {out!r}.")
    if int(cv_folds) < 2:
        raise InvalidInputError(f"cv_folds must be at least 2, got {cv_folds}.")
    return out


@dataclass
class LinearProbe:
    """A fitted standardised logistic model: ``logit = ((x − mean) / scale) · coef + b``
    (positive logit: the answer is predicted *correct*)."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    C: float
    cv_auroc: dict[str, float]

    def logits(self, x: np.ndarray) -> np.ndarray:
        """``[n]`` logits of rows ``x [n, F]`` (:func:`row_dot`: the same bits for a row
        alone or in a batch, on any processor)."""
        z = (np.asarray(x, dtype=np.float64) - self.mean) / self.scale
        return np.asarray(row_dot(z, self.coef) + self.intercept, dtype=np.float64)

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        """Its arrays under ``prefix`` (for a :class:`ScorerState`)."""
        return {
            f"{prefix}mean": self.mean,
            f"{prefix}scale": self.scale,
            f"{prefix}coef": self.coef,
        }

    def params(self) -> dict[str, Any]:
        """Its scalars (JSON)."""
        return {"intercept": self.intercept, "C": self.C, "cv_auroc_by_C": self.cv_auroc}

    @classmethod
    def from_parts(
        cls, params: Mapping[str, Any], arrays: Mapping[str, np.ndarray], prefix: str
    ) -> LinearProbe:
        """Rebuild from :meth:`params` and :meth:`arrays`.

        Raises:
            ArtifactSchemaError: a part is missing or the shapes disagree.
        """
        try:
            probe = cls(
                mean=np.asarray(arrays[f"{prefix}mean"], dtype=np.float64),
                scale=np.asarray(arrays[f"{prefix}scale"], dtype=np.float64),
                coef=np.asarray(arrays[f"{prefix}coef"], dtype=np.float64),
                intercept=float(params["intercept"]),
                C=float(params["C"]),
                cv_auroc=dict(params.get("cv_auroc_by_C", {})),
            )
        except KeyError as exc:
            raise ArtifactSchemaError(
                f"The probe state is missing {exc}; the artifact is incomplete."
            ) from exc
        if not (probe.mean.shape == probe.scale.shape == probe.coef.shape) or probe.coef.ndim != 1:
            raise ArtifactSchemaError("The probe's coefficient arrays disagree in shape.")
        return probe


def _standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale[scale <= 0] = 1.0
    return (x - mean) / scale, mean, scale


def _folds(folds: int, seed: int) -> Any:
    selection = optional_module("sklearn.model_selection", "Fitting a linear probe")
    return selection.StratifiedKFold(folds, shuffle=True, random_state=seed)


def fit_linear_probe(
    x: np.ndarray,
    correct: np.ndarray,
    cs: Sequence[float],
    folds: int,
    seed: int,
    what: str,
    *,
    max_iter: int = 5_000,
) -> LinearProbe:
    """Fit on rows ``x [n, F]`` with labels ``correct [n]``; C by ``folds``-fold stratified
    CV (AUROC) over ``cs``. ``what`` names the scorer in the error message.

    Raises:
        InsufficientDataError: fewer than ``folds`` answers of a class.
        MissingExtraError: scikit-learn is not installed.
    """
    y = np.asarray(correct, dtype=bool)
    counts = np.bincount(y.astype(int), minlength=2)
    if counts.min() < folds:
        raise InsufficientDataError(
            f"{what} is fitted on {counts[1]} correct and {counts[0]} incorrect answers; it "
            f"needs at least {folds} of each for its cross-validation. Use more questions."
        )
    linear = optional_module("sklearn.linear_model", "Fitting a linear probe")
    z, mean, scale = _standardise(np.asarray(x, dtype=np.float64))
    model = linear.LogisticRegressionCV(
        Cs=list(cs), cv=_folds(folds, seed), scoring="roc_auc", max_iter=max_iter
    )
    with warnings.catch_warnings():  # scikit-learn 1.8 announces 1.10 API changes
        warnings.simplefilter("ignore", FutureWarning)
        model.fit(z, y)
    cv_auroc = np.asarray(next(iter(model.scores_.values())), dtype=np.float64).mean(axis=0)
    return LinearProbe(
        mean=mean,
        scale=scale,
        coef=np.asarray(model.coef_[0], dtype=np.float64),
        intercept=float(model.intercept_[0]),
        C=float(model.C_[0]),
        cv_auroc={str(c): round(float(a), 4) for c, a in zip(cs, cv_auroc, strict=True)},
    )


def out_of_fold_logits(
    x: np.ndarray, correct: np.ndarray, C: float, folds: int, seed: int
) -> np.ndarray:
    """Logits of each fitting row from a model (strength ``C``, standardised within the
    fold) that did not see it: the honest input of a second-stage model."""
    linear = optional_module("sklearn.linear_model", "Fitting a linear probe")
    y = np.asarray(correct, dtype=bool)
    out = np.empty(len(y), dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    for fit_idx, held_idx in _folds(folds, seed).split(x, y):
        z, mean, scale = _standardise(x[fit_idx])
        model = linear.LogisticRegression(C=C, max_iter=5_000).fit(z, y[fit_idx])
        out[held_idx] = model.decision_function((x[held_idx] - mean) / scale)
    return out
