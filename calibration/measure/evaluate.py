"""``abstain-guard evaluate``: the artifact's scorer and the baselines on held-out answers
(:mod:`.held_out`, :mod:`.baselines`), the resplit simulation, the paired comparisons and
the per-group rules, written as one report (:mod:`.report`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard.artifact.files import LEDGER
from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.backends import check_backend_serves
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.contract.runnables import with_calibrated_capture
from abstain_guard.errors import ArtifactWriteError
from abstain_guard.guarantee.frontier import frontier_document
from abstain_guard.guarantee.ledger import LedgerEntry
from abstain_guard.scorers.geometry import GeometryScorer

from ..building.answering.models import load_model
from ..building.run.calibration_config import TYPE_FLOOR, CalibrationConfig
from .baselines import FITTED_BASELINES, baseline_params, parse_baselines, score_held_out
from .cache_reuse import EvaluateCache, evaluate_cache
from .group_report import group_tables
from .held_out import HeldOut, HeldOutSource, backend_of, collect_held_out
from .paired import REPORT_RISK_TARGET, adjust_family, paired_report
from .permutation_importance import permutation_importance
from .report import write_report
from .results import MeasureSettings, build_results, evaluate_dataset

logger = logging.getLogger("abstain_guard.calibration")


def record_looks(art: GuardArtifact, names: Sequence[str]) -> dict[str, Any]:
    """Append one ledger entry per scorer evaluated on ``art``'s calibration and test answers
    (:mod:`abstain_guard.guarantee.ledger`): what ``results.json`` records of it (the names,
    K after them, and where the ledger is, or why it could not be written)."""
    own = {art.scorer.name: art.scorer.kind}
    looks = [
        LedgerEntry.now(own.get(n, n), by="abstain-guard evaluate", answers="calibration+test")
        for n in names
    ]
    try:
        art.record_looks(looks)
    except ArtifactWriteError as exc:
        logger.warning(
            "The selection ledger of %s was not written (%s): choosing or keeping a scorer "
            "after this evaluation is a choice on the calibration answers; count these %d "
            "scorers in K by hand.",
            art.path,
            exc,
            len(looks),
        )
        return {"names": [e.name for e in looks], "written": False, "error": str(exc)}
    return {
        "names": [e.name for e in looks],
        "written": art.path is not None,
        "path": None if art.path is None else str(art.path / LEDGER),
        "n_candidates": art.n_candidates,
    }


@dataclass(frozen=True)
class EvaluateOptions:
    """What ``evaluate`` measures besides the artifact's scorer, and where it caches.

    Attributes:
        baselines: "likelihood" (default), "all", "none", or a comma list
            (:func:`parse_baselines`).
        num_samples: K for the sampling baselines.
        importance_repeats: permutations per feature family (geometry scorer).
        cache_dir: where answers and verdicts are cached, read and written (default
            ``<out>/cache``). Nothing is written elsewhere.
        reuse_calibration_cache: without ``cache_dir``, also read the artifact's
            calibration cache, read-only (:mod:`.cache_reuse`).
    """

    baselines: str | Sequence[str] = "likelihood"
    n_resplits: int = 1000
    num_samples: int = 5
    importance_repeats: int = 5
    seed: int = 0
    cache_dir: str | Path | None = None
    reuse_calibration_cache: bool = True

    def cache(self, out: str | Path, art: GuardArtifact, path: str | Path) -> EvaluateCache:
        """The evaluation's cache of ``art`` (loaded from ``path``)."""
        if self.cache_dir is not None:
            return EvaluateCache(Path(self.cache_dir))
        return evaluate_cache(Path(out) / "cache", art, path, reuse=self.reuse_calibration_cache)


def _dataset_entry(
    held: HeldOut,
    art: GuardArtifact,
    scores: dict[str, np.ndarray],
    calibrated: dict[str, np.ndarray],
    options: EvaluateOptions,
    progress: bool,
) -> dict[str, Any]:
    """One data set's entry of the results document: the metrics and resplit simulation of
    every scorer (:func:`.results.evaluate_dataset`), with permutation importance on a
    geometry artifact and Ω, Θ, Φ hypothesis checks from the exact engine."""
    importance = None
    if isinstance(art.scorer, GeometryScorer):
        importance = permutation_importance(
            art.scorer, held.metadata, held.correct.tolist(), n_repeats=options.importance_repeats
        ).to_dict()
    exact = backend_of(CalibrationConfig.of_artifact(art.metadata)) == "exact"
    return evaluate_dataset(
        held.name,
        scores,
        held.correct,
        groups=_groups(held),
        geometries=[m["geometry"] for m in held.metadata] if held.metadata and exact else None,
        importance=importance,
        calibrated_scores_by_scorer=calibrated or None,
        settings=MeasureSettings(
            n_resplits=options.n_resplits, seed=options.seed, nan_policy="omit", progress=progress
        ),
    )


def _groups(held: HeldOut) -> list[Any] | None:
    """The held-out questions' types, ``None`` when none has one."""
    groups: list[Any] = [it.group for it in held.items]
    return groups if any(g is not None for g in groups) else None


