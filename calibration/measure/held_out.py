"""``abstain-guard evaluate``: score held-out answers with the artifact's scorer and the
baselines, run the resplit simulation, and write the report.

Which answers are evaluated:

* without ``data``: the artifact's own run — its calibration and test splits (never used to
  fit the scorer); by default their answers and verdicts are read from the calibration run's
  cache, read-only (:mod:`.cache_reuse`: evaluating right after calibrating generates nothing
  calibration already generated; new entries go to the evaluation's cache only);
* with ``data``: another labeled file, answered by the same model and judged with the
  artifact's judge (choice and math questions with the choice / numeric judges). It is never
  used for fitting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from abstain_guard.artifact.files import LEDGER
from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.backends import check_backend_serves
from abstain_guard.contract.chat_model_specs import ChatModelSpec, chat_model_fingerprint
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.contract.metadata import HIDDEN
from abstain_guard.contract.runnables import with_calibrated_capture
from abstain_guard.errors import (
    ArtifactWriteError,
    CalibrationError,
    ConfigError,
    DatasetError,
    ScoringError,
)
from abstain_guard.guarantee.frontier import frontier_document
from abstain_guard.guarantee.ledger import LedgerEntry
from abstain_guard.scorers import BlackBoxScorer, SampleSource, build_scorer, scorer_names
from abstain_guard.scorers.calibrated import CalibratedScorer
from abstain_guard.scorers.geometry import GeometryScorer

from ..building.answering.answer_rows import GenerationOptions
from ..building.answering.answers import generate_answers, replay_as_deployed
from ..building.answering.models import load_model
from ..building.answering.online_geometry import reference_responses
from ..building.judges.judging import build_judges, judge_answers, labeled_items, labels
from ..building.questions.dataset_files import Fields, load_dataset
from ..building.questions.datasets import QAItem, split_items
from ..building.questions.items import BUILTIN_V1, items_digest, load_items, named_spec
from ..building.questions.named_datasets import load_named_dataset
from ..building.run.calibration_config import TYPE_FLOOR, CalibrationConfig
from .cache_reuse import EvaluateCache, evaluate_cache
from .fitted_baselines import (
    FITTED_BASELINES,
    cost,
    fitted_baseline_scores,
    reference_metadata,
    with_groups,
)
from .group_report import group_tables
from .paired import adjust_family, paired_report
from .permutation_importance import permutation_importance
from .report import write_report
from .results import MeasureSettings, build_results, evaluate_dataset

logger = logging.getLogger("abstain_guard.calibration")

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


@dataclass
class HeldOut:
    """Held-out questions of one data set with their answers' replayed metadata."""

    name: str
    items: list[QAItem]
    metadata: list[dict[str, Any]]
    correct: np.ndarray
    train_metadata: list[dict[str, Any]] | None = None
    train_correct: np.ndarray | None = None
    reference_metadata: list[dict[str, Any]] | None = None
    reference_correct: np.ndarray | None = None
    reference_means: Any = None
    n_calibration: int = 0
    #: per scorer: seconds per answer of scoring (and of fitting, state size for the fitted
    #: baselines), filled by :func:`score_held_out`
    costs: dict[str, dict[str, float]] = field(default_factory=dict)


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


def read_data_spec(
    spec: str, *, group_by: str | None = None, limit: int | None = None
) -> tuple[str, list[QAItem]]:
    """Items from ``name=path`` (a named reader: nq_open, sciq, ...) or a JSONL/CSV path.

    Returns ``(name, items)``.
    """
    named = named_spec(spec)
    if named is not None:
        name = named[0]
        items, report = load_named_dataset(named[0], named[1], limit=limit)
    else:
        name = Path(spec).stem
        if not Path(spec).exists():
            raise DatasetError(f"Data file {spec} does not exist.")
        items, report = load_dataset(spec, Fields(group_by=group_by), limit=limit)
    if report.skipped:
        logger.warning("%s: skipped %d bad rows", spec, len(report.skipped))
    if not items:
        raise DatasetError(f"No usable questions in {spec}.")
    return name, items


def artifact_items(artifact: Any) -> tuple[str, list[QAItem], list[QAItem]]:
    """``(data set name, held-out items, train items)`` of the artifact's own run.

    The held-out items are exactly the artifact's stored ``calibration_ids`` + ``test_ids``.
    """
    name, held, splits = artifact_splits(artifact)
    return name, held, splits["train"]


