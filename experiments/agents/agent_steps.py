"""Guarding an agent's actions: the unguarded agent, the final-answer guard and the step
guard on the same held-out runs of a real three-tool agent on the embedded model.

The agent is ``examples/lookup_agent.py`` (country, US-state and city lookups; the first
model call must call a tool, so the model picks the tool and its arguments), calibrated with
``abstain-guard calibrate --agent`` on the built-in lookup questions, which carry their
expected calls (``calibrate`` resumes from its cache). Then, on the held-out runs
(calibration + test splits, as calibration ran them: the deployed model, unguarded, every
model call's metadata kept), two folds — τ from one half, counts on the other, and the
other way round, so every held-out run is counted once out of sample:

* unguarded: every tool call runs, every final answer is delivered;
* final-answer guard: τ from the final answers' scores and the answers' labels (what
  ``agent_gating: final_answer`` calibrates); every tool call runs;
* step guard: τ from the runs' running-maximum statistic and the run labels (a wrong tool
  call or no final answer makes a run wrong); a run stops before the tool calls of its first
  call over τ.

Both guards use the same ε: the smallest risk target both certify at δ = 0.1 on each fold
(the larger of the two).

Actions (:mod:`abstain_guard.guarantee.action_risk`): the step guard's executed wrong tool calls are
split into those of the runs it let through and those of the runs it stopped (which ran
before the stop); ``certified_action_risk`` gives, on each fold, the smallest ε_a certified
at δ for the step guard's τ (P(a run executes a wrong tool call) ≤ ε_a, every run counted,
stopped ones included; each ε_a of the grid 0.01..0.99 at δ/99, so reading the smallest off
the fold keeps δ) and the realised action risk on the other fold. ``joint_guard``: the step
guard with ``action_risk_target`` = each of :data:`ACTION_RISK_TARGETS` (fixed before the
run) beside the smallest run-level ε it certifies with it on each fold: τ passes both tests,
each at δ/2. ``live_equals_stored``: the deployed, guarded agent
(``AbstentionMiddleware``) re-run on a few test questions gives the stored step scores
bit for bit (``evaluate --live``).

Usage::

    python experiments/agents/agent_steps.py [--out runs/lookup_agent] [--config ...] [--live 12]

Prints one JSON line (keys in the module's ``main``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from abstain_guard.artifact.guard_artifact import GuardArtifact  # noqa: E402
from abstain_guard.calibration.building.agent_calibration import run_step_scores  # noqa: E402
from abstain_guard.calibration.building.answering.agents import (  # noqa: E402
    has_final_answer,
    run_agents,
    step_messages,
)
from abstain_guard.calibration.building.answering.answer_rows import means_digest  # noqa: E402
from abstain_guard.calibration.building.answering.models import load_model  # noqa: E402
from abstain_guard.calibration.building.judges.judging import build_judges, judge_answers  # noqa: E402
from abstain_guard.calibration.building.pipeline import calibrate  # noqa: E402
from abstain_guard.calibration.building.run.calibration_config import (  # noqa: E402
    CalibrationConfig,
)
from abstain_guard.calibration.building.run.store import RunStore  # noqa: E402
from abstain_guard.calibration.building.run_labels import (  # noqa: E402
    call_verdicts,
    run_judgment,
    step_labels,
)
from abstain_guard.calibration.measure.deployment_check import live_check  # noqa: E402
from abstain_guard.calibration.measure.held_out import artifact_items  # noqa: E402
from abstain_guard.calibration.measure.metrics import auroc, bootstrap_intervals  # noqa: E402
from abstain_guard.config import GuardConfig  # noqa: E402
from abstain_guard.contract.deployment import DeploymentRecord  # noqa: E402
from abstain_guard.guarantee.action_risk import action_statistic, certified_action_risk  # noqa: E402
from abstain_guard.guarantee.agent_steps import run_statistic, stopping_step  # noqa: E402
from abstain_guard.guarantee.decision import decision_rule  # noqa: E402
from abstain_guard.guarantee.frontier import smallest_certifiable_risk  # noqa: E402

DATA = "builtin-lookup"
FACTORY = "examples.lookup_agent:build_agent"
CONFIG = ROOT / "examples" / "lookup_agent.yaml"
DELTA = 0.1
ACTION_RISK_TARGETS = (0.1, 0.2, 0.3)
"""The ε_a of the joint guards, fixed before the run (each a certificate of its own)."""


def held_out_runs(out: Path, model: Any) -> tuple[GuardArtifact, list[dict[str, Any]]]:
    """Per held-out run: its step scores, final score, labels and per-call verdicts."""
    artifact = GuardArtifact.load(out)
    cfg = CalibrationConfig(**artifact.metadata["config"])
    record = DeploymentRecord.from_metadata(artifact.metadata)
    assert record is not None and record.agent is not None
    _, items, _ = artifact_items(artifact)
    cache = Path(artifact.metadata["cache_dir"])
    prepared = artifact.scorer.prepare(model)
    reference = getattr(prepared, "reference", None)
    rows = run_agents(
        None,
        items,
        RunStore(cache / "run.sqlite"),
        key_parts=[
            str(model.fingerprint),
            record.agent.factory,
            "as deployed",
            getattr(artifact.scorer, "capture", None),
            None if reference is None else means_digest(reference),
        ],
        step_limit=record.agent.step_limit,
        progress=False,
    )
    judges = build_judges(cfg, cache / "judgments.sqlite")
    answered = [it for it in items if has_final_answer(rows[it.id])]
    verdicts = judge_answers(judges, answered, rows, progress=False)
    cal = set(artifact.metadata["calibration_ids"])
    runs = []
    for it in items:
        row = rows[it.id]
        answer = verdicts.get(it.id)
        calls = call_verdicts(it, row, record.tools)
        run = run_judgment(answer, row, calls)
        if run.correct is None:
            continue  # the judge could not read the answer: no label (as calibration)
        steps = run_step_scores(artifact.scorer, row)
        wrong_calls = [sum(1 for ok in step if not ok) for step in calls or []]
        runs.append(
            {
                "id": it.id,
                "fold": 0 if it.id in cal else 1,
                "steps": steps,
                "final": steps[-1] if has_final_answer(row) else None,
                "final_correct": None if answer is None else answer.correct,
                "run_correct": bool(run.correct),
                "wrong_calls": wrong_calls,
                # the running maximum at its first wrong tool call (inf: none; no expected
                # calls: none can be told)
                "action": action_statistic(steps, wrong_calls) if calls else float("inf"),
                "calls": [len(m.get("tool_calls") or []) for m in step_messages(row)],
                "step_correct": step_labels(row, run, answer, calls),
            }
        )
    return artifact, runs


def ranking(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Do step scores rank wrong steps above right ones? AUROC (95 % stratified bootstrap
    interval) with the counts behind it, for tool-calling steps (right: every call equals an
    expected one), final answers, all steps, and whole runs by their running maximum."""
    kinds: dict[str, tuple[list[float], list[bool]]] = {
        "tool_call_steps": ([], []),
        "final_answer_steps": ([], []),
        "all_steps": ([], []),
        "runs": ([], []),
    }
    for r in runs:
        for t, (score, ok) in enumerate(zip(r["steps"], r["step_correct"], strict=True)):
            kind = "tool_call_steps" if r["calls"][t] else "final_answer_steps"
            for k in (kind, "all_steps"):
                kinds[k][0].append(score)
                kinds[k][1].append(ok)
        kinds["runs"][0].append(run_statistic(r["steps"]))
        kinds["runs"][1].append(r["run_correct"])
    out: dict[str, Any] = {}
    for name, (scores, labels) in kinds.items():
        right = sum(labels)
        entry: dict[str, Any] = {"right": right, "wrong": len(labels) - right}
        if 0 < right < len(labels):
            entry["auroc"] = round(auroc(scores, labels), 3)
            low, high = bootstrap_intervals(scores, labels, ("auroc",))["auroc"]
            entry["interval"] = [round(low, 3), round(high, 3)]
        out[name] = entry
    return out


