"""``abstain-guard demo``: the shipped default guard on held-out questions.

Leads with risk mode (what the guard is for: at most ε of answered questions wrong, with
probability 1−δ), shows participation mode on the same answers, and ends with a summary
table beside the model without the guard."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from scipy.stats import binomtest

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.errors import ArtifactNotFoundError, UncertifiableTargetError
from abstain_guard.guarantee.decision import DecisionRule
from abstain_guard.guarantee.frontier import smallest_certifiable_risk
from abstain_guard.guard.chains import load_guard_chain

from ..building.judges import LexicalJudge
from ..building.questions.probe import builtin_probe_set


def pick_questions(items: list[Any], ids: list[str], n: int) -> list[Any]:
    """``n`` held-out items, round-robin over question types so every type shows up."""
    wanted = set(ids)
    by_group: dict[str, list[Any]] = {}
    for it in items:
        if it.id in wanted:
            by_group.setdefault(it.group or "", []).append(it)
    picked: list[Any] = []
    queues = [list(v) for _, v in sorted(by_group.items())]
    while len(picked) < n and any(queues):
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return picked


RISK_TARGET = 0.35
"""ε of the demo's risk mode: the target the shipped guard is calibrated for
(``configs/default_guard_risk.yaml``), certified with about a quarter of questions answered."""

RISK_DELTA = 0.1
"""δ of the demo's risk mode."""


def risk_config(artifact: GuardArtifact, risk_target: float, delta: float) -> GuardConfig:
    """Risk mode at ``risk_target`` when the artifact certifies it at ``delta``; otherwise at
    the smallest target it does certify (abstain on everything when it certifies none)."""
    wanted = GuardConfig(mode="risk", risk_target=risk_target, delta=delta)
    if conformal_feasible(artifact, wanted):
        return wanted
    level = delta / artifact.n_candidates  # δ/K after a scorer selection
    smallest = smallest_certifiable_risk(artifact.scores, artifact.correct, level)
    if smallest is None:
        return GuardConfig(mode="risk", risk_target=0.99, delta=delta, on_infeasible="abstain_all")
    print(
        f"note: this artifact does not certify risk_target={risk_target:g} at delta={delta:g}; "
        f"the demo uses the smallest target it certifies, {smallest:g}"
    )
    return GuardConfig(mode="risk", risk_target=smallest, delta=delta)


def conformal_feasible(artifact: GuardArtifact, config: GuardConfig) -> bool:
    """Whether the artifact's calibration set certifies ``config``'s risk target."""
    try:
        artifact.decision_rule(config)
    except UncertifiableTargetError:
        return False
    return True


DEMO_QUESTIONS = 96
"""Held-out questions the demo asks by default: enough that risk mode answers about two dozen
(its error gets an interval narrower than ±0.2), few enough for about a minute on two cores."""

LISTED = 8
"""Questions listed one by one on the terminal (every one is in the report)."""


def error_interval(wrong: int, answered: int, confidence: float = 0.95) -> list[float] | None:
    """Two-sided Clopper–Pearson interval of the error rate among answered questions
    (``scipy.stats.binomtest``, exact); None when nothing was answered."""
    if answered <= 0:
        return None
    ci = binomtest(int(wrong), int(answered)).proportion_ci(confidence, method="exact")
    return [float(ci.low), float(ci.high)]


def _mode_summary(rows: list[dict[str, Any]], abstained_key: str) -> dict[str, Any]:
    """Answered count, right answers among them, the realized error among answered and its
    exact 95 % interval."""
    answered = [r for r in rows if not r[abstained_key]]
    right = sum(bool(r["correct"]) for r in answered)
    return {
        "answered": len(answered),
        "correct_when_answered": right,
        "error_when_answered": (1.0 - right / len(answered)) if answered else None,
        "error_interval": error_interval(len(answered) - right, len(answered)),
    }


def _target_text(rule: DecisionRule) -> str:
    """The target of a rule in words: ``error ≤ 0.35 (δ 0.1)`` / ``answer 80 %``."""
    if rule.mode == "risk":
        delta = rule.guarantee.delta
        return f"error ≤ {rule.target:g}" + (f" (δ {delta:g})" if delta is not None else "")
    band = rule.guarantee.participation_interval
    if band is not None:
        return f"answer {100 * band[0]:.1f}–{100 * band[1]:.1f} %"
    return f"answer {100 * rule.target:.0f} %"


