"""``abstain-guard evaluate --live``: run the guard exactly as deployed on the artifact's
held-out questions and compare with what calibration stored (what is compared:
docs/results.md, 'The deployment check').
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
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
from abstain_guard.monitor.scope import calibration_sha256

from ..building.answering.answer_rows import AnswerRows, GenerationOptions
from ..building.answering.answers import generate_answers, replay_as_deployed
from ..building.answering.api_generation import score_api_answers
from ..building.answering.models import load_model
from ..building.judges.judging import build_judges, judge_answers
from ..building.run.calibration_config import CalibrationConfig
from .cache_reuse import EvaluateCache, evaluate_cache
from .held_out import artifact_items


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
    """Run the deployed guard chain on the artifact's held-out questions:
    ``{"summary": ..., "rows": [...], "guarantee": ...}``, also written to ``out/live.json``.

    ``guard_config`` defaults to participation 0.8; ``limit`` keeps the first N questions
    (calibration ones first); ``split`` is ``"held_out"`` (calibration and test),
    ``"calibration"`` or ``"test"`` (never used for the threshold: the realized error among
    answered there is an out-of-sample check of a risk target). Answers and verdicts are
    cached in ``cache_dir`` (default ``<out>/cache``, or a temporary directory without
    ``out``); without it, ``reuse_calibration_cache`` also reads the artifact's calibration
    cache, read-only (:mod:`.cache_reuse`). ``concurrency``: guarded calls in flight at once.
    """
    artifact = GuardArtifact.load(artifact_path)
    _refuse_recalibrated(artifact, artifact_path)
    cfg = CalibrationConfig.of_artifact(artifact.metadata)
    if model is None:
        model = load_model(cfg)
    _, items, _ = artifact_items(artifact)
    record = DeploymentRecord.from_metadata(artifact.metadata)
    model = with_calibrated_capture(model, record)  # a local model: the calibrated rule
    agent = record is not None and record.agent is not None
    chains = {}
    if not agent:
        chains = {
            kind: load_guard_chain(artifact, guard_config, model=model, kind=kind)[:2]
            for kind in sorted({it.kind for it in items})
        }
    items, stored_cal = _select(artifact, items, split, limit)
    with tempfile.TemporaryDirectory(prefix="abstain-guard-live-") as scratch:
        where = Path(out) / "cache" if out is not None else Path(scratch)
        run = _LiveRun(
            artifact=artifact,
            artifact_path=artifact_path,
            cfg=cfg,
            model=model,
            guard_config=guard_config,
            items=items,
            stored_cal=stored_cal,
            split=split,
            cache=(
                EvaluateCache(Path(cache_dir))
                if cache_dir is not None
                else evaluate_cache(where, artifact, artifact_path, reuse=reuse_calibration_cache)
            ),
            judges=judges,
            out=out,
            progress=progress,
            concurrency=concurrency,
        )
        if agent:
            assert record is not None
            return _live_agent(run, record)
        return _run_live(run, chains)


@dataclass(frozen=True)
class _LiveRun:
    """One live check: the artifact (and where it was loaded from), its calibration config,
    the model as deployed, the guard config, the items of the split with the stored
    calibration scores by id, the cache of answers and verdicts (``cache_dir`` alone, else
    ``<out>/cache`` or a scratch folder over the calibration cache, read-only), the judges,
    where ``live.json`` goes, the progress switch and the calls in flight at once."""

    artifact: Any
    artifact_path: str | Path
    cfg: CalibrationConfig
    model: Any
    guard_config: Any
    items: list[Any]
    stored_cal: dict[str, float]
    split: str
    cache: EvaluateCache
    judges: dict[str, Any] | None
    out: str | Path | None
    progress: bool
    concurrency: int

    def result(
        self, rule: Any, summary: dict[str, Any], rows: list[dict[str, Any]], **extra: Any
    ) -> dict[str, Any]:
        """The check's result (written to ``<out>/live.json`` when ``out`` is given)."""
        result = {
            "artifact": str(self.artifact_path),
            "split": self.split,
            **extra,
            "threshold": rule.threshold,
            "mode": rule.mode,
            "target": rule.target,
            "guarantee": rule.guarantee.to_dict(),
            "summary": summary,
            "rows": rows,
        }
        if self.out is not None:
            Path(self.out).mkdir(parents=True, exist_ok=True)
            (Path(self.out) / "live.json").write_text(json.dumps(result, indent=2, default=str))
        return result


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


