"""``abstain-guard evaluate --live`` for an artifact built by ``calibrate --agent``: run the
agent as deployed, guarded, on the held-out questions and compare with calibration (how the
guard goes in and what each row records: docs/agents.md, 'Deploy').
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from abstain_guard.contract.deployment import AgentRecord, DeploymentRecord
from abstain_guard.errors import ConfigError
from abstain_guard.guarantee.agent_steps import run_statistic
from abstain_guard.guarantee.certificate import Certificate
from abstain_guard.guard.policy import AbstentionPolicy

from ..building.agent_calibration import run_step_scores
from ..building.answering.agents import (
    AgentRun,
    has_final_answer,
    iter_runs,
    load_agent_factory,
    run_agents,
    run_row,
    step_messages,
)
from ..building.answering.answer_rows import means_digest
from ..building.judges.base import Judgment
from ..building.judges.judging import build_judges, judge_answers
from ..building.run.calibration_config import CalibrationConfig
from ..building.run_labels import call_verdicts, run_judgment
from .cache_reuse import EvaluateCache


def takes_middleware(factory: Any) -> bool:
    """Whether ``factory`` accepts a ``middleware`` argument (so the guard can be added)."""
    try:
        return "middleware" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _final_meta(message: Any) -> dict[str, Any]:
    meta = dict(message.response_metadata or {})
    withheld = meta.get("withheld_response")
    return dict(withheld.get("response_metadata") or {}) if withheld else meta


@dataclass(frozen=True)
class LiveAgent:
    """What the live check of an agent artifact runs: the artifact, its calibration config
    and deployment record (with its agent), the model and the guard's configuration."""

    artifact: Any
    cfg: CalibrationConfig
    record: DeploymentRecord
    model: Any
    guard_config: Any

    @property
    def agent(self) -> AgentRecord:
        """The recorded agent (the record of an agent artifact always has one)."""
        assert self.record.agent is not None
        return self.record.agent


def _unguarded_runs(live: LiveAgent, items: list[Any], store: Any) -> dict[str, Any]:
    """The unguarded agent's cached (or new) run of each item, keyed as calibration keys
    its runs."""
    prepared = live.artifact.scorer.prepare(live.model)
    reference = getattr(prepared, "reference", None)
    factory = load_agent_factory(live.agent.factory)
    return run_agents(
        factory(prepared),
        items,
        store,
        key_parts=[
            str(getattr(live.model, "fingerprint", "unknown")),
            live.agent.factory,
            "as deployed",
            getattr(live.artifact.scorer, "capture", None),  # as calibration keys its runs
            None if reference is None else means_digest(reference),
        ],
        step_limit=live.agent.step_limit,
        concurrency=live.cfg.batch_size,
        progress=False,
    )


def _judge_live(
    live: LiveAgent,
    items: list[Any],
    answers: dict[str, dict[str, Any]],
    cache: EvaluateCache,
    judges: dict[str, Any] | None,
    store: Any,
) -> dict[str, Any]:
    """The verdicts on the live final answers (cached in ``cache``), what was reused from
    the calibration cache (answers read from ``store``, verdicts) logged."""
    if judges is None:
        judges = build_judges(
            live.cfg, cache.directory / "judgments.sqlite", read_from=cache.judgments
        )
    judged = [it for it in items if it.id in answers]
    verdicts = judge_answers(judges, judged, answers, progress=False)
    cache.log_reuse(store, judges)
    return verdicts


def agent_live_rows(
    live: LiveAgent,
    items: list[Any],
    stored_cal: dict[str, float],
    cache: EvaluateCache,
    judges: dict[str, Any] | None,
    progress: bool,
) -> tuple[list[dict[str, Any]], AbstentionPolicy, str]:
    """Rows of the live check for an agent artifact (see the module docstring), the policy
    that decided, and how the guard was put in (``"middleware"`` or ``"policy"``). Cached
    runs and verdicts are read from ``cache`` (and the calibration cache below it, if any)
    and new ones written to ``cache.directory``."""
    from abstain_guard.guard.middleware import AbstentionMiddleware

    store = cache.run_store()
    unguarded = _unguarded_runs(live, items, store)
    if live.agent.gating == "steps":
        step_rows, step_policy, finals = _step_rows(live, items, stored_cal, unguarded, progress)
        judged = _judge_live(live, items, finals, cache, judges, store)
        for step_row in step_rows:
            finish_row(step_row, judged.get(step_row["id"]))
        return step_rows, step_policy, "middleware"
    scorer = live.artifact.scorer
    stored: dict[str, float | None] = dict(stored_cal)
    for it in items:
        if it.id not in stored_cal:
            row = unguarded[it.id]
            stored[it.id] = float(scorer.score(row["metadata"])) if has_final_answer(row) else None
    factory = load_agent_factory(live.agent.factory)
    if takes_middleware(factory):
        middleware = AbstentionMiddleware(live.artifact, config=live.guard_config)
        policy, guarded_by = middleware.policy, "middleware"
        agent = factory(live.model, middleware=[middleware])
    else:
        policy, guarded_by = AbstentionPolicy(live.artifact, live.guard_config), "policy"
        agent = factory(scorer.prepare(live.model))
    rows: list[dict[str, Any]] = []
    answers: dict[str, dict[str, Any]] = {}
    runs = _guarded_runs(
        agent, items, live.agent.step_limit, live.cfg.batch_size, "live agent", progress
    )
    for it in items:
        run = runs[it.id]
        final = run.final
        if final is not None and guarded_by == "policy":
            final, _ = policy.decide(final)
        if final is None:  # no final answer: nothing to gate (counted, not scored)
            rows.append(_no_answer_row(it, run.reason, stored_cal, stored))
            continue
        row = _answer_row(it, run, final, stored_cal, stored[it.id], unguarded[it.id], policy)
        answers[it.id] = {"text": row["answer"]}
        rows.append(row)
    verdicts = _judge_live(live, items, answers, cache, judges, store)
    for row in rows:
        row["correct"] = verdicts[row["id"]].correct if row["id"] in verdicts else None
    return rows, policy, guarded_by


