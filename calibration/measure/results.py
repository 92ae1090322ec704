"""The results document that :func:`abstain_guard.calibration.measure.report.write_report`
renders: per data set, every scorer's ranking metrics and resplit simulation, within-type
AUROC, hypothesis checks and permutation importance.

``evaluate_dataset`` computes one data set's entry, ``build_results`` assembles entries into
``{"schema_version", "metadata", "datasets"}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray
from tqdm.auto import tqdm

from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee.validation import check_labels

from .hypotheses import hypothesis_checks, validate_importance
from .metrics import check_nan_policy
from .ranking import scorer_table, select_scored
from .simulation import (
    DEFAULT_LEVELS,
    check_levels,
    level_key,
    resplit_simulation,
)

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class MeasureSettings:
    """How every scorer of a data set is measured: the resplit simulation's settings
    (:func:`.simulation.resplit_simulation`; ``seed`` also seeds the bootstrap) and
    :func:`.ranking.scorer_table`'s (``n_boot=0``: no intervals)."""

    levels: Sequence[float] = DEFAULT_LEVELS
    n_resplits: int = 1000
    calibration_fraction: float = 0.5
    seed: int = 0
    nan_policy: Literal["raise", "omit"] = "raise"
    n_boot: int = 2000
    confidence: float = 0.95
    progress: bool = False

    def bootstrap(self) -> dict[str, Any] | None:
        """How the intervals were made (``None`` when ``n_boot=0``)."""
        if self.n_boot <= 0:
            return None
        return {
            "n_boot": int(self.n_boot),
            "confidence": float(self.confidence),
            "seed": self.seed,
            "method": "percentile, resampling correct and incorrect answers separately",
        }


def _scorer_entries(
    scores_by_scorer: Mapping[str, ArrayLike],
    y: NDArray[np.int64],
    groups: ArrayLike | None,
    levels: Sequence[float],
    settings: MeasureSettings,
    desc: str,
) -> dict[str, dict[str, Any]]:
    table = scorer_table(
        scores_by_scorer,
        y,
        groups=groups,
        nan_policy=settings.nan_policy,
        n_boot=settings.n_boot,
        confidence=settings.confidence,
        seed=settings.seed,
    )
    names = list(scores_by_scorer)
    for name in tqdm(names, desc=desc, disable=not settings.progress, leave=False):
        if "error" in table[name]:
            continue
        s, keep = select_scored(name, scores_by_scorer[name], y, settings.nan_policy)
        sim = resplit_simulation(
            s[keep],
            y[keep],
            levels=levels,
            n_resplits=settings.n_resplits,
            calibration_fraction=settings.calibration_fraction,
            seed=settings.seed,
        )
        table[name]["participation"] = sim.pop("levels")
        table[name]["resplit"] = sim
    return table


def evaluate_dataset(
    name: str,
    scores_by_scorer: Mapping[str, ArrayLike],
    correct: ArrayLike,
    *,
    groups: ArrayLike | None = None,
    geometries: Sequence[Mapping[str, Any] | None] | None = None,
    importance: Any = None,
    calibrated_scores_by_scorer: Mapping[str, ArrayLike] | None = None,
    settings: MeasureSettings = MeasureSettings(),
) -> dict[str, Any]:
    """Everything the report shows for one data set, as a JSON-ready dict: every scorer's
    :func:`.ranking.scorer_table` entry (scorer → ``[n]`` uncertainty scores of the *test*
    responses, 0/1 labels ``correct [n]``) with its resplit simulation under
    ``"participation"`` (per level) and ``"resplit"``; with ``groups [n]`` the within-type
    AUROC under ``"within_group"``, with ``geometries [n]`` the hypothesis checks (Figure
    8), with ``importance`` the permutation importance (Figure 9, :func:`validate_importance`)
    and with ``calibrated_scores_by_scorer`` the calibrated baselines (appendix tables),
    measured like the raw scorers; ``"bootstrap"`` records how the intervals were made
    (``None`` when ``n_boot=0``).
    """
    check_nan_policy(settings.nan_policy)
    y = check_labels(correct)
    lv = [float(v) for v in check_levels(settings.levels)]
    scorers = _scorer_entries(scores_by_scorer, y, groups, lv, settings, f"{name}: scorers")
    calibrated = None
    if calibrated_scores_by_scorer:
        calibrated = _scorer_entries(
            calibrated_scores_by_scorer, y, None, lv, settings, f"{name}: calibrated"
        )
    within = None
    n_groups = None
    if groups is not None:
        within = {
            s: entry.pop("within_group") for s, entry in scorers.items() if "error" not in entry
        }
        n_groups = len({str(g) for g in np.asarray(groups, dtype=object).tolist() if g is not None})
    return {
        "name": name,
        "n": int(y.size),
        "n_correct": int(y.sum()),
        "n_incorrect": int(y.size - y.sum()),
        "accuracy": float(y.mean()),
        "levels": [level_key(v) for v in lv],
        "bootstrap": settings.bootstrap(),
        "scorers": scorers,
        "calibrated_scorers": calibrated,
        "within_group": within,
        "n_groups": n_groups,
        "hypothesis": hypothesis_checks(geometries, y) if geometries is not None else None,
        "importance": validate_importance(importance) if importance is not None else None,
    }


def build_results(
    datasets: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble :func:`evaluate_dataset` outputs into the results document
    ``{"schema_version", "metadata", "datasets": {name: entry}}`` that
    :func:`abstain_guard.calibration.measure.report.write_report` renders (``metadata``: free-form,
    e.g. model, commands, sizes)."""
    entries = list(datasets.values()) if isinstance(datasets, Mapping) else list(datasets)
    by_name: dict[str, Any] = {}
    for entry in entries:
        if "name" not in entry or "scorers" not in entry:
            raise InvalidInputError("each data set entry must come from evaluate_dataset().")
        if entry["name"] in by_name:
            raise InvalidInputError(f"data set {entry['name']!r} appears twice.")
        by_name[entry["name"]] = dict(entry)
    return {
        "schema_version": SCHEMA_VERSION,
        "metadata": dict(metadata or {}),
        "datasets": by_name,
    }
