"""``abstain-guard demo``: the shipped default guard on held-out questions."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from abstain_guard.artifact import GuardArtifact
from abstain_guard.calibration.build.judges import LexicalJudge
from abstain_guard.calibration.build.probe import builtin_probe_set
from abstain_guard.chains import load_guard_chain
from abstain_guard.config import GuardConfig
from abstain_guard.decision import DecisionRule
from abstain_guard.errors import ArtifactNotFoundError
from abstain_guard.frontier import smallest_certifiable_risk


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


RISK_DELTA = 0.1
"""δ of the demo's risk mode."""


def _risk_rule(artifact: GuardArtifact) -> DecisionRule:
    """Risk mode at the smallest risk target the artifact certifies at :data:`RISK_DELTA`
    (abstain on everything when it certifies none)."""
    smallest = smallest_certifiable_risk(artifact.scores, artifact.correct, RISK_DELTA)
    if smallest is None:
        return artifact.decision_rule(
            GuardConfig(
                mode="risk", risk_target=0.99, delta=RISK_DELTA, on_infeasible="abstain_all"
            )
        )
    return artifact.decision_rule(GuardConfig(mode="risk", risk_target=smallest, delta=RISK_DELTA))


def _mode_summary(rows: list[dict[str, Any]], abstained_key: str) -> dict[str, Any]:
    """Answered count, right answers among them and the realized error among answered."""
    answered = [r for r in rows if not r[abstained_key]]
    right = sum(bool(r["correct"]) for r in answered)
    return {
        "answered": len(answered),
        "correct_when_answered": right,
        "error_when_answered": (1.0 - right / len(answered)) if answered else None,
    }


def run_demo(
    artifact: Path, out: Path, n_questions: int = 24, guard_config: GuardConfig | None = None
) -> int:
    """Ask held-out probe questions through the default guard, print and write a report
    (only under ``out``); ``guard_config``: the participation-mode config (default
    :class:`GuardConfig`)."""
    if not (artifact / "manifest.json").exists():
        raise ArtifactNotFoundError(
            f"No guard artifact at {artifact}. Build the default one with `make default-guard` "
            "or calibrate your own: abstain-guard calibrate --data builtin --out guard/"
        )
    t0 = time.perf_counter()
    chain, _, art = load_guard_chain(artifact, guard_config)
    print(f"loaded model and guard in {time.perf_counter() - t0:.1f}s")
    items = pick_questions(builtin_probe_set(), list(art.metadata.get("test_ids", [])), n_questions)
    judge = LexicalJudge()
    risk_rule = _risk_rule(art)
    rows = []
    t1 = time.perf_counter()
    messages = chain.batch([{"question": it.question} for it in items])
    for it, msg in zip(items, messages, strict=True):
        info = msg.response_metadata["abstention"]
        withheld = msg.response_metadata.get("withheld_response") or {}
        answer = str(withheld.get("content", "")) if info["abstained"] else str(msg.content)
        verdict = judge.judge(it.question, list(it.answers), answer or "")
        score = float(info["score"]) if info["score"] is not None else None
        rows.append(
            {
                "question": it.question,
                "type": it.group,
                "answer": answer,
                "gold": list(it.answers)[:3],
                "correct": verdict.correct,
                "abstained": bool(info["abstained"]),
                "risk_abstained": score is None or not risk_rule.answers(score),
                "score": score,
                "threshold": float(info["threshold"]),
                "returned": str(msg.content),
            }
        )
    seconds = time.perf_counter() - t1
    info0 = messages[0].response_metadata["abstention"] if messages else {}
    print(
        f"\nparticipation mode: target={info0.get('target')} "
        f"threshold={info0.get('threshold', float('nan')):.4g}"
    )
    print(f"guarantee: {info0.get('guarantee', {}).get('statement')}")
    print(
        f"risk mode: risk_target={risk_rule.target:g} (the smallest this artifact certifies at "
        f"delta={RISK_DELTA:g}) threshold={risk_rule.threshold:.4g}"
    )
    print(f"guarantee: {risk_rule.guarantee.get('statement')}\n")
    for row in rows:
        part = "ABSTAIN" if row["abstained"] else "ANSWER "
        risk = "ABSTAIN" if row["risk_abstained"] else "ANSWER "
        truth = {True: "right", False: "wrong", None: "?"}[row["correct"]]
        print(f"{part} | {risk} score={row['score']:.3f}  [{truth:5}] {row['question']}")
        print(f"        model said: {row['answer']!r}   returned: {row['returned']!r}")
    summary: dict[str, Any] = {
        "asked": len(rows),
        "participation": _mode_summary(rows, "abstained"),
        "risk": {
            **_mode_summary(rows, "risk_abstained"),
            "risk_target": risk_rule.target,
            "delta": RISK_DELTA,
        },
        "correct_overall": sum(bool(r["correct"]) for r in rows),
        "seconds_per_question": seconds / max(1, len(rows)),
    }
    for mode in ("participation", "risk"):
        m = summary[mode]
        error = "n/a" if m["error_when_answered"] is None else f"{m['error_when_answered']:.2f}"
        target = f" (target ≤ {risk_rule.target:g})" if mode == "risk" else ""
        print(
            f"{mode} mode: answered {m['answered']}/{len(rows)}, {m['correct_when_answered']} "
            f"of them right; error among answered {error}{target}"
        )
    print(f"without the guard {summary['correct_overall']}/{len(rows)} would be right.")
    write_demo_report(out, rows, summary, info0, art.metadata)
    print(f"report: {out / 'report.md'}")
    return 0


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
    part, risk = summary["participation"], summary["risk"]
    lines = [
        "# abstain-guard demo",
        "",
        f"Scorer `{guard_info.get('scorer')}` on {summary['asked']} held-out questions, in both "
        "modes:",
        "",
        f"- participation mode (target {guard_info.get('target')}): answered "
        f"{part['answered']}, {part['correct_when_answered']} right;",
        f"- risk mode (risk_target {risk['risk_target']:g}, delta {risk['delta']:g}: the "
        f"smallest target this artifact certifies): answered {risk['answered']}, "
        f"{risk['correct_when_answered']} right, error among answered "
        + ("n/a" if risk["error_when_answered"] is None else f"{risk['error_when_answered']:.2f}")
        + ".",
        "",
        "| participation mode | risk mode | score | judged | question | model answer |",
        "|---|---|---:|---|---|---|",
    ]
    for r in rows:
        decision = "abstain" if r["abstained"] else "answer"
        risk_decision = "abstain" if r["risk_abstained"] else "answer"
        truth = {True: "right", False: "wrong", None: "?"}[r["correct"]]
        lines.append(
            f"| {decision} | {risk_decision} | {r['score']:.3f} | {truth} | {r['question']} "
            f"| {r['answer']} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
