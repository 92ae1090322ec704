"""One validator for uncertainty scores ``[n]`` (higher = less reliable) and 0/1
correctness labels ``[n]`` (1 = judged correct), shared by the thresholds, the artifact and
the metrics; errors are :class:`~abstain_guard.errors.InvalidInputError` (shape, type,
value) or :class:`~abstain_guard.errors.InsufficientDataError` (empty, one class only).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from abstain_guard.errors import InsufficientDataError, InvalidInputError


def check_scores(
    scores: ArrayLike, *, name: str = "scores", allow_inf: bool = False
) -> NDArray[np.float64]:
    """Scores ``[n]`` as float64 (``name`` in messages); ``allow_inf`` keeps ``±inf`` (metrics:
    a score only has to rank), else every score must be finite.

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
    """Labels ``[n]`` (0/1 or False/True) as int64 0/1; ``n``: the number of scores they
    belong to (checked when given).

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
    """Raise unless validated ``labels [n]`` hold a correct and an incorrect one; ``what``
    names the computation that needs both (``"AUROC"``), ``hint`` what to do about it.

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