def _tau(
    scores: list[float],
    correct: list[bool],
    eps: float,
    actions: list[float] | None = None,
    eps_a: float | None = None,
) -> float:
    """τ at risk target ε and δ; with ``actions`` (the runs' action statistics) also at
    action risk target ``eps_a`` (each at δ/2)."""
    if eps >= 1.0 or not scores:  # nothing certifiable: the guard abstains on everything
        return float("-inf")
    config = GuardConfig(
        mode="risk",
        risk_target=eps,
        delta=DELTA,
        on_infeasible="abstain_all",
        action_risk_target=None if actions is None else eps_a,
    )
    rule = decision_rule(
        np.asarray(scores),
        np.asarray(correct),
        config,
        action_statistic=None if actions is None else np.asarray(actions),
    )
    return rule.threshold


def _smallest_joint_epsilon(
    scores: list[float], correct: list[bool], actions: list[float], eps_a: float
) -> float:
    """The smallest run-level ε (0.01 steps) the joint rule certifies beside ``eps_a``
    (1.0: none), as ε is chosen for the other guards."""
    for k in range(1, 100):
        eps = round(0.01 * k, 2)
        if _tau(scores, correct, eps, actions, eps_a) > float("-inf"):
            return eps
    return 1.0


def _step_guard(runs: list[dict[str, Any]], tau: float) -> dict[str, int]:
    """The step guard at τ on ``runs``: runs let through and the wrong ones among them, wrong
    tool calls executed in accepted and in stopped runs, runs that executed a wrong call."""
    out = {
        "accepted": 0,
        "wrong_accepted": 0,
        "wrong_calls_accepted": 0,
        "wrong_calls_stopped": 0,
        "runs_with_wrong_call_executed": 0,
    }
    for r in runs:
        stop = stopping_step(r["steps"], tau)
        executed = sum(r["wrong_calls"] if stop is None else r["wrong_calls"][:stop])
        out["wrong_calls_accepted" if stop is None else "wrong_calls_stopped"] += executed
        out["runs_with_wrong_call_executed"] += executed > 0
        if stop is None:
            out["accepted"] += 1
            out["wrong_accepted"] += not r["run_correct"]
    return out


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The three agents on the held-out runs, two folds (module docstring)."""
    totals = {
        "wrong_calls_unguarded": 0,
        "wrong_calls_executed_final_only": 0,
        "wrong_calls_executed_step_guard": 0,
        "wrong_calls_executed_in_accepted_runs": 0,
        "wrong_calls_executed_in_stopped_runs": 0,
        "accepted_final_only": 0,
        "accepted_step_guard": 0,
        "wrong_accepted_final_only": 0,
        "wrong_accepted_step_guard": 0,
        "answered_unguarded": 0,
        "wrong_answered_unguarded": 0,
    }
    epsilons = []
    action_by_fold = []
    joint_epsilons: dict[float, list[float]] = {e: [] for e in ACTION_RISK_TARGETS}
    joint = {e: dict.fromkeys(_step_guard([], 0.0), 0) for e in ACTION_RISK_TARGETS}
    for fold in (0, 1):
        fit = [r for r in runs if r["fold"] == fold]
        out = [r for r in runs if r["fold"] != fold]
        finals = [r for r in fit if r["final"] is not None and r["final_correct"] is not None]
        final_scores = [r["final"] for r in finals]
        final_labels = [bool(r["final_correct"]) for r in finals]
        stats = [run_statistic(r["steps"]) for r in fit]
        labels = [r["run_correct"] for r in fit]
        eps_step = smallest_certifiable_risk(stats, labels, DELTA) or 1.0
        eps_final = smallest_certifiable_risk(final_scores, final_labels, DELTA) or 1.0
        eps = max(eps_step, eps_final)
        epsilons.append({"fold": fold, "step": eps_step, "final": eps_final, "used": eps})
        tau_final = _tau(final_scores, final_labels, eps)
        tau_step = _tau(stats, labels, eps)
        actions = [r["action"] for r in fit]
        held = _step_guard(out, tau_step)
        certified = certified_action_risk(actions, tau_step, DELTA)
        action_by_fold.append(
            {
                "fold": fold,
                "tau": tau_step,
                "certified": certified,
                "calibration_runs_with_wrong_call_executed": int(
                    sum(a <= tau_step for a in actions)
                ),
                "calibration_runs": len(fit),
                "realised_held_out": held["runs_with_wrong_call_executed"] / len(out),
                "held_out_runs_with_wrong_call_executed": held["runs_with_wrong_call_executed"],
                "held_out_runs": len(out),
            }
        )
        for eps_a in ACTION_RISK_TARGETS:
            eps_joint = _smallest_joint_epsilon(stats, labels, actions, eps_a)
            joint_epsilons[eps_a].append(eps_joint)
            tau_joint = _tau(stats, labels, eps_joint, actions, eps_a)
            for key, value in _step_guard(out, tau_joint).items():
                joint[eps_a][key] += value
        for r in out:
            wrong = sum(r["wrong_calls"])
            totals["wrong_calls_unguarded"] += wrong
            totals["wrong_calls_executed_final_only"] += wrong  # tool calls are not gated
            if r["final"] is not None:
                totals["answered_unguarded"] += 1
                totals["wrong_answered_unguarded"] += not r["run_correct"]
                if r["final"] <= tau_final:
                    totals["accepted_final_only"] += 1
                    totals["wrong_accepted_final_only"] += not r["run_correct"]
        totals["wrong_calls_executed_step_guard"] += (
            held["wrong_calls_accepted"] + held["wrong_calls_stopped"]
        )
        totals["wrong_calls_executed_in_accepted_runs"] += held["wrong_calls_accepted"]
        totals["wrong_calls_executed_in_stopped_runs"] += held["wrong_calls_stopped"]
        totals["accepted_step_guard"] += held["accepted"]
        totals["wrong_accepted_step_guard"] += held["wrong_accepted"]
    n = len(runs)

    def rate(wrong: int, of: int) -> float | None:
        return wrong / of if of else None

    return {
        "runs": n,
        "runs_correct": sum(r["run_correct"] for r in runs),
        "runs_with_final_answer": sum(r["final"] is not None for r in runs),
        "tool_calls": sum(sum(r["calls"]) for r in runs),
        **{k: v for k, v in totals.items() if not k.startswith("wrong_acc")},
        "run_error_answered_unguarded": rate(
            totals["wrong_answered_unguarded"], totals["answered_unguarded"]
        ),
        "run_error_accepted_final_only": rate(
            totals["wrong_accepted_final_only"], totals["accepted_final_only"]
        ),
        "run_error_accepted_step_guard": rate(
            totals["wrong_accepted_step_guard"], totals["accepted_step_guard"]
        ),
        "certified_epsilon": max(e["used"] for e in epsilons),
        "epsilon_by_fold": epsilons,
        "delta": DELTA,
        "certified_action_risk": action_by_fold,
        "realised_action_risk_within_certified": all(
            a["certified"] is not None and a["realised_held_out"] <= a["certified"]
            for a in action_by_fold
        ),
        "joint_guard": [
            {
                "action_risk_target": eps_a,
                "delta_each": DELTA / 2,
                "epsilon_by_fold": joint_epsilons[eps_a],
                "accepted": joint[eps_a]["accepted"],
                "run_error_accepted": rate(
                    joint[eps_a]["wrong_accepted"], joint[eps_a]["accepted"]
                ),
                "wrong_calls_executed_in_accepted_runs": joint[eps_a]["wrong_calls_accepted"],
                "wrong_calls_executed_in_stopped_runs": joint[eps_a]["wrong_calls_stopped"],
                "realised_action_risk": joint[eps_a]["runs_with_wrong_call_executed"] / n,
            }
            for eps_a in ACTION_RISK_TARGETS
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "lookup_agent"))
    parser.add_argument("--config", default=str(CONFIG), help="calibration config")
    parser.add_argument("--cache-dir", default=None, help="calibration cache (default beside out)")
    parser.add_argument("--live", type=int, default=12, help="test runs re-run live")
    parser.add_argument(
        "--reuse", action="store_true", help="use the artifact at --out as it is (no calibrate)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    config = CalibrationConfig.from_file(args.config, agent=FACTORY, cache_dir=args.cache_dir)
    model = load_model(config)
    t0 = time.perf_counter()
    if args.reuse and (out / "manifest.json").is_file():
        n_items = sum(GuardArtifact.load(out).metadata["split_sizes"].values())
    else:
        n_items = calibrate(DATA, out, config=config, model=model, progress=False).n_items
    calibrate_s = time.perf_counter() - t0
    artifact, runs = held_out_runs(out, model)
    result = compare(runs)
    result["auroc"] = ranking(runs)
    t0 = time.perf_counter()
    live = live_check(out, model=model, limit=args.live, split="test", progress=False)
    live_s = time.perf_counter() - t0
    ls = live["summary"]
    result.update(
        # equal up to float rounding in the scorer (1e-12), every decision the same
        live_equals_stored=(ls.get("step_abs_diff_max") or 0.0) <= 1e-12
        and ls.get("same_decision") == 1.0,
        live_same_decision=ls.get("same_decision"),
        live_runs=ls.get("n"),
        live_steps_compared=ls.get("steps_compared"),
        live_step_abs_diff_max=ls.get("step_abs_diff_max"),
        live_run_error_accepted=ls.get("run_error_accepted_live"),
        scorer=artifact.scorer.kind,
        labelling=artifact.metadata["deployment"]["agent"]["labelling"],
        seconds_per_guarded_run=round(live_s / max(1, ls.get("n") or 0), 2),
        calibration_questions=n_items,
        calibrate_seconds_this_call=round(calibrate_s, 1),
        command="python experiments/agents/agent_steps.py",
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