def _answer_row(
    item: Any,
    run: AgentRun,
    final: Any,
    stored_cal: dict[str, float],
    stored: float | None,
    unguarded: dict[str, Any],
    policy: AbstentionPolicy,
) -> dict[str, Any]:
    """The row of a guarded run with a final answer: its live score and decision beside the
    stored score and the unguarded run's tokens."""
    info = final.response_metadata["abstention"]
    meta = _final_meta(final)
    withheld = final.response_metadata.get("withheld_response") or {}
    cached = unguarded.get("metadata") or {}
    return {
        "id": item.id,
        "split": "calibration" if item.id in stored_cal else "test",
        "question": item.question,
        "answer": str(withheld.get("content", final.content)),
        "live_score": info["score"],
        "stored_score": stored,
        "stored_answers": stored is not None and bool(stored <= policy.rule.threshold),
        "abstained": bool(info["abstained"]),
        "same_tokens": list(meta.get("token_ids", [])) == list(cached.get("token_ids", [])),
        "tool_steps": sum(1 for m in run.messages if m["role"] == "tool"),
        "tool_calls": run.tool_calls,
        "reason": run.reason,
    }


def _guarded_runs(
    agent: Any, items: list[Any], step_limit: int, concurrency: int, desc: str, progress: bool
) -> dict[str, AgentRun]:
    """The guarded agent's run of each item, ``concurrency`` (the config's ``batch_size``)
    in flight at once, as calibration ran the unguarded ones (:func:`iter_runs`)."""
    runs: dict[str, AgentRun] = {}
    with tqdm(total=len(items), desc=desc, disable=not progress, unit="q") as bar:
        for it, run in iter_runs(agent, items, step_limit, concurrency):
            runs[it.id] = run
            bar.update()
    return runs


def _no_answer_row(
    item: Any, reason: str, stored_cal: dict[str, float], stored: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": item.id,
        "split": "calibration" if item.id in stored_cal else "test",
        "question": item.question,
        "answer": None,
        "live_score": None,
        "stored_score": stored.get(item.id),
        "stored_answers": False,
        "abstained": True,
        "same_tokens": False,
        "tool_steps": None,
        "tool_calls": None,
        "reason": reason,
        "no_final_answer": True,
    }


def _step_rows(
    live: LiveAgent,
    items: list[Any],
    stored_cal: dict[str, float],
    unguarded: dict[str, Any],
    progress: bool,
) -> tuple[list[dict[str, Any]], AbstentionPolicy, dict[str, dict[str, Any]]]:
    """The rows of :func:`agent_live_rows` for step gating , not yet
    judged: the deployed agent with the middleware deciding on every model call. Returns the
    rows, the policy and the final answers to judge."""
    from abstain_guard.guard.middleware import AbstentionMiddleware

    factory = load_agent_factory(live.agent.factory)
    if not takes_middleware(factory):
        raise ConfigError(
            f"{live.agent.factory} takes no middleware argument, and step gating stops a "
            "run inside the agent: give the factory a `middleware` parameter passed to "
            "create_agent (examples/lookup_agent.py)"
        )
    middleware = AbstentionMiddleware(live.artifact, config=live.guard_config)
    agent = factory(live.model, middleware=[middleware])
    threshold = middleware.policy.rule.threshold
    scorer = live.artifact.scorer
    rows: list[dict[str, Any]] = []
    answers: dict[str, dict[str, Any]] = {}
    runs = _guarded_runs(
        agent, items, live.agent.step_limit, live.cfg.batch_size, "live agent (steps)", progress
    )
    for it in items:
        stored = stored_cal.get(it.id)
        if stored is None:
            stored = stored_run_statistic(scorer, unguarded[it.id])
        row = step_live_row(
            it, runs[it.id], unguarded[it.id], scorer, stored, threshold, live.record.tools
        )
        row["split"] = "calibration" if it.id in stored_cal else "test"
        if row["answer"] is not None:
            answers[it.id] = {"text": row["answer"]}
        rows.append(row)
    return rows, middleware.policy, answers