def _live_agent(run: _LiveRun, record: DeploymentRecord) -> dict[str, Any]:
    """:func:`live_check` for an agent artifact (:mod:`.agent_live`)."""
    from .agent_live import LiveAgent, agent_live_rows, step_summary

    live = LiveAgent(run.artifact, run.cfg, record, run.model, run.guard_config)
    rows, policy, guarded_by = agent_live_rows(
        live, run.items, run.stored_cal, run.cache, run.judges, run.progress
    )
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
    agent = record.agent.model_dump(mode="json") if record.agent else None
    return run.result(rule, summary, rows, agent=agent)


def _stored_scores(run: _LiveRun, cached: AnswerRows) -> dict[str, float]:
    """The stored score of every item: the artifact's calibration score, or for a test item
    its cached answer scored as calibration scores (an API model's from the answer's own
    metadata, a local model's replayed as deployed)."""
    scorer, test_items = (
        run.artifact.scorer,
        [it for it in run.items if it.id not in run.stored_cal],
    )
    if isinstance(run.cfg.model, ChatModelSpec):
        test_scores = score_api_answers(scorer, test_items, cached)
    else:
        replayed = replay_as_deployed(scorer.prepare(run.model), test_items, cached, run.cfg)
        test_scores = scorer.score_many(replayed)
    stored = dict(run.stored_cal)
    stored.update(zip([it.id for it in test_items], test_scores.tolist(), strict=True))
    return stored


def _run_live(run: _LiveRun, chains: Mapping[Any, Any]) -> dict[str, Any]:
    """:func:`live_check` for a chain artifact: the cached answers and their stored scores,
    the guarded answers, one row a question, judged."""
    store = run.cache.run_store()
    fingerprint = str(getattr(run.model, "fingerprint", "unknown"))
    if isinstance(run.cfg.model, ChatModelSpec):  # as calibration keyed its answers
        fingerprint = chat_model_fingerprint(run.model)
    cached = generate_answers(
        run.model,
        run.items,
        store,
        run.cfg,
        fingerprint=fingerprint,
        options=GenerationOptions(batch_size=1, progress=False),
    )
    stored = _stored_scores(run, cached)
    guard = next(iter(chains.values()))[1]
    threshold = guard.threshold
    live_answers: dict[str, dict[str, Any]] = {}
    rows = []
    messages = _ask_live(chains, run.items, run.concurrency, run.progress)
    for it, msg in zip(run.items, messages, strict=True):
        info = decision_of(msg)
        assert info is not None
        meta = _generated(msg)
        withheld = msg.response_metadata.get("withheld_response") or {}
        live_answers[it.id] = {"text": str(withheld.get("content", msg.content))}
        rows.append(
            {
                "id": it.id,
                "split": "calibration" if it.id in run.stored_cal else "test",
                "question": it.question,
                "answer": live_answers[it.id]["text"],
                "live_score": info.score,
                "stored_score": stored[it.id],
                "stored_answers": bool(stored[it.id] <= threshold),
                "abstained": info.abstained,
                "same_tokens": _same_answer(meta, live_answers[it.id]["text"], cached[it.id]),
            }
        )
    judges = run.judges
    if judges is None:
        judges = build_judges(
            run.cfg, run.cache.directory / "judgments.sqlite", read_from=run.cache.judgments
        )
    verdicts = judge_answers(judges, run.items, live_answers, progress=False)
    run.cache.log_reuse(store, judges)
    for row in rows:
        row["correct"] = verdicts[row["id"]].correct
    rule = guard.decision_rule
    summary = {
        **summarize_live(rows, rule.guarantee),
        **in_distribution(run.artifact.scorer, rows),
        "kernels": kernel_summary(
            _recorded_kernels(run.artifact),
            _model_kernels(run.model),
            rows,
            run.artifact.scores,
            threshold,
        ),
    }
    return run.result(rule, summary, rows)


def _same_answer(live: Mapping[str, Any], text: str, cached: Mapping[str, Any]) -> bool:
    """Whether the live answer is the cached one: the same token ids, or the same text where
    neither records token ids (a text-only API model)."""
    live_ids = list(live.get("token_ids") or [])
    cached_ids = list((cached.get("metadata") or {}).get("token_ids") or [])
    if live_ids or cached_ids:
        return live_ids == cached_ids
    return text == str(cached.get("text", ""))


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
