"""``abstain-guard evaluate --live``: run the guard exactly as deployed on the artifact's
held-out questions and compare with what calibration stored.

For every held-out question (the artifact's stored calibration and test ids) the guard chain
from :func:`~abstain_guard.guard.chains.load_guard_chain` — the recorded prompt,
token budget and decoding, one question per call — generates, scores and decides. The
report gives, per question, the live score beside the stored score (the artifact's
calibration score, or for test questions the score of the cached answer replayed as
calibration does) and whether the live tokens equal the cached ones; and overall the live
participation beside the guaranteed band, and the accuracy of the answered questions (the
live answers judged with the artifact's judge).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.contract.chat_model_specs import ChatModelSpec, chat_model_fingerprint
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.contract.kernels import bit_deciding, kernel_differences, near_threshold
from abstain_guard.contract.prompts import history_messages
from abstain_guard.contract.runnables import with_calibrated_capture
from abstain_guard.errors import AbstainGuardError, ConfigError
from abstain_guard.guarantee.certificate import Certificate
from abstain_guard.guarantee.in_distribution import SAMPLED_FAMILIES, live_matches_stored
from abstain_guard.guard.chains import load_guard_chain
from abstain_guard.guard.policy import decision_of
from abstain_guard.monitor.guard_monitor import calibration_sha256

from ..building.answering.answer_rows import GenerationOptions
from ..building.answering.answers import generate_answers, replay_as_deployed
from ..building.answering.api_generation import score_api_answers
from ..building.answering.models import load_model
from ..building.judges.judging import build_judges, judge_answers
from ..building.run.calibration_config import CalibrationConfig
from .cache_reuse import EvaluateCache, evaluate_cache
from .held_out import artifact_items

__all__ = ["in_distribution", "kernel_summary", "live_check", "summarize_live"]


def _generated(message: Any) -> dict[str, Any]:
    """The response metadata of the generated answer (the withheld one when abstaining)."""
    meta = dict(message.response_metadata or {})
    withheld = meta.get("withheld_response")
    if withheld:
        return dict(withheld.get("response_metadata") or {})
    return meta


def summarize_live(rows: list[dict[str, Any]], guarantee: Certificate) -> dict[str, Any]:
    """Aggregate the per-question rows of :func:`live_check` (pure).

    Returns participation (live and from the stored scores), accuracy and error when
    answered (next to the risk target in risk mode),
    the median and max |live − stored| score, and the fraction of identical tokens.
    """
    scored = [r for r in rows if r["live_score"] is not None and r["stored_score"] is not None]
    diffs = np.array([abs(r["live_score"] - r["stored_score"]) for r in scored])
    answered = [r for r in rows if not r["abstained"]]
    judged = [r for r in answered if r["correct"] is not None]
    return {
        "n": len(rows),
        "participation_live": float(np.mean([not r["abstained"] for r in rows])),
        "participation_stored": float(np.mean([r["stored_answers"] for r in rows])),
        "guaranteed_interval": guarantee.to_dict().get("participation_interval"),
        "accuracy_when_answered_live": (
            float(np.mean([r["correct"] for r in judged])) if judged else None
        ),
        "error_when_answered_live": (
            1.0 - float(np.mean([r["correct"] for r in judged])) if judged else None
        ),
        "risk_target": guarantee.risk_target,
        "answered": len(answered),
        "same_tokens": float(np.mean([r["same_tokens"] for r in rows])),
        "same_decision": float(np.mean([r["stored_answers"] != r["abstained"] for r in rows])),
        "abs_score_diff_median": float(np.median(diffs)) if diffs.size else None,
        "abs_score_diff_max": float(diffs.max()) if diffs.size else None,
        "unscorable": len(rows) - len(scored),
    }


def in_distribution(scorer: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """For a scorer whose scores are sampled (its family in ``SAMPLED_FAMILIES``), the
    two-sample check of the rows' live against their stored scores,
    ``{"in_distribution": DistributionCheck.to_dict() | None}`` (None: fewer than 2 scored
    rows); ``{}`` for any other scorer, whose live scores equal the stored ones."""
    if getattr(scorer, "family", None) not in SAMPLED_FAMILIES:
        return {}
    pairs = [
        (r["live_score"], r["stored_score"])
        for r in rows
        if r["live_score"] is not None and r["stored_score"] is not None
    ]
    if len(pairs) < 2:
        return {"in_distribution": None}
    live, stored = zip(*pairs, strict=True)
    return {"in_distribution": live_matches_stored(live, stored).to_dict()}


def kernel_summary(
    calibrated: dict[str, Any] | None,
    live: dict[str, Any] | None,
    rows: list[dict[str, Any]],
    scores: np.ndarray,
    threshold: float,
) -> dict[str, Any]:
    """The kernels part of the live summary (pure): the bit-deciding kernel facts of the
    calibration and of this run (:func:`abstain_guard.contract.kernels.bit_deciding`), how they
    differ, the measured max |live − stored| score over ``rows``, and how many of the
    calibration ``scores`` ``[n]`` lie within that distance of ``threshold`` (the decisions
    that move could flip)."""
    diffs = [
        abs(r["live_score"] - r["stored_score"])
        for r in rows
        if r["live_score"] is not None and r["stored_score"] is not None
    ]
    measured = max(diffs) if diffs else None
    differences = kernel_differences(live, calibrated)
    return {
        "calibration": bit_deciding(calibrated),
        "live": bit_deciding(live),
        "same": not differences,
        "differences": differences,
        "abs_score_diff_max": measured,
        "calibration_scores_near_threshold": (
            near_threshold(scores, threshold, measured) if measured is not None else None
        ),
    }


def live_check(
    artifact_path: str | Path,
    *,
    guard_config: Any = None,
    model: Any = None,
    out: str | Path | None = None,
    limit: int | None = None,
    judges: dict[str, Any] | None = None,
    progress: bool = True,
    split: str = "held_out",
    cache_dir: str | Path | None = None,
    reuse_calibration_cache: bool = True,
    concurrency: int = 1,
) -> dict[str, Any]:
    """Run the deployed guard chain on the artifact's held-out questions.

    Args:
        artifact_path: the artifact directory.
        guard_config: the :class:`GuardConfig` to deploy with (default participation 0.8).
        model: an already loaded chat model (else loaded from the artifact's config).
        out: if given, ``live.json`` is written there.
        limit: only the first N of those questions (calibration ones first).
        split: ``"held_out"`` (calibration and test questions), ``"calibration"`` or
            ``"test"`` (never used for the threshold: the realized error among answered
            there is an out-of-sample check of a risk target).
        judges: judges per question kind (default: the artifact's judge, cached).
        progress: progress bar.
        cache_dir: where the cached answers and verdicts live, read and written (default
            ``<out>/cache``, or a temporary directory without ``out``).
        reuse_calibration_cache: without ``cache_dir``, also read the answers and verdicts
            of the artifact's calibration cache, read-only (:mod:`.cache_reuse`; never
            written).
        concurrency: guarded calls in flight at once (a chain question at a time: 1).

    Returns:
        ``{"summary": ..., "rows": [...], "guarantee": ...}``.
    """
    artifact = GuardArtifact.load(artifact_path)
    _refuse_recalibrated(artifact, artifact_path)
    cfg = CalibrationConfig(**artifact.metadata.get("config", {}))
    if model is None:
        model = load_model(cfg)
    _, items, _ = artifact_items(artifact)
    record = DeploymentRecord.from_metadata(artifact.metadata)
    model = with_calibrated_capture(model, record)  # a local model: the calibrated rule
    if record is not None and record.agent is not None:
        return _live_agent(
            artifact,
            artifact_path,
            cfg,
            record,
            model,
            guard_config,
            items,
            out=out,
            limit=limit,
            judges=judges,
            progress=progress,
            split=split,
            cache_dir=cache_dir,
            reuse=reuse_calibration_cache,
        )
    chains = {
        kind: load_guard_chain(artifact, guard_config, model=model, kind=kind)[:2]
        for kind in sorted({it.kind for it in items})
    }
    guard = next(iter(chains.values()))[1]
    cal_ids = list(artifact.metadata.get("calibration_ids", []))
    if split not in ("held_out", "calibration", "test"):
        raise ConfigError(f"split must be 'held_out', 'calibration' or 'test', got {split!r}.")
    if split != "held_out":
        wanted = set(cal_ids)
        items = [it for it in items if (it.id in wanted) == (split == "calibration")]
    if limit is not None:
        items = items[:limit]
    stored_cal = dict(zip(cal_ids, artifact.scores.tolist(), strict=True))
    with tempfile.TemporaryDirectory(prefix="abstain-guard-live-") as scratch:
        cache = _live_cache(
            artifact, artifact_path, cache_dir, out, scratch, reuse=reuse_calibration_cache
        )
        return _run_live(
            artifact,
            artifact_path,
            cfg,
            model,
            chains,
            guard,
            items,
            stored_cal,
            split,
            cache,
            judges,
            out,
            progress,
            concurrency=concurrency,
        )


def _live_cache(
    artifact: Any,
    artifact_path: str | Path,
    cache_dir: str | Path | None,
    out: str | Path | None,
    scratch: str,
    *,
    reuse: bool,
) -> EvaluateCache:
    """``cache_dir`` alone if given; else ``<out>/cache`` (or ``scratch``) over the
    calibration cache (read-only) when ``reuse``."""
    if cache_dir is not None:
        return EvaluateCache(Path(cache_dir))
    where = Path(out) / "cache" if out is not None else Path(scratch)
    return evaluate_cache(where, artifact, artifact_path, reuse=reuse)


def _first_calibration(metadata: Mapping[str, Any]) -> tuple[Mapping[str, Any], int]:
    """The ``recalibrated_from`` record of the artifact first calibrated on held-out
    questions (each recalibration nests the one before under ``metadata``) and how many
    recalibrations lie between it and ``metadata``'s artifact."""
    source: Mapping[str, Any] = metadata["recalibrated_from"]
    depth = 1
    while True:
        before = source.get("metadata")
        if not isinstance(before, Mapping) or not isinstance(
            before.get("recalibrated_from"), Mapping
        ):
            return source, depth
        source, depth = before["recalibrated_from"], depth + 1


def _where_now(path: str, sha256: str | None) -> str:
    """A note when ``path`` no longer holds the artifact whose calibration sha256 is
    ``sha256`` ("" when it does, or when nothing was recorded to compare)."""
    look = (
        f"pass --artifact where the artifact with calibration sha256 {sha256} is now"
        if sha256
        else "pass --artifact where it is now"
    )
    try:
        there = calibration_sha256(GuardArtifact.load(path).scores)
    except AbstainGuardError:
        return f" (there is no artifact at {path} now: {look})"
    if sha256 and there != sha256:
        return f" ({path} now holds another artifact, calibration sha256 {there}: {look})"
    return ""


def _refuse_recalibrated(artifact: Any, artifact_path: str | Path) -> None:
    """An artifact recalibrated from live feedback holds live decisions as its calibration
    set: there are no held-out questions to ask again, so the live check refuses it up front
    (before any model loads) and names the command to run instead: the live check of the
    artifact first calibrated on held-out questions (the same model, prompt and scorer; a
    recalibration keeps them), found through the ``recalibrated_from`` records, with a note
    when that artifact is no longer where it was recorded."""
    if not isinstance(artifact.metadata.get("recalibrated_from"), Mapping):
        return
    first, depth = _first_calibration(artifact.metadata)
    path = first.get("artifact")
    times = f" (recalibrated {depth} times)" if depth > 1 else ""
    where = _where_now(str(path), first.get("calibration_sha256")) if path else ""
    raise ConfigError(
        f"{artifact_path} was recalibrated from live feedback{times}: its calibration scores "
        "are the scores of live decisions, which have no held-out questions that evaluate "
        "--live could ask again. Check the deployment on the held-out questions of the "
        "artifact first calibrated on them (same model, prompt and scorer): "
        f"`abstain-guard evaluate --live --artifact {path or '<original>'}`{where}; and "
        "watch the recalibrated guard with its monitor (serve --monitor-log)."
    )


def _select(
    artifact: Any, items: list[Any], split: str, limit: int | None
) -> tuple[list[Any], dict[str, float]]:
    """The held-out items of ``split`` (first ``limit``) and the stored calibration scores."""
    cal_ids = list(artifact.metadata.get("calibration_ids", []))
    if split not in ("held_out", "calibration", "test"):
        raise ConfigError(f"split must be 'held_out', 'calibration' or 'test', got {split!r}.")
    if split != "held_out":
        wanted = set(cal_ids)
        items = [it for it in items if (it.id in wanted) == (split == "calibration")]
    if limit is not None:
        items = items[:limit]
    return items, dict(zip(cal_ids, artifact.scores.tolist(), strict=True))


def _live_agent(
    artifact: Any,
    artifact_path: str | Path,
    cfg: CalibrationConfig,
    record: DeploymentRecord,
    model: Any,
    guard_config: Any,
    items: list[Any],
    *,
    out: str | Path | None,
    limit: int | None,
    judges: dict[str, Any] | None,
    progress: bool,
    split: str,
    cache_dir: str | Path | None,
    reuse: bool,
) -> dict[str, Any]:
    """:func:`live_check` for an agent artifact (:mod:`.agent_live`)."""
    from .agent_live import LiveAgent, agent_live_rows
    from .agent_step_live import step_summary

    items, stored_cal = _select(artifact, items, split, limit)
    with tempfile.TemporaryDirectory(prefix="abstain-guard-live-") as scratch:
        where = _live_cache(artifact, artifact_path, cache_dir, out, scratch, reuse=reuse)
        live = LiveAgent(artifact, cfg, record, model, guard_config)
        rows, policy, guarded_by = agent_live_rows(live, items, stored_cal, where, judges, progress)
    answered = [r for r in rows if not r.get("no_final_answer")]
    rule = policy.rule
    summary: dict[str, Any]
    if record.agent is not None and record.agent.gating == "steps":
        summary = step_summary(rows, rule.guarantee)
    else:
        summary = summarize_live(answered, rule.guarantee) if answered else {"n": 0}
        summary["runs_without_final_answer"] = len(rows) - len(answered)
    summary["guarded_by"] = guarded_by
    summary["tool_steps_mean"] = (
        sum(r["tool_steps"] for r in answered) / len(answered) if answered else None
    )
    result = {
        "artifact": str(artifact_path),
        "split": split,
        "agent": record.agent.model_dump(mode="json") if record.agent else None,
        "threshold": rule.threshold,
        "mode": rule.mode,
        "target": rule.target,
        "guarantee": rule.guarantee.to_dict(),
        "summary": summary,
        "rows": rows,
    }
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "live.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def _run_live(
    artifact: Any,
    artifact_path: str | Path,
    cfg: CalibrationConfig,
    model: Any,
    chains: Mapping[Any, Any],
    guard: Any,
    items: list[Any],
    stored_cal: dict[str, float],
    split: str,
    cache: EvaluateCache,
    judges: dict[str, Any] | None,
    out: str | Path | None,
    progress: bool,
    concurrency: int = 1,
) -> dict[str, Any]:
    store = cache.run_store()
    fingerprint = str(getattr(model, "fingerprint", "unknown"))
    if isinstance(cfg.model, ChatModelSpec):  # as calibration keyed its answers
        fingerprint = chat_model_fingerprint(model)
    cached = generate_answers(
        model,
        items,
        store,
        cfg,
        fingerprint=fingerprint,
        options=GenerationOptions(batch_size=1, progress=False),
    )
    test_items = [it for it in items if it.id not in stored_cal]
    if isinstance(cfg.model, ChatModelSpec):  # scored from the stored answers' own metadata
        test_scores = score_api_answers(artifact.scorer, test_items, cached)
    else:
        replayed = replay_as_deployed(artifact.scorer.prepare(model), test_items, cached, cfg)
        test_scores = artifact.scorer.score_many(replayed)
    stored = dict(stored_cal)
    stored.update(zip([it.id for it in test_items], test_scores.tolist(), strict=True))
    threshold = guard.threshold
    live_answers: dict[str, dict[str, Any]] = {}
    rows = []
    messages = _ask_live(chains, items, concurrency, progress)
    for it, msg in zip(items, messages, strict=True):
        info = decision_of(msg)
        assert info is not None
        meta = _generated(msg)
        withheld = msg.response_metadata.get("withheld_response") or {}
        live_answers[it.id] = {"text": str(withheld.get("content", msg.content))}
        rows.append(
            {
                "id": it.id,
                "split": "calibration" if it.id in stored_cal else "test",
                "question": it.question,
                "answer": live_answers[it.id]["text"],
                "live_score": info.score,
                "stored_score": stored[it.id],
                "stored_answers": bool(stored[it.id] <= threshold),
                "abstained": info.abstained,
                "same_tokens": list(meta.get("token_ids", []))
                == list(cached[it.id]["metadata"]["token_ids"]),
            }
        )
    if judges is None:
        judges = build_judges(cfg, cache.directory / "judgments.sqlite", read_from=cache.judgments)
    verdicts = judge_answers(judges, items, live_answers, progress=False)
    cache.log_reuse(store, judges)
    for row in rows:
        row["correct"] = verdicts[row["id"]].correct
    rule = guard.decision_rule
    result = {
        "artifact": str(artifact_path),
        "split": split,
        "threshold": threshold,
        "mode": rule.mode,
        "target": rule.target,
        "guarantee": rule.guarantee.to_dict(),
        "summary": {
            **summarize_live(rows, rule.guarantee),
            **in_distribution(artifact.scorer, rows),
            "kernels": kernel_summary(
                _recorded_kernels(artifact),
                _model_kernels(model),
                rows,
                artifact.scores,
                threshold,
            ),
        },
        "rows": rows,
    }
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "live.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def _ask_live(
    chains: Mapping[Any, Any], items: list[Any], concurrency: int, progress: bool
) -> list[Any]:
    """Each item's guarded response, ``concurrency`` calls in flight at once (the vLLM
    backend batches them as a served deployment would; 1: one call at a time)."""

    def inputs(it: Any) -> dict[str, Any]:
        got: dict[str, Any] = {"question": it.prompt_text()}
        if it.history:  # a conversation row: the earlier turns, as calibration sent them
            got["history"] = history_messages(it.history)
        return got

    if concurrency <= 1:
        return [
            chains[it.kind][0].invoke(inputs(it))
            for it in tqdm(items, desc="live", disable=not progress, unit="q")
        ]
    out: list[Any] = [None] * len(items)
    for kind in {it.kind for it in items}:
        where = [i for i, it in enumerate(items) if it.kind == kind]
        answers = chains[kind][0].batch(
            [inputs(items[i]) for i in where], config={"max_concurrency": int(concurrency)}
        )
        for i, msg in zip(where, answers, strict=True):
            out[i] = msg
    return out


def _recorded_kernels(artifact: Any) -> dict[str, Any] | None:
    """The kernel facts the artifact's calibration recorded (None: none recorded)."""
    record = DeploymentRecord.from_metadata(artifact.metadata)
    return record.decoding.get("kernels") if record is not None else None


def _model_kernels(model: Any) -> dict[str, Any] | None:
    """The kernel facts ``model`` generates with in this process (None: it records none)."""
    settings = getattr(model, "decoding_settings", None)
    return settings().get("kernels") if callable(settings) else None
