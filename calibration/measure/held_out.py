"""The held-out answers ``abstain-guard evaluate`` measures (:func:`collect_held_out`):
answered, judged and replayed as the deployed guard scores them. Without ``data`` they are
the artifact's own calibration and test splits (never used to fit the scorer); with
``data``, another labeled file answered by the same model and judged with the artifact's
judge (choice and math questions with the choice / numeric judges).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard.contract.chat_model_specs import ChatModelSpec, chat_model_fingerprint
from abstain_guard.contract.metadata import HIDDEN, QUESTION_GROUP
from abstain_guard.errors import CalibrationError, DatasetError

from ..building.answering.answer_rows import STATES_NS, AnswerRow, GenerationOptions
from ..building.answering.answers import generate_answers, replay_as_deployed
from ..building.answering.online_geometry import reference_hidden, reference_responses
from ..building.judges.judging import build_judges, judge_answers, labeled_items, labels
from ..building.questions.dataset_files import Fields, load_dataset
from ..building.questions.datasets import QAItem, split_items
from ..building.questions.items import items_digest, load_items, named_spec
from ..building.questions.named_datasets import load_named_dataset
from ..building.run.calibration_config import CalibrationConfig
from .cache_reuse import EvaluateCache

logger = logging.getLogger("abstain_guard.calibration")


def with_groups(metadata: Sequence[dict[str, Any]], items: Sequence[QAItem]) -> list[Any]:
    """Copies of ``metadata`` with each question's type (``question_group``)."""
    return [{**m, QUESTION_GROUP: it.group} for m, it in zip(metadata, items, strict=True)]


def reference_metadata(answer: AnswerRow, store: Any) -> dict[str, Any]:
    """A reference answer's metadata for the fitted baselines: its likelihood metadata and
    the probe layers' summaries (from its row, or from its cached states)."""
    meta = dict(answer.get("metadata") or {})
    hidden = answer.get("hidden")
    if hidden is None:
        hidden = reference_hidden(answer, store.get_arrays(STATES_NS, answer["key"]))
    if hidden is not None:
        meta["geometry"] = {**(meta.get("geometry") or {}), HIDDEN: hidden}
    return meta


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


def backend_of(cfg: CalibrationConfig) -> str:
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
    cfg = CalibrationConfig.of_artifact(artifact.metadata)
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