def _comparisons(
    held: HeldOut, art: GuardArtifact, scores: dict[str, np.ndarray], seed: int
) -> dict[str, Any]:
    """The certifiable frontier, the scorers' costs and the paired comparisons with the
    artifact's scorer, each scorer certified at the artifact's ``(risk_target, delta)``
    (``REPORT_RISK_TARGET`` when it was calibrated without a risk target)."""
    cfg = CalibrationConfig.of_artifact(art.metadata)
    return {
        "frontier": frontier_document(art.scores, art.correct, candidates=art.n_candidates),
        "costs": held.costs,
        "paired": paired_report(
            scores,
            held.correct,
            reference=art.scorer.name,
            groups=_groups(held),
            calibration=np.arange(held.correct.size) < held.n_calibration,
            seed=seed,
            risk_target=REPORT_RISK_TARGET if cfg.risk_target is None else cfg.risk_target,
            delta=cfg.delta,
        ),
    }


def _group_rules(
    held: HeldOut, art: GuardArtifact, scores: dict[str, np.ndarray], seed: int
) -> dict[str, Any]:
    """The pooled and the per-group rule, per group (:mod:`.group_report`)."""
    cfg = CalibrationConfig.of_artifact(art.metadata)
    groups: list[Any] = [it.group for it in held.items]
    return group_tables(
        scores[art.scorer.name],
        held.correct,
        groups,
        cfg.participation,
        cfg.risk_target,
        cfg.delta,
        seed=seed,
    )


def _headline(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """AUROC (and its interval) per data set and scorer."""
    return {
        e["name"]: {
            s: {"auroc": round(v["auroc"], 3), "auroc_ci": v.get("auroc_ci")}
            for s, v in e["scorers"].items()
            if "auroc" in v
        }
        for e in entries
    }


def _model_for(art: GuardArtifact, path: str | Path, names: Sequence[str], model: Any) -> Any:
    """``model`` when it is the artifact's, else the artifact's model loaded; refused before
    anything is generated when the artifact's backend cannot score a baseline."""
    cfg = CalibrationConfig.of_artifact(art.metadata)
    backend = backend_of(cfg)
    for name in (n for n in names if n != TYPE_FLOOR):  # the floor reads no model output
        check_backend_serves(name, backend, label=f"baseline of {path}")
        baseline_params(name, art.scorer)
    if model is None or getattr(model, "fingerprint", None) != art.model_fingerprint:
        model = load_model(cfg)
    art.check_fingerprint(getattr(model, "fingerprint", None))
    return model


def evaluate(
    artifact: str | Path | Sequence[str | Path],
    out: str | Path,
    *,
    source: HeldOutSource | None = None,
    options: EvaluateOptions = EvaluateOptions(),
    progress: bool = True,
    model: Any = None,
    judges: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate one or more artifacts (one data set each, one report) and write
    ``results.json``, plots and ``report.md`` to ``out``; returns the results document, with
    a ``headline`` entry: AUROC per data set and scorer. ``source`` defaults to the
    artifact's own held-out splits, ``judges`` (per question kind) to the artifact's judge.
    """
    source = source or HeldOutSource()
    paths = [artifact] if isinstance(artifact, (str, Path)) else list(artifact)
    names = parse_baselines(options.baselines)
    arts = [GuardArtifact.load(p) for p in paths]
    t0 = time.perf_counter()
    entries = []
    for path, art in zip(paths, arts, strict=True):
        model = _model_for(art, path, names, model)
        held = collect_held_out(
            art,
            with_calibrated_capture(model, DeploymentRecord.from_metadata(art.metadata)),
            source=source,
            progress=progress,
            cache=options.cache(out, art, path),
            judges=judges,
            fitted_baselines=any(n in FITTED_BASELINES for n in names),
        )
        scores, calibrated = score_held_out(
            held, art, model, names, num_samples=options.num_samples, progress=progress
        )
        entry = _dataset_entry(held, art, scores, calibrated, options, progress)
        if source.data is None:  # the artifact's calibration answers were read: K grows
            entry["ledger"] = record_looks(art, [*scores, *calibrated])
        entry.update(_comparisons(held, art, scores, options.seed))
        entry["artifact"] = str(path)
        entry["evaluated_on"] = source.data or "held-out calibration + test splits"
        if entry.get("n_groups"):  # pooled vs per-group rule, per group
            entry["groups"] = _group_rules(held, art, scores, options.seed)
        entries.append(entry)
    # One family for the whole report: every set x every scorer, overall and within type.
    adjust_family([e["paired"] for e in entries])
    results = build_results(
        entries,
        metadata={
            "artifacts": [str(p) for p in paths],
            "data": source.data,
            "baselines": names,
            "n_resplits": options.n_resplits,
            "num_samples": options.num_samples,
            "seconds": time.perf_counter() - t0,
        },
    )
    results["headline"] = _headline(entries)
    write_report(results, out)
    return results
