"""The baselines ``evaluate`` scores beside the artifact's scorer: the registered scorers by
name or set (:func:`parse_baselines`), scored on the held-out answers (:func:`score_held_out`),
and those it fits on the artifact's reference and train answers, never on calibration or
test: the hidden-state probes, likelihood + probe, ``geometry_plus`` and the type-only floor
(:class:`TypeFloor`, a measuring floor, not a registered scorer; docs/baselines.md).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from abstain_guard.contract.metadata import (
    QUESTION_GROUP,
    ResponseLike,
    response_metadata_of,
)
from abstain_guard.errors import AbstainGuardError, ConfigError, NotFittedError, ScoringError
from abstain_guard.scorers import (
    BlackBoxScorer,
    SampleSource,
    ScorerState,
    build_scorer,
    scorer_names,
)
from abstain_guard.scorers.calibrated import CalibratedScorer

from ..building.run.calibration_config import TYPE_FLOOR
from .held_out import HeldOut

logger = logging.getLogger("abstain_guard.calibration")

FITTED_BASELINES = (*scorer_names(family="probe"), TYPE_FLOOR, "geometry_plus")
"""Baselines fitted on the artifact's reference and train answers (never calibration): the
hidden-state probes, likelihood + probe, the type-only floor, and ``geometry_plus`` (on an
artifact of a geometry scorer, with its reference means)."""

_NONE = "\x00none"  # the JSON key of questions without a type


def question_group(response: ResponseLike) -> str:
    """The question's type as a string key (``None`` -> a key of its own).

    Raises:
        ScoringError: the response carries no ``question_group`` entry.
    """
    meta = response_metadata_of(getattr(response, "metadata", response))
    if QUESTION_GROUP not in meta:
        raise ScoringError(
            "type_floor scores the question's type, read from "
            "response_metadata['question_group'], which this response does not carry. It is "
            "a measuring floor (abstain-guard evaluate --baselines type_floor sets it), not a "
            "deployable guard."
        )
    group = meta[QUESTION_GROUP]
    return _NONE if group is None else str(group)


class TypeFloor:
    """1 − smoothed train accuracy of the question's type (higher = more uncertain).

    Fitted attributes: ``accuracy_`` (``{type: smoothed accuracy}``), ``overall_`` (the
    fitting answers' accuracy), ``counts_`` (``{type: [correct, answers]}``).
    """

    def _check_fitted(self) -> None:
        if not hasattr(self, "accuracy_"):
            raise NotFittedError("TypeFloor is not fitted: call fit(reference, train) first.")

    def fit(
        self,
        reference: Sequence[tuple[Any, bool]],
        train: Sequence[tuple[Any, bool]],
        *,
        reference_means: Any = None,
    ) -> TypeFloor:
        """Count correct answers per type over the reference and train answers."""
        del reference_means
        counts: dict[str, list[int]] = {}
        for response, correct in [*reference, *train]:
            c = counts.setdefault(question_group(response), [0, 0])
            c[0] += int(bool(correct))
            c[1] += 1
        total = sum(c[1] for c in counts.values())
        self.overall_ = sum(c[0] for c in counts.values()) / total if total else 0.5
        self.counts_ = counts
        self.accuracy_ = {g: (c[0] + 1) / (c[1] + 2) for g, c in counts.items()}
        return self

    def score(self, response: ResponseLike) -> float:
        """1 − the smoothed accuracy of the response's question type."""
        self._check_fitted()
        return float(1.0 - self.accuracy_.get(question_group(response), self.overall_))

    def score_many(self, responses: Sequence[ResponseLike]) -> np.ndarray:
        """Scores ``[n]``."""
        return np.asarray([self.score(r) for r in responses], dtype=np.float64)

    def get_state(self) -> ScorerState:
        """The per-type counts and accuracies (JSON only; ``evaluate`` reports its size)."""
        self._check_fitted()
        params = {"overall": self.overall_, "counts": self.counts_, "accuracy": self.accuracy_}
        json.dumps(params)
        return ScorerState(kind=TYPE_FLOOR, params=params)


def cost(t0: float, n: int) -> dict[str, float]:
    """Seconds per answer of scoring ``n`` answers since ``t0`` (the answers' metadata
    already in memory: the scorer's own cost, not generation's)."""
    return {"seconds_per_answer": (time.perf_counter() - t0) / max(n, 1)}


def fitted_baseline_scores(held: HeldOut, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Scores of the baselines fitted on the artifact's reference and train answers (the
    splits its geometry scorer was fitted on; never calibration). A baseline that cannot be
    fitted (answers without hidden states, too few of a class) is left out with a warning."""
    if held.train_metadata is None or held.train_correct is None:
        logger.warning("no train answers: %s need the artifact's own splits", list(names))
        return {}
    ref_correct = [] if held.reference_correct is None else held.reference_correct.tolist()
    ref = list(zip(held.reference_metadata or [], ref_correct, strict=True))
    train = list(zip(held.train_metadata, held.train_correct.tolist(), strict=True))
    out: dict[str, np.ndarray] = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            unfitted = TypeFloor() if name == TYPE_FLOOR else build_scorer(name)
            scorer = unfitted.fit(  # type: ignore[union-attr]
                ref, train, reference_means=held.reference_means
            )
            t1 = time.perf_counter()
            out[name] = np.asarray(scorer.score_many(held.metadata), dtype=np.float64)
        except AbstainGuardError as exc:  # no hidden states, too few of a class, no means
            logger.warning("baseline %s left out: %s", name, exc)
            continue
        held.costs[name] = {**cost(t1, len(held.metadata)), "fit_seconds": t1 - t0}
        state = scorer.get_state()
        held.costs[name]["state_bytes"] = int(
            sum(a.nbytes for a in state.arrays.values()) + len(json.dumps(state.params))
        )
        logger.info(
            "%s fitted on %d reference + %d train answers in %.1f s",
            name,
            len(ref),
            len(train),
            time.perf_counter() - t0,
        )
    return out


LIKELIHOOD = scorer_names(family="likelihood")
MODEL_BASELINES = scorer_names(family=("model", "sampling"))
BLACKBOX_BASELINES = tuple(BlackBoxScorer.presets)
"""The black-box statistics, scored from the samples a black-box artifact drew."""
KNOWN_BASELINES = LIKELIHOOD + MODEL_BASELINES + FITTED_BASELINES + BLACKBOX_BASELINES
BASELINE_PARAMS: dict[str, dict[str, Any]] = {"semantic_entropy": {"judge": "similarity"}}
"""Constructor parameters of baselines in ``evaluate`` (offline equivalence judge)."""


def baseline_params(name: str, artifact_scorer: Any) -> dict[str, Any]:
    """The constructor parameters of baseline ``name`` on an artifact whose scorer is
    ``artifact_scorer``: a black-box statistic samples nothing of its own, it scores the
    samples the artifact's black-box scorer drew (its k, temperature, primary rule and
    similarity model).

    Raises:
        ConfigError: a black-box statistic on an artifact whose scorer draws no such samples.
    """
    if name not in BLACKBOX_BASELINES:
        return dict(BASELINE_PARAMS.get(name, {}))
    if not isinstance(artifact_scorer, BlackBoxScorer):
        raise ConfigError(
            f"baseline {name!r} scores the samples a black-box artifact drew with each answer; "
            f"this artifact's scorer {artifact_scorer.kind!r} draws none. Calibrate a black-box "
            f"scorer (e.g. --scorer {name}) and evaluate that artifact."
        )
    plan = artifact_scorer.plan
    return {
        "num_samples": plan.num_samples,
        "temperature": plan.temperature,
        "primary": plan.primary,
        "equivalence_threshold": artifact_scorer.equivalence_threshold,
        "similarity": artifact_scorer.similarity,
    }


def parse_baselines(spec: str | Sequence[str]) -> list[str]:
    """``"likelihood"``, ``"probes"`` (likelihood, every probe, likelihood + probe and the
    type-only floor), ``"blackbox"`` (every black-box statistic, on a black-box artifact's
    samples), ``"all"`` (every baseline but the black-box ones),
    ``"none"`` or a comma list of baseline names."""
    if isinstance(spec, str):
        if spec == "likelihood":
            return list(LIKELIHOOD)
        if spec == "probes":
            return list(LIKELIHOOD + FITTED_BASELINES)
        if spec == "blackbox":
            return list(BLACKBOX_BASELINES)
        if spec == "all":
            return list(LIKELIHOOD + MODEL_BASELINES + FITTED_BASELINES)
        if spec == "none":
            return []
        names = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        names = list(spec)
    unknown = sorted(set(names) - set(KNOWN_BASELINES))
    if unknown:
        raise ConfigError(
            f"Unknown baseline(s) {unknown}; choose from {list(KNOWN_BASELINES)} "
            "or the sets 'likelihood', 'probes', 'blackbox', 'all', 'none'."
        )
    return names


def score_held_out(
    held: HeldOut,
    artifact: Any,
    model: Any,
    baselines: Sequence[str],
    *,
    num_samples: int = 5,
    progress: bool = True,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Uncertainty scores of every scorer, and of the calibrated likelihood baselines."""
    t0 = time.perf_counter()
    scores: dict[str, np.ndarray] = {
        artifact.scorer.name: artifact.scorer.score_many(held.metadata)
    }
    held.costs[artifact.scorer.name] = cost(t0, len(held.metadata))
    samples = None
    if any(b in MODEL_BASELINES for b in baselines):
        samples = SampleSource(model, num_samples=num_samples, max_new_tokens=24)
    for name in tqdm(baselines, desc="baselines", disable=not progress):
        if name in scores or name in FITTED_BASELINES:
            continue
        t0 = time.perf_counter()
        params = baseline_params(name, artifact.scorer)
        scorer = build_scorer(name, model=model, samples=samples, **params)
        try:
            scores[name] = np.asarray(scorer.score_many(held.metadata), dtype=np.float64)
        except ScoringError as exc:  # e.g. a likelihood baseline on text-only answers
            logger.warning("baseline %s left out: it cannot score these answers (%s)", name, exc)
            continue
        held.costs[name] = cost(t0, len(held.metadata))
    fitted = [b for b in baselines if b in FITTED_BASELINES and b not in scores]
    if fitted:
        scores.update(fitted_baseline_scores(held, fitted))
    calibrated: dict[str, np.ndarray] = {}
    if held.train_metadata is not None and held.train_correct is not None:
        for name in (b for b in baselines if b in LIKELIHOOD and b in scores):
            cal = CalibratedScorer(build_scorer(name))
            cal.fit(list(zip(held.train_metadata, held.train_correct.tolist(), strict=True)))
            calibrated[cal.name] = np.asarray(cal.score_many(held.metadata), dtype=np.float64)
    return scores, calibrated
