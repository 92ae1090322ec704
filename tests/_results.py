"""A results document of one data set, as ``evaluate`` writes it for several."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from numpy.typing import ArrayLike

from abstain_guard.calibration.measure.results import build_results, evaluate_dataset


def evaluate_scores(
    scores_by_scorer: Mapping[str, ArrayLike],
    correct: ArrayLike,
    name: str = "dataset",
    metadata: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """``build_results([evaluate_dataset(name, ...)], metadata)``; ``kwargs`` go to
    :func:`evaluate_dataset`."""
    return build_results([evaluate_dataset(name, scores_by_scorer, correct, **kwargs)], metadata)
