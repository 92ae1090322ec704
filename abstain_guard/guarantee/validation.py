"""One validator for uncertainty scores and 0/1 correctness labels, pure numpy.

The conformal thresholds (:mod:`abstain_guard.guarantee.conformal`), the calibration artifact
(:mod:`abstain_guard.artifact`) and the evaluation metrics
(:mod:`abstain_guard.calibration.measure.metrics`) all take the same two inputs:

* ``scores`` ``[n]`` — one uncertainty per answer, higher = less reliable;
* ``correct`` ``[n]`` — one label per answer, 1/True = the answer was judged correct.

Where the callers differ, a parameter says so and each caller keeps its behaviour:

* ``check_scores(..., allow_inf=True)`` for metrics, where a score only has to rank
  (``±inf`` is kept); thresholds and artifacts need finite scores (the default). NaN is an
  error everywhere.
* ``check_labels`` returns int64 0/1 (what the metrics count with); the conformal code and
  the artifact, which index with the labels, take ``.astype(bool)`` of it.
* ``require_both_classes(..., what=, hint=)`` names the computation that needs both classes
  and what to do about it.

Every error is an :class:`~abstain_guard.errors.InvalidInputError` (wrong shape, type or
value) or an :class:`~abstain_guard.errors.InsufficientDataError` (empty, one class only).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.errors import InsufficientDataError, InvalidInputError

__all__ = ["check_labels", "check_scores", "require_both_classes"]


def check_scores(
    scores: ArrayLike, *, name: str = "scores", allow_inf: bool = False
) -> NDArray[np.float64]:
    """Validate uncertainty scores ``[n]`` and return them as float64.

    Args:
        scores: one score per answer.
        name: what to call the argument in error messages.
        allow_inf: keep ``±inf`` (metrics: a score only has to rank); by default every score
            must be finite (conformal thresholds, artifacts).

    Raises:
        InvalidInputError: not numeric, not 1-D, NaN (or ``±inf`` without ``allow_inf``).
        InsufficientDataError: empty.
    """
    try:
        arr = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"{name} must be a 1-D array of numbers; could not convert it ({exc})."
        ) from exc
    if arr.ndim != 1:
        raise InvalidInputError(
            f"{name} must be 1-D (one score per answer); got shape {arr.shape}."
        )
    if arr.size == 0:
        raise InsufficientDataError(f"{name} is empty; pass at least two scored responses.")
    bad = np.isnan(arr) if allow_inf else ~np.isfinite(arr)
    if bad.any():
        what = "NaN" if allow_inf else "NaN or infinite"
        raise InvalidInputError(
            f"{name} contains {int(bad.sum())} {what} value(s) of {arr.size} (first at "
            f"positions {np.flatnonzero(bad)[:5].tolist()}); drop or re-score the answers the "
            "scorer could not score (or fix the scorer) first."
        )
    return arr


def check_labels(correct: ArrayLike, n: int | None = None) -> NDArray[np.int64]:
    """Validate correctness labels ``[n]`` (0/1 or False/True) and return them as int64 0/1.

    Args:
        correct: one label per answer.
        n: the number of scores the labels belong to (checked when given).

    Raises:
        InvalidInputError: not numeric, not 1-D, a length other than ``n`` (checked before
            emptiness: no labels for ``n`` scores is a mismatch), or a value other than 0/1.
        InsufficientDataError: empty (with ``n`` not given).
    """
    try:
        arr = np.asarray(correct, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(
            f"correct must be a 1-D array of 0/1 (or False/True) labels; could not convert it "
            f"({exc})."
        ) from exc
    if arr.ndim != 1:
        raise InvalidInputError(
            f"correct must be 1-D (one label per answer); got shape {arr.shape}."
        )
    if n is not None and arr.size != n:
        raise InvalidInputError(
            f"length mismatch: {n} scores but {arr.size} correctness labels; scores and "
            "correct must have the same length (one label per score, in the same order)."
        )
    if arr.size == 0:
        raise InsufficientDataError("correct is empty; pass at least two labeled responses.")
    binary = (arr == 0) | (arr == 1)
    if not binary.all():
        raise InvalidInputError(
            "correct must hold only 0/1 (or False/True) labels; found e.g. "
            f"{np.unique(arr[~binary])[:3].tolist()}. Threshold graded judgements into binary "
            "labels first."
        )
    return arr.astype(np.int64)


def require_both_classes(labels: NDArray[Any], *, what: str, hint: str) -> None:
    """Raise unless ``labels [n]`` (validated, 0/1 or bool) hold a correct and an incorrect one.

    Args:
        labels: validated labels (from :func:`check_labels`).
        what: the computation that needs both classes, e.g. ``"AUROC"``.
        hint: what to do about it, e.g. ``"evaluate on a larger or more varied set."``.

    Raises:
        InsufficientDataError: every label is correct, or every label is incorrect.
    """
    n_correct = int(np.count_nonzero(labels))
    if n_correct == 0 or n_correct == labels.size:
        only = "correct" if n_correct else "incorrect"
        raise InsufficientDataError(
            f"{what} needs both correct and incorrect answers, but all {labels.size} are "
            f"{only}; {hint}"
        )
