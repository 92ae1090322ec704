"""The resumable calibration pipeline behind ``abstain-guard calibrate``: check, split,
generate, judge, fit, score the calibration split and write the artifact, each step cached
in the run store so a killed run resumes where it stopped (the steps and their modules:
docs/architecture.md, 'A calibration run').
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.contract.chat_model_specs import ChatModelSpec, chat_model_fingerprint
from abstain_guard.guarantee.selection import (
    ScorerSelection,
    record_choice,
    select_on_split,
    select_scorer,
)
from abstain_guard.scorers import build_scorer

from .agent_calibration import (
    agent_deployment_record,
    calibrate_agent_splits,
)
from .answering.answer_rows import HELD_OUT, AnswerRows, GenerationOptions
from .answering.answers import (
    deployment_record,
    generate_answers,
)
from .answering.models import load_model
from .answering.online_geometry import (
    captures_geometry,
    ensure_reference_arrays,
    fit_captured,
    fit_reference_means,
    scoring_model,
)
from .answering.stream_calibration import calibration_stream_scores
from .fitting import calibration_groups, fit_and_score, make_scorer
from .judges.base import summarize_judgments
from .judges.judging import (
    Verdicts,
    build_judges,
    check_two_classes,
    judge_answers,
    labeled_items,
    labeled_splits,
    labels,
)
from .preflight import preflight
from .questions.datasets import SPLIT_NAMES, QAItem
from .questions.items import items_digest
from .review import review_path, start_review, write_review_file
from .run.calibration_config import FIT_SCORERS, CalibrationConfig
from .run.lock import run_locks
from .run.store import RunStore

logger = logging.getLogger("abstain_guard.calibration")


@dataclass
class CalibrationSummary:
    """What a calibration run did (printed at the end of ``abstain-guard calibrate``)."""

    out: str
    cache_dir: str
    n_items: int
    split_sizes: dict[str, int]
    accuracy: dict[str, float]
    excluded_judgments: int
    scorer: str
    seconds: dict[str, float] = field(default_factory=dict)
    skipped_rows: int = 0
    judgments: dict[str, int] = field(default_factory=dict)

    def to_text(self) -> str:
        """Human-readable multi-line summary."""
        lines = [
            f"artifact      {self.out}",
            f"cache         {self.cache_dir}",
            f"questions     {self.n_items} ({self.skipped_rows} bad rows skipped)",
            "split sizes   " + ", ".join(f"{k} {v}" for k, v in self.split_sizes.items()),
            "accuracy      " + ", ".join(f"{k} {v:.1%}" for k, v in self.accuracy.items()),
            f"excluded      {self.excluded_judgments} judgments could not be made",
            "judgments     " + ", ".join(f"{k} {v}" for k, v in self.judgments.items()),
            f"scorer        {self.scorer}",
            "time          " + ", ".join(f"{k} {v:.0f}s" for k, v in self.seconds.items()),
        ]
        return "\n".join(lines)


def _now() -> float:
    return time.perf_counter()


def resolve_cache_dir(out: str | Path, config: CalibrationConfig) -> Path:
    """Where a run's caches live: ``config.cache_dir`` or ``<out>.cache`` beside ``out``."""
    if config.cache_dir:
        return Path(config.cache_dir)
    out_path = Path(out)
    return out_path.with_name(out_path.name + ".cache")


