"""``evaluate --live`` rows for an agent artifact calibrated with step gating.

The deployed agent runs guarded (:class:`~abstain_guard.guard.middleware.AbstentionMiddleware`
decides on every model call, stopping the run before the tool calls of the first call whose
running maximum crosses τ). Per run the row records each executed call's live step score
beside the stored one (the same agent's cached run as calibration ran it), where the run
stopped, the tool calls that ran and how many of them were wrong (rows with expected
calls), and the run's verdict (:mod:`~..building.run_labels`). The summary adds the
per-step live = stored check and the realized run error among accepted runs against ε.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from abstain_guard.guarantee.agent_steps import run_statistic
from abstain_guard.guarantee.certificate import Certificate

from ..building.agent_calibration import run_step_scores
from ..building.answering.agents import AgentRun, run_row, step_messages
from ..building.judges.base import Judgment
from ..building.run_labels import call_verdicts, run_judgment


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