def artifact_splits(artifact: Any) -> tuple[str, list[QAItem], dict[str, list[QAItem]]]:
    """``(data set name, held-out items, every split)`` of the artifact's own run.

    The held-out items are exactly the artifact's stored ``calibration_ids`` + ``test_ids``.

    Raises:
        DatasetError: the data no longer holds those questions, or its content changed
            since calibration (its hash differs).
    """
    meta = artifact.metadata
    if "data" not in meta:  # recalibrated from live decisions, or built by hand
        origin = (
            "was recalibrated from live decisions (its calibration_source metadata)"
            if "calibration_source" in meta
            else "records no data it was calibrated on"
        )
        raise DatasetError(
            f"This artifact {origin}, so it has no held-out questions of its own to evaluate "
            "on. Evaluate it on labeled questions with --data FILE, or the deployed chain "
            "with --live --data FILE."
        )
    # re-read as calibration read it; rows it skipped are skipped again (the content hash
    # below proves the questions are the same)
    cfg = CalibrationConfig(**{**meta.get("config", {}), "skip_bad_rows": True})
    source = meta["data"]
    items, _ = load_items(source, cfg)
    stored = meta.get("items_sha256")
    if source == "builtin" and stored is not None and items_digest(items) != stored:
        first_release, _ = load_items(BUILTIN_V1, cfg)  # calibrated before the set grew
        if items_digest(first_release) == stored:
            items = first_release
    if stored is not None and items_digest(items) != stored:
        raise DatasetError(
            f"The data {source!r} changed since the artifact was calibrated (content hash "
            "differs), so its held-out questions cannot be trusted. Evaluate with the data "
            "the artifact was built from, or recalibrate."
        )
    by_id = {it.id: it for it in items}
    ids = list(meta.get("calibration_ids", [])) + list(meta.get("test_ids", []))
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise DatasetError(
            f"{len(missing)} held-out question ids of the artifact are not in {source!r} "
            f"(e.g. {missing[:3]}). Evaluate with the data the artifact was built from."
        )
    splits = split_items(items, seed=cfg.seed, ratios=cfg.ratios)
    named = named_spec(str(source))
    name = named[0] if named else "builtin" if source == "builtin" else Path(source).stem
    return name, [by_id[i] for i in ids], splits


def _backend_of(cfg: CalibrationConfig) -> str:
    """``exact``, ``vllm`` or ``api``: the engine an artifact's answers came from."""
    if cfg.backend == "vllm":
        return "vllm"
    return "api" if isinstance(cfg.model, ChatModelSpec) else "exact"


@dataclass(frozen=True)
class HeldOutSource:
    """Which questions ``evaluate`` answers: the artifact's own held-out splits
    (``data=None``) or another labeled file.

    Attributes:
        data: a JSONL/CSV path, or ``name=path`` for a named reader (``sciq=/data/sciq``).
        group_by: the question-type field of ``data`` (within-type AUROC).
        limit: the first N questions of ``data``.
    """

    data: str | None = None
    group_by: str | None = None
    limit: int | None = None


@dataclass
class _Questions:
    """The held-out pool and the train and reference splits of one artifact's evaluation."""

    name: str
    pool: list[QAItem]
    train: list[QAItem] = field(default_factory=list)
    reference: list[QAItem] = field(default_factory=list)
    n_calibration: int = 0

    def labeled(self, judgments: Any) -> _Questions:
        """The questions whose answers have a verdict (``n_calibration`` counted among them)."""
        return _Questions(
            self.name,
            labeled_items(self.pool, judgments),
            labeled_items(self.train, judgments),
            labeled_items(self.reference, judgments),
            sum(1 for _ in labeled_items(self.pool[: self.n_calibration], judgments)),
        )


def _questions(artifact: Any, source: HeldOutSource, fitted_baselines: bool) -> _Questions:
    if source.data is not None:
        name, pool = read_data_spec(source.data, group_by=source.group_by, limit=source.limit)
        return _Questions(name, pool)
    name, pool, splits = artifact_splits(artifact)
    return _Questions(
        name,
        pool,
        train=splits["train"],
        reference=splits["reference"] if fitted_baselines else [],
        n_calibration=len(artifact.metadata.get("calibration_ids", [])),
    )


def _train_metadata(
    train: list[QAItem], answers: dict[str, Any], replay: Callable[..., Any], hidden: bool
) -> list[dict[str, Any]]:
    """The train answers' metadata: as cached where it holds what the baselines read
    (log-probabilities; the hidden-state summaries too when probes are fitted), replayed
    otherwise."""
    cached = [answers[it.id].get("metadata") for it in train]
    usable = all(m and "logprobs" in m for m in cached)
    if hidden:  # the probes read the hidden-state summaries too
        usable = usable and all(HIDDEN in ((m or {}).get("geometry") or {}) for m in cached)
    return with_groups(cached if usable else replay(train), train)  # type: ignore[arg-type]


def _reference_metadata(
    artifact: Any, qs: _Questions, answers: dict[str, Any], store: Any
) -> tuple[Any, list[dict[str, Any]]]:
    """The artifact's reference means and the reference answers' metadata: with Φ from the
    cached states (``geometry_plus``) where the means exist, the hidden summaries (probes)
    otherwise."""
    means = getattr(artifact.scorer, "reference_means_", None)
    try:
        if means is None:
            raise CalibrationError("no reference means")
        ref_meta = reference_responses(qs.reference, answers, store, means)
    except CalibrationError:
        ref_meta = [reference_metadata(answers[it.id], store) for it in qs.reference]
    return means, with_groups(ref_meta, qs.reference)