def calibrate(
    data: str | Path | Sequence[QAItem],
    out: str | Path,
    *,
    config: CalibrationConfig | None = None,
    model: Any = None,
    judges: dict[str, Any] | None = None,
    chat_models: dict[str, Any] | None = None,
    progress: bool = True,
    on_generation_chunk: Callable[[int], None] | None = None,
    executor: Any = None,
) -> CalibrationSummary:
    """Generate, judge, split, fit the scorer and write a :class:`GuardArtifact` to ``out``.

    ``data`` is ``"builtin"``, a JSONL/CSV path, or a list of :class:`QAItem`; ``config``
    defaults to the embedded model, the lexical judge and the geometry scorer. ``model``,
    ``judges`` (per question kind) and ``executor`` (a started
    :class:`~.answering.executors.RayExecutor`) are built here when not given, the executor
    only with ``config.executor == "ray"`` (and shut down at the end); ``chat_models`` are
    the named LangChain chat models the config's LLM judges refer to;
    ``on_generation_chunk`` is called after each generated chunk is stored.

    Raises:
        DatasetError, InsufficientDataError, ConfigError, JudgeError, OutputPathError,
            ModelNotFoundError: before any model is loaded or any file written, when the
            data, sizes, judge spec, model or output locations are wrong; PreflightError
            when several are (listing them all).
        CalibrationLockedError: at once, when another run holds ``<out>.lock`` or
            ``<cache_dir>.lock`` (the message names its PID).
        CacheError: before any model is loaded, when a cache file is not SQLite, damaged,
            truncated, or holds an edited value.
        CalibrationError: when labels end up one-class or the scorer cannot be fitted.
        DistributedChunkError: chunks kept failing on the Ray workers (the rest is cached).
    """
    cfg = config or CalibrationConfig()
    cache_dir = resolve_cache_dir(out, cfg)
    # before anything is written (the locks too) or loaded; scorer: auto checks every
    # candidate's scorer and sizes
    checked, *_ = [
        preflight(
            data,
            out,
            cache_dir,
            checked_cfg,
            check_model=i == 0 and model is None,
            check_judge=i == 0 and judges is None,
            chat_models=chat_models,
        )
        for i, checked_cfg in enumerate(_preflight_configs(cfg))
    ]
    with run_locks(out, cache_dir):
        started = None
        if executor is None and cfg.executor == "ray" and model is None:
            from .answering.executors import RayExecutor

            executor = started = RayExecutor.start(cfg)
        try:
            given = _Given(model, judges, chat_models, executor, progress, on_generation_chunk)
            return _calibrate(data, checked, out, cfg, given)
        finally:
            if started is not None:
                started.shutdown()


def _preflight_configs(config: CalibrationConfig) -> list[CalibrationConfig]:
    """The configs :func:`preflight` checks: ``config`` itself, or with ``candidates`` its
    delta at delta/K (the level the guard certifies at, for the calibration size check) and,
    for ``scorer: auto``, one per candidate (the size check once)."""
    if not config.candidates:
        return [config]
    level = config.delta / len(config.candidates)
    if not config.selects:
        return [config.model_copy(update={"delta": level})]
    return [
        config.for_candidate(name).model_copy(
            update={"delta": level, "risk_target": config.risk_target if i == 0 else None}
        )
        for i, name in enumerate(config.candidates)
    ]


@dataclass(frozen=True)
class _Given:
    """What the caller of :func:`calibrate` built already (``None``: built here), and how
    the run reports progress."""

    model: Any = None
    judges: dict[str, Any] | None = None
    chat_models: dict[str, Any] | None = None
    executor: Any = None
    progress: bool = True
    on_generation_chunk: Callable[[int], None] | None = None


@dataclass
class _Fitted:
    """One run's answers, its fitted scorer and the calibration split's scores."""

    answers: AnswerRows
    scorer: Any
    scores: np.ndarray
    actions: Any = None  # the calibration runs' action statistics (a step-gated agent)
    selection: ScorerSelection | None = None
    deployment: Any = None  # the agent's deployment record
    stream: Any = None  # certified streaming: the stream statistics


def _start_run(cfg: CalibrationConfig, cache_dir: Path, given: _Given, t0: float) -> _Run:
    """The run's judges (distributed to the executor's replicas), its store and its model."""
    judges = given.judges
    if judges is None:
        judges = build_judges(cfg, cache_dir / "judgments.sqlite", given.chat_models)
        if given.executor is not None and given.chat_models is None:
            from .answering.ray_judges import distribute_judges

            distribute_judges(judges, cfg, given.executor)
    cache_dir.mkdir(parents=True, exist_ok=True)
    store = RunStore(cache_dir / "run.sqlite")
    model = given.model
    if model is None:
        model = given.executor.driver_model(cfg) if given.executor is not None else load_model(cfg)
    fingerprint = str(getattr(model, "fingerprint", "unknown"))
    if isinstance(cfg.model, ChatModelSpec):  # an API model: its class and settings
        fingerprint = chat_model_fingerprint(model)
    timings = {"load": _now() - t0}
    run = _Run(
        model, store, cfg, fingerprint, judges, given.progress, given.on_generation_chunk, timings
    )
    run.executor = given.executor
    return run