def _error_text(wrong: int, n: int, interval: list[float] | None) -> str:
    """``11/42 0.26 [0.14, 0.42]``: wrong among answered, the rate and its 95 % interval."""
    if n <= 0 or interval is None:
        return "n/a"
    return f"{wrong}/{n} {wrong / n:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"


def summary_table(summary: dict[str, Any]) -> list[str]:
    """The closing table: risk mode, participation mode, and the model without the guard
    (mode, answered, wrong among answered with the error's exact 95 % interval, target)."""
    asked = summary["asked"]
    width = len(str(asked))
    lines = [
        f"{'mode':<15} {'answered':>{2 * width + 1}}  {'wrong among answered [95 % CI]':<31} target"
    ]
    for mode in ("risk", "participation"):
        m = summary[mode]
        n = m["answered"]
        wrong = _error_text(n - m["correct_when_answered"], n, m.get("error_interval"))
        lines.append(f"{mode:<15} {n:>{width}}/{asked:<{width}}  {wrong:<31} {m['target']}")
    wrong_all = asked - summary["correct_overall"]
    bare = _error_text(wrong_all, asked, error_interval(wrong_all, asked))
    lines.append(f"{'without guard':<15} {asked:>{width}}/{asked:<{width}}  {bare:<31} —")
    return lines


def run_demo(
    artifact: Path,
    out: Path,
    n_questions: int = DEMO_QUESTIONS,
    guard_config: GuardConfig | None = None,
    risk_target: float = RISK_TARGET,
    delta: float = RISK_DELTA,
) -> int:
    """Ask held-out probe questions through the default guard in risk mode (the guard's
    purpose: at most ``risk_target`` of answered questions wrong), show participation mode
    on the same answers, print and write a report (only under ``out``).

    ``guard_config``: the participation-mode config (default :class:`GuardConfig`). Every
    number printed is computed here; none is typed in.
    """
    if not (artifact / "manifest.json").exists():
        raise ArtifactNotFoundError(
            f"No guard artifact at {artifact}. Build the default one with `make default-guard` "
            "or calibrate your own: abstain-guard calibrate --data builtin --out guard/"
        )
    t0 = time.perf_counter()
    art = GuardArtifact.load(artifact)
    risk_cfg = risk_config(art, risk_target, delta)
    chain, _, art = load_guard_chain(artifact, risk_cfg)
    print(f"loaded model and guard in {time.perf_counter() - t0:.1f}s")
    part_rule = art.decision_rule(guard_config or GuardConfig())
    items = pick_questions(builtin_probe_set(), list(art.metadata.get("test_ids", [])), n_questions)
    t1 = time.perf_counter()
    messages = chain.batch([{"question": it.question} for it in items])
    rows = [_demo_row(it, msg, part_rule) for it, msg in zip(items, messages, strict=True)]
    seconds = time.perf_counter() - t1
    risk_info = messages[0].response_metadata["abstention"] if messages else {}
    risk_rule = art.decision_rule(risk_cfg)
    _print_rows(rows, risk_rule, part_rule, risk_cfg.delta, out)
    summary: dict[str, Any] = {
        "asked": len(rows),
        "risk": {
            **_mode_summary(rows, "risk_abstained"),
            "risk_target": risk_rule.target,
            "delta": risk_cfg.delta,
            "target": _target_text(risk_rule),
        },
        "participation": {
            **_mode_summary(rows, "abstained"),
            "participation_target": part_rule.target,
            "target": _target_text(part_rule),
        },
        "correct_overall": sum(bool(r["correct"]) for r in rows),
        "seconds_per_question": seconds / max(1, len(rows)),
    }
    print()
    for line in summary_table(summary):
        print(line)
    risk = summary["risk"]
    print(f"\n{len(rows)} questions in {seconds:.1f}s. {_risk_reading(risk)}")
    write_demo_report(out, rows, summary, risk_info, art.metadata)
    print(f"report: {out / 'report.md'}")
    return 0