def stored_run_statistic(scorer: Any, row: Mapping[str, Any]) -> float | None:
    """The whole run's statistic of a cached (unguarded) run, None without model calls."""
    return run_statistic(run_step_scores(scorer, row)) if step_messages(row) else None


def step_live_row(
    item: Any,
    run: AgentRun,
    stored_row: Mapping[str, Any],
    scorer: Any,
    stored_statistic: float | None,
    threshold: float,
    schemas: Sequence[Mapping[str, Any]] | None,
) -> dict[str, Any]:
    """One live row (module docstring); ``correct`` is filled in after judging."""
    live = run_row(run)
    steps = step_messages(live)
    decisions = [m.get("decision") or {} for m in steps]
    stopped = next((t for t, d in enumerate(decisions) if d.get("abstained")), None)
    stored_steps = run_step_scores(scorer, stored_row) if step_messages(stored_row) else []
    live_steps = [d.get("step_score") for d in decisions]
    pairs = [(a, b) for a, b in zip(live_steps, stored_steps, strict=False) if a is not None]
    calls = call_verdicts(item, live, schemas)
    executed = [
        (t, ok)
        for t, m in enumerate(steps)
        if stopped is None or t < stopped
        for ok in (calls[t] if calls is not None else [None] * len(m.get("tool_calls") or []))
    ]
    final = stopped is None and run.final is not None and not (run.final.tool_calls or [])
    return {
        "id": item.id,
        "question": item.question,
        "answer": str(run.final.text) if final and run.final is not None else None,
        "live_score": decisions[-1].get("run_statistic") if decisions else None,
        "stored_score": stored_statistic,
        "stored_answers": stored_statistic is not None and stored_statistic <= threshold,
        "abstained": stopped is not None,
        "stopped_at_step": stopped,
        "step_scores_live": live_steps,
        "step_scores_stored": stored_steps,
        "step_abs_diff_max": max((abs(a - b) for a, b in pairs), default=None),
        "same_tokens": [m.get("metadata", {}).get("token_ids") for m in steps[: len(pairs)]]
        == [m.get("metadata", {}).get("token_ids") for m in step_messages(stored_row)][
            : len(pairs)
        ],
        "tool_steps": sum(1 for m in live["agent"]["messages"] if m["role"] == "tool"),
        "tool_calls_executed": len(executed),
        "wrong_tool_calls_executed": (
            None if calls is None else sum(1 for _, ok in executed if ok is False)
        ),
        "reason": run.reason,
        "no_final_answer": stopped is None and run.final is None,
        "_calls": calls,
        "_row": live,
    }


def finish_row(row: dict[str, Any], answer: Judgment | None) -> None:
    """Set the run's verdict (``correct``) from its final answer's judgment: a stopped run
    has none (it was not accepted); an accepted run without a final answer is wrong."""
    live, calls = row.pop("_row"), row.pop("_calls")
    row["correct"] = None if row["abstained"] else run_judgment(answer, live, calls).correct


def step_summary(rows: list[dict[str, Any]], guarantee: Certificate) -> dict[str, Any]:
    """The live summary of step-gated runs (pure)."""
    accepted = [r for r in rows if not r["abstained"]]
    judged = [r for r in accepted if r["correct"] is not None]
    diffs = [r["step_abs_diff_max"] for r in rows if r["step_abs_diff_max"] is not None]
    wrong = [r["wrong_tool_calls_executed"] for r in rows]
    return {
        "n": len(rows),
        "gating": "steps",
        "participation_live": float(np.mean([not r["abstained"] for r in rows])) if rows else None,
        "participation_stored": float(np.mean([r["stored_answers"] for r in rows]))
        if rows
        else None,
        "guaranteed_interval": guarantee.to_dict().get("participation_interval"),
        "accepted": len(accepted),
        "run_error_accepted_live": (
            1.0 - float(np.mean([r["correct"] for r in judged])) if judged else None
        ),
        "risk_target": guarantee.risk_target,
        "same_decision": float(np.mean([r["stored_answers"] != r["abstained"] for r in rows]))
        if rows
        else None,
        "step_abs_diff_max": max(diffs) if diffs else None,
        "steps_compared": sum(sum(1 for s in r["step_scores_live"] if s is not None) for r in rows),
        "same_tokens": float(np.mean([r["same_tokens"] for r in rows])) if rows else None,
        "stopped_runs": sum(1 for r in rows if r["abstained"]),
        "tool_calls_executed": sum(r["tool_calls_executed"] for r in rows),
        "wrong_tool_calls_executed": None if any(w is None for w in wrong) else int(sum(wrong)),
        "runs_without_final_answer": sum(1 for r in rows if r["no_final_answer"]),
    }