def _answer_and_fit(
    run: _Run, splits: dict[str, list[QAItem]], ordered: list[QAItem], items: list[QAItem]
) -> _Fitted:
    """The user's agent run as deployed (:mod:`.agent_calibration`), every candidate on the
    same answers (certified at delta/K), or the configured scorer fitted."""
    cfg = run.config
    if cfg.agent:
        scorer = make_scorer(cfg)
        run.capture_mode = getattr(scorer, "capture", None)
        t = _now()
        answers, scorer, scores, actions = calibrate_agent_splits(run, splits, scorer, cfg)
        run.timings["agent runs"] = _now() - t - run.timings.get("judge", 0.0)
        deployment = agent_deployment_record(run.model, cfg, items, list(answers.values()))
        return _Fitted(answers, scorer, scores, actions=actions, deployment=deployment)
    if cfg.selects:
        answers, scorer, scores, selection = select_candidates(run, splits, ordered)
        return _Fitted(answers, scorer, scores, selection=selection)
    return _Fitted(*fit_scorer(run, splits, ordered, cfg))


def _accuracy(labeled: dict[str, list[QAItem]], judgments: Verdicts) -> dict[str, float]:
    """Each split's accuracy (NaN where none of its answers is labeled)."""
    return {
        name: float(np.mean(labels(labeled[name], judgments))) if labeled[name] else float("nan")
        for name in SPLIT_NAMES
    }


def _metadata(
    data: str | Path | Sequence[QAItem],
    run: _Run,
    items: list[QAItem],
    splits: dict[str, list[QAItem]],
    labeled: dict[str, list[QAItem]],
    fitted: _Fitted,
    cache_dir: Path,
) -> dict[str, Any]:
    """The artifact's metadata: where its questions, judge and configuration came from, the
    splits and their accuracy, and the deployment it was calibrated for."""
    cfg, judgments = run.config, run.judgments
    stream_record = None if fitted.stream is None else fitted.stream.record
    metadata: dict[str, Any] = {
        "data": str(data) if isinstance(data, (str, Path)) else "python",
        "judge": {k: getattr(j, "identity", type(j).__name__) for k, j in run.judges.items()},
        "config": cfg.model_dump(mode="json"),
        "split_sizes": {k: len(v) for k, v in labeled.items()},
        "accuracy": {
            k: v if v == v else None  # NaN: none
            for k, v in _accuracy(labeled, judgments).items()
        },
        "excluded_judgments": sum(
            judgments[it.id].correct is None for name in SPLIT_NAMES for it in splits[name]
        ),
        "judgments": summarize_judgments(judgments.values()),
        "cache_dir": str(cache_dir),
        "test_ids": [it.id for it in labeled["test"]],
        "calibration_ids": [it.id for it in labeled["calibration"]],
        **(
            {"selection_ids": [it.id for it in splits["selection"]]}
            if "selection" in splits
            else {}
        ),
        "items_sha256": items_digest(items),
        "deployment": (
            fitted.deployment or deployment_record(run.model, cfg, items, stream_record)
        ).to_json(),
    }
    if fitted.selection is not None:
        metadata["selection"] = fitted.selection.to_json()
    return metadata


def _calibration_labels(run: _Run, fitted: _Fitted, calibration: list[QAItem]) -> np.ndarray:
    """The calibration split's labels; with a chunk rule the scores become the stream
    statistics, and a scorer named among candidates records that choice."""
    cfg = run.config
    if cfg.chunk_rule is not None:
        t = _now()
        fitted.stream = calibration_stream_scores(
            run, fitted.scorer, calibration, fitted.answers, fitted.scores
        )
        fitted.scores = fitted.stream.statistic
        run.timings["chunk ends"] = _now() - t
    cal_correct = np.array(labels(calibration, run.judgments))
    if fitted.selection is None and cfg.candidates:  # chosen among them elsewhere on this split
        assert cfg.risk_target is not None  # the config requires it with candidates
        fitted.selection = record_choice(
            cfg.scorer,
            fitted.scores,
            cal_correct,
            cfg.candidates,
            cfg.risk_target,
            cfg.delta,
            data=_SELECTION_DATA,
            choice="named in the calibration config (chosen before this run on this split)",
        )
    return cal_correct