def collect_held_out(
    artifact: Any,
    model: Any,
    *,
    source: HeldOutSource = HeldOutSource(),
    progress: bool = True,
    cache: EvaluateCache,
    judges: dict[str, Any] | None = None,
    fitted_baselines: bool = False,
) -> HeldOut:
    """Answer (from ``cache`` where possible), judge and replay the held-out questions.

    Held-out answers are generated one question per call and replayed from their token ids
    one sequence at a time, exactly as calibration scored them and as the guard scores live.
    ``cache`` is where answers and verdicts are cached (written in ``cache.directory`` only;
    the calibration cache below it, if any, is only read). ``judges``: judges per question
    kind (default: the artifact's judge, cached there). ``fitted_baselines``: also read the
    reference split's answers (the probes and the type floor are fitted on reference and
    train, as the geometry scorer is). Every metadata dict carries the question's type under
    ``question_group`` (what ``type_floor`` reads).
    """
    cfg = CalibrationConfig(**artifact.metadata.get("config", {}))
    store = cache.run_store()
    qs = _questions(artifact, source, fitted_baselines)
    spec_model = isinstance(cfg.model, ChatModelSpec)  # an API or vLLM chat model
    fingerprint = str(getattr(model, "fingerprint", "unknown"))
    if spec_model:  # as calibration keyed its answers: the calibration cache is read back
        fingerprint = chat_model_fingerprint(model)
    answers = generate_answers(
        model,
        qs.pool,
        store,
        cfg,
        fingerprint=fingerprint,
        options=GenerationOptions(batch_size=1, progress=progress),
    )
    answers.update(
        generate_answers(
            model,
            qs.train + qs.reference,
            store,
            cfg,
            fingerprint=fingerprint,
            options=GenerationOptions(progress=progress),
        )
    )
    if judges is None:
        judges = build_judges(cfg, cache.directory / "judgments.sqlite", read_from=cache.judgments)
    judgments = judge_answers(judges, qs.pool + qs.train + qs.reference, answers, progress=progress)
    cache.log_reuse(store, judges)
    qs = qs.labeled(judgments)
    scoring_model = artifact.scorer.prepare(model)

    def replay(items: list[QAItem]) -> list[dict[str, Any]]:
        if spec_model:  # scored from each answer's own response metadata, as deployed
            return [dict(answers[it.id].get("metadata") or {}) for it in items]
        return replay_as_deployed(scoring_model, items, answers, cfg, progress)

    held = HeldOut(
        name=qs.name,
        items=qs.pool,
        metadata=with_groups(replay(qs.pool), qs.pool),
        correct=np.array(labels(qs.pool, judgments)),
        n_calibration=qs.n_calibration,
    )
    if qs.train:
        held.train_metadata = _train_metadata(qs.train, answers, replay, fitted_baselines)
        held.train_correct = np.array(labels(qs.train, judgments))
    if qs.reference:
        held.reference_means, held.reference_metadata = _reference_metadata(
            artifact, qs, answers, store
        )
        held.reference_correct = np.array(labels(qs.reference, judgments))
    return held


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
        n_resplits: random calibration/test resplits for the participation curves.
        num_samples: K for the sampling baselines.
        importance_repeats: permutations per feature family (geometry scorer).
        seed: resplit seed.
        cache_dir: where answers and verdicts are cached, read and written (default
            ``<out>/cache``). Nothing is written elsewhere.
        reuse_calibration_cache: without ``cache_dir``, also read the answers and verdicts
            of the artifact's calibration cache, read-only (:mod:`.cache_reuse`); a cache
            that is gone or cannot be read is skipped with a log line.
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
    exact = _backend_of(CalibrationConfig(**art.metadata.get("config", {}))) == "exact"
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
    artifact's scorer."""
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
        ),
    }


def _group_rules(
    held: HeldOut, art: GuardArtifact, scores: dict[str, np.ndarray], seed: int
) -> dict[str, Any]:
    """The pooled and the per-group rule, per group (:mod:`.group_report`)."""
    cfg = CalibrationConfig(**art.metadata.get("config", {}))
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
    cfg = CalibrationConfig(**art.metadata.get("config", {}))
    backend = _backend_of(cfg)
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
    source: HeldOutSource = HeldOutSource(),
    options: EvaluateOptions = EvaluateOptions(),
    progress: bool = True,
    model: Any = None,
    judges: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate one or more artifacts and write ``results.json``, plots and ``report.md``.

    Args:
        artifact: an artifact directory, or several (one data set each, one report).
        out: the report directory.
        source: the questions: the artifact's own held-out splits (default) or another file.
        options: the baselines, the resplit simulation and the cache.
        progress: progress bars.
        model: an already loaded chat model to reuse.
        judges: judges per question kind (default: the artifact's judge, cached).

    Returns:
        The results document (also written to ``out/results.json``), with a ``headline``
        entry: AUROC per data set and scorer.
    """
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