def _demo_row(item: Any, msg: Any, part_rule: Any) -> dict[str, Any]:
    """One question's row: the guarded answer judged, the risk guard's decision and the
    participation rule's on the same score."""
    info = msg.response_metadata["abstention"]
    withheld = msg.response_metadata.get("withheld_response") or {}
    answer = str(withheld.get("content", "")) if info["abstained"] else str(msg.content)
    verdict = LexicalJudge().judge(item.question, list(item.answers), answer or "")
    score = float(info["score"]) if info["score"] is not None else None
    return {
        "question": item.question,
        "type": item.group,
        "answer": answer,
        "gold": list(item.answers)[:3],
        "correct": verdict.correct,
        "risk_abstained": bool(info["abstained"]),
        "abstained": score is None or not part_rule.answers(score),
        "score": score,
        "risk_threshold": float(info["threshold"]),
        "threshold": part_rule.threshold,
        "returned": str(msg.content),
    }


def _print_rows(
    rows: list[dict[str, Any]], risk_rule: Any, part_rule: Any, delta: float, out: Path
) -> None:
    """Print both rules with their guarantees and the first :data:`LISTED` rows."""
    print(
        f"\nrisk mode: risk_target={risk_rule.target:g} delta={delta:g} "
        f"threshold={risk_rule.threshold:.4g}"
    )
    print(f"guarantee: {risk_rule.guarantee.statement}")
    print(
        f"participation mode (same answers): target={part_rule.target:g} "
        f"threshold={part_rule.threshold:.4g}"
    )
    print(f"guarantee: {part_rule.guarantee.statement}\n")
    print("risk    | particip. | score  judged  question")
    for row in rows[:LISTED]:
        risk = "ABSTAIN" if row["risk_abstained"] else "ANSWER "
        part = "ABSTAIN" if row["abstained"] else "ANSWER "
        truth = {True: "right", False: "wrong", None: "?"}[row["correct"]]
        shown = "  n/a" if row["score"] is None else f"{row['score']:.3f}"
        print(f"{risk} | {part}   | {shown}  [{truth:5}] {row['question']}")
        print(f"        model said: {row['answer']!r}   returned: {row['returned']!r}")
    if len(rows) > LISTED:
        print(f"... {len(rows) - LISTED} more questions in {out / 'report.md'}")


def _risk_reading(risk: dict[str, Any]) -> str:
    """What the risk row says about the certificate: the certificate is over calibration
    draws, so a sample's error is read with its interval, not against ε alone."""
    interval = risk.get("error_interval")
    if interval is None:
        return "Risk mode answered nothing here: no error to read."
    eps = risk["risk_target"]
    where = (
        "covers"
        if interval[0] <= eps <= interval[1]
        else ("lies below" if interval[1] < eps else "lies above")
    )
    return (
        f"Risk mode's error among answered, {risk['error_when_answered']:.2f}, has the exact "
        f"95 % interval [{interval[0]:.2f}, {interval[1]:.2f}], which {where} ε = {eps:g}; "
        "the certificate holds over calibration draws (docs/guarantees.md), not on every sample."
    )


def write_demo_report(
    out: Path,
    rows: list[dict[str, Any]],
    summary: dict[str, Any],
    guard_info: dict[str, Any],
    metadata: dict[str, Any],
) -> None:
    """``results.json`` and ``report.md`` for the demo run."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "summary": summary,
        "guard": guard_info,
        "rows": rows,
        "calibration": {k: metadata.get(k) for k in ("split_sizes", "accuracy", "judge")},
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    lines = [
        "# abstain-guard demo",
        "",
        f"Scorer `{guard_info.get('scorer')}` on {summary['asked']} held-out questions: risk "
        "mode (the guard deployed), and participation mode on the same answers.",
        "",
        "```",
        *summary_table(summary),
        "```",
        "",
        "| risk mode | participation mode | score | judged | question | model answer |",
        "|---|---|---:|---|---|---|",
    ]
    for r in rows:
        decision = "abstain" if r["abstained"] else "answer"
        risk_decision = "abstain" if r["risk_abstained"] else "answer"
        truth = {True: "right", False: "wrong", None: "?"}[r["correct"]]
        shown = "n/a" if r["score"] is None else f"{r['score']:.3f}"
        lines.append(
            f"| {risk_decision} | {decision} | {shown} | {truth} | {r['question']} "
            f"| {r['answer']} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