def _calibrate(
    data: str | Path | Sequence[QAItem],
    checked: tuple[list[QAItem], int, dict[str, list[QAItem]]],
    out: str | Path,
    cfg: CalibrationConfig,
    given: _Given,
) -> CalibrationSummary:
    """:func:`calibrate`'s steps after its checks (``checked``: the items, the skipped row
    count and the splits from :func:`preflight`), run while its locks are held."""
    t0 = _now()
    cache_dir = resolve_cache_dir(out, cfg)
    items, skipped, splits = checked
    run = _start_run(cfg, cache_dir, given, t0)
    ordered = [it for name in SPLIT_NAMES for it in splits[name]]
    fitted = _answer_and_fit(run, splits, ordered, items)
    labeled = labeled_splits(splits, run.judgments)
    cal_correct = _calibration_labels(run, fitted, labeled["calibration"])
    cal_scores, cal_actions, stream = fitted.scores, fitted.actions, fitted.stream
    cal_groups = calibration_groups(labeled["calibration"])
    scorer, answers = fitted.scorer, fitted.answers
    metadata = _metadata(data, run, items, splits, labeled, fitted, cache_dir)
    review = start_review(out, metadata, cfg.review_size, (cal_scores, cal_correct), cfg)
    artifact = GuardArtifact.from_calibration(
        scorer=scorer,
        calibration=CalibrationSet(
            cal_scores,
            cal_correct,
            groups=None if cal_groups is None else np.asarray(cal_groups),
            action_statistic=cal_actions,
            stream_first=None if stream is None else stream.first,
        ),
        model_fingerprint=run.fingerprint,
        metadata=metadata,
    )
    artifact.save(out, overwrite=True)
    if review is not None:
        write_review_file(review_path(out), review, labeled["calibration"], answers)
    run.timings["total"] = _now() - t0
    summary = CalibrationSummary(
        out=str(out),
        cache_dir=str(cache_dir),
        n_items=len(items),
        split_sizes=metadata["split_sizes"],
        accuracy=_accuracy(labeled, run.judgments),
        excluded_judgments=metadata["excluded_judgments"],
        scorer=scorer.kind,
        seconds=run.timings,
        skipped_rows=skipped,
        judgments=metadata["judgments"],
    )
    (cache_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2, default=str))
    return summary


_SELECTION_DATA = "the calibration split of this run (the answers the artifact stores)"


def fit_scorer(
    run: _Run, splits: dict[str, list[QAItem]], ordered: list[QAItem], config: CalibrationConfig
) -> tuple[AnswerRows, Any, np.ndarray]:
    """Generate (or read from the run cache) and judge every answer, fit ``config.scorer``
    on reference + train and score the calibration split: ``(answers, scorer, scores)``.
    A geometry scorer's inputs are captured while generating; answers already cached are
    never generated again (the fit replays what they lack)."""
    scorer = make_scorer(config)
    run.config, run.capture_mode = config, getattr(scorer, "capture", None)
    on_engine = not isinstance(config.model, ChatModelSpec)  # a chat model: no capture pass
    if config.scorer in FIT_SCORERS and captures_geometry(scorer) and on_engine:
        held_model = scoring_model(run.model, scorer)
        answers, _, means = run.generate_with_capture(splits, held_model)
    else:
        answers, means = run.generate_then_judge(splits, ordered), None
    labeled = labeled_splits(splits, run.judgments)
    t = _now()
    if means is not None:
        scorer, cal_scores = fit_captured(
            scorer,
            held_model,
            labeled,
            answers,
            run.judgments,
            config,
            means,
            run.store,
            progress=run.progress,
        )
    else:
        scorer, cal_scores = fit_and_score(
            run.model, labeled, answers, run.judgments, config, progress=run.progress
        )
    run.timings["fit"] = run.timings.get("fit", 0.0) + _now() - t
    return answers, scorer, cal_scores


def select_candidates(
    run: _Run, splits: dict[str, list[QAItem]], ordered: list[QAItem]
) -> tuple[AnswerRows, Any, np.ndarray, ScorerSelection]:
    """``scorer: auto``: calibrate every candidate of ``run.config`` on the same answers
    (generated once: later candidates read the run cache; geometry-capturing candidates go
    first so their inputs are captured while generating), certify each at delta/K and keep
    the one certifying the most participation at ``risk_target``
    (:func:`abstain_guard.guarantee.selection.select_scorer`): ``(answers, scorer, scores,
    selection)``. With ``selection_share`` the choice is made on a selection split of the
    calibration answers (:func:`~abstain_guard.guarantee.selection.select_on_split`), which
    leaves ``splits["calibration"]`` for ``splits["selection"]``.
    """
    config = run.config
    assert config.candidates is not None and config.risk_target is not None
    names = list(config.candidates)
    order = sorted(names, key=lambda n: not captures_geometry(build_scorer(n)))
    fitted: dict[str, tuple[Any, np.ndarray]] = {}
    answers: AnswerRows = {}
    for name in order:
        logger.info("scorer auto: calibrating candidate %s", name)
        answers, scorer, scores = fit_scorer(run, splits, ordered, config.for_candidate(name))
        fitted[name] = (scorer, scores)
    run.config = config
    labeled = labeled_splits(splits, run.judgments)
    correct = np.array(labels(labeled["calibration"], run.judgments))
    by_name = {name: fitted[name][1] for name in names}
    if config.selection_share is None:
        selection = select_scorer(
            by_name, correct, config.risk_target, config.delta, data=_SELECTION_DATA
        )
        return answers, *fitted[selection.chosen], selection
    selection, pick, keep = select_on_split(
        by_name,
        correct,
        config.risk_target,
        config.delta,
        share=config.selection_share,
        seed=config.seed,
        data=_SELECTION_DATA,
    )
    cal = labeled["calibration"]
    splits["selection"], splits["calibration"] = [cal[i] for i in pick], [cal[i] for i in keep]
    scorer, scores = fitted[selection.chosen]
    return answers, scorer, scores[keep], selection


@dataclass
class _Run:
    """The generation and judging steps of one run (what they share)."""

    model: Any
    store: RunStore
    config: CalibrationConfig
    fingerprint: str
    judges: dict[str, Any]
    progress: bool
    on_chunk: Callable[[int], None] | None
    timings: dict[str, float]
    judgments: Verdicts = field(default_factory=dict)
    executor: Any = None  # a RayExecutor: generate on its replicas
    capture_mode: Any = None  # the scorer's capture mode (what ``held_model`` runs in)

    def generate(
        self,
        items: list[QAItem],
        size: int | None,
        capture: Any = "none",
        means: Any = None,
        model: Any = None,
    ) -> AnswerRows:
        """:func:`generate_answers` for ``items`` (timed under ``"generate"``) with ``model``
        (default: the run's model)."""
        t = _now()
        answers = generate_answers(
            self.model if model is None else model,
            items,
            self.store,
            self.config,
            fingerprint=self.fingerprint,
            options=GenerationOptions(
                batch_size=size,
                capture=capture,
                reference=means,
                executor=None
                if self.executor is None
                else self.executor.with_capture_mode(None if model is None else self.capture_mode),
                progress=self.progress,
                on_chunk=self.on_chunk,
            ),
        )
        self.timings["generate"] = self.timings.get("generate", 0.0) + _now() - t
        return answers

    def judge(self, items: Sequence[QAItem], answers: AnswerRows) -> None:
        """Judge ``items`` (timed under ``"judge"``); verdicts go to ``self.judgments``."""
        t = _now()
        self.judgments.update(judge_answers(self.judges, items, answers, progress=self.progress))
        self.timings["judge"] = self.timings.get("judge", 0.0) + _now() - t

    def generate_then_judge(
        self, splits: dict[str, list[QAItem]], ordered: list[QAItem]
    ) -> AnswerRows:
        """Every answer without capture (reference and train batched, held-out one per
        call), then every verdict."""
        answers: AnswerRows = {}
        for names, size in ((("reference", "train"), None), (HELD_OUT, 1)):
            answers.update(self.generate([it for n in names for it in splits[n]], size))
        self.judge(ordered, answers)
        return answers

    def generate_with_capture(
        self, splits: dict[str, list[QAItem]], held_model: Any = None
    ) -> tuple[AnswerRows, Verdicts, Any]:
        """The reference split with states, judged, its means fitted; then train (batched)
        and held-out (one per call) with Φ online, generated by ``held_model`` (the scorer's
        capture mode, :func:`.answering.online_geometry.scoring_model`; default: the run's model).
        Returns answers, verdicts and means."""
        reference = splits["reference"]
        answers = self.generate(reference, None, "states")
        self.judge(reference, answers)
        labeled = labeled_items(reference, self.judgments)
        check_two_classes({"reference": labeled}, self.judgments, self.config)
        t = _now()
        ensure_reference_arrays(
            self.model, labeled, answers, self.store, self.config, self.progress
        )
        means = fit_reference_means(labeled, answers, self.judgments, self.store)
        self.timings["means"] = _now() - t
        rest: list[QAItem] = []
        for names, size in ((("train",), None), (HELD_OUT, 1)):
            items = [it for n in names for it in splits[n]]
            answers.update(self.generate(items, size, "geometry", means, held_model))
            rest += items
        self.judge(rest, answers)
        return answers, self.judgments, means
