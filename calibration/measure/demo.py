"""``abstain-guard demo``: the shipped default guard on held-out questions."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from abstain_guard.calibration.build.judges import LexicalJudge
from abstain_guard.calibration.build.probe import builtin_probe_set
from abstain_guard.chains import load_guard_chain
from abstain_guard.errors import ArtifactNotFoundError


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


def run_demo(artifact: Path, out: Path, n_questions: int = 12) -> int:
    """Ask held-out probe questions through the default guard, print and write a report."""
    if not (artifact / "manifest.json").exists():
        raise ArtifactNotFoundError(
            f"No guard artifact at {artifact}. Build the default one with `make default-guard` "
            "or calibrate your own: abstain-guard calibrate --data builtin --out guard/"
        )
    t0 = time.perf_counter()
    chain, _, art = load_guard_chain(artifact)
    print(f"loaded model and guard in {time.perf_counter() - t0:.1f}s")
    items = pick_questions(builtin_probe_set(), list(art.metadata.get("test_ids", [])), n_questions)
    judge = LexicalJudge()
    rows = []
    t1 = time.perf_counter()
    messages = chain.batch([{"question": it.question} for it in items])
    for it, msg in zip(items, messages, strict=True):
        info = msg.response_metadata["abstention"]
        withheld = msg.response_metadata.get("withheld_response") or {}
        answer = str(withheld.get("content", "")) if info["abstained"] else str(msg.content)
        verdict = judge.judge(it.question, list(it.answers), answer or "")
        rows.append(
            {
                "question": it.question,
                "type": it.group,
                "answer": answer,
                "gold": list(it.answers)[:3],
                "correct": verdict.correct,
                "abstained": bool(info["abstained"]),
                "score": float(info["score"]) if info["score"] is not None else None,
                "threshold": float(info["threshold"]),
                "returned": str(msg.content),
            }
        )
    seconds = time.perf_counter() - t1
    info0 = messages[0].response_metadata["abstention"] if messages else {}
    print(
        f"\nguard: scorer={info0.get('scorer')} mode={info0.get('mode')} "
        f"target={info0.get('target')} threshold={info0.get('threshold', float('nan')):.4g}"
    )
    print(f"guarantee: {json.dumps(info0.get('guarantee', {}))}\n")
    for row in rows:
        mark = "ABSTAIN" if row["abstained"] else "ANSWER "
        truth = {True: "right", False: "wrong", None: "?"}[row["correct"]]
        print(f"{mark} score={row['score']:.3f}  [{truth:5}] {row['question']}")
        print(f"        model said: {row['answer']!r}   returned: {row['returned']!r}")
    answered = [r for r in rows if not r["abstained"]]
    summary = {
        "asked": len(rows),
        "answered": len(answered),
        "abstained": len(rows) - len(answered),
        "correct_when_answered": sum(bool(r["correct"]) for r in answered),
        "correct_overall": sum(bool(r["correct"]) for r in rows),
        "seconds_per_question": seconds / max(1, len(rows)),
    }
    print(
        f"\nanswered {summary['answered']}/{summary['asked']} "
        f"({summary['correct_when_answered']} of them right); abstained on "
        f"{summary['abstained']}; without the guard {summary['correct_overall']}/"
        f"{summary['asked']} would be right."
    )
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
    lines = [
        "# abstain-guard demo",
        "",
        f"Scorer `{guard_info.get('scorer')}`, mode `{guard_info.get('mode')}`, target "
        f"{guard_info.get('target')}, threshold {guard_info.get('threshold')}.",
        "",
        f"Answered {summary['answered']} of {summary['asked']} held-out questions "
        f"({summary['correct_when_answered']} right); abstained on {summary['abstained']}.",
        "",
        "| decision | score | judged | question | model answer |",
        "|---|---:|---|---|---|",
    ]
    for r in rows:
        decision = "abstain" if r["abstained"] else "answer"
        truth = {True: "right", False: "wrong", None: "?"}[r["correct"]]
        lines.append(
            f"| {decision} | {r['score']:.3f} | {truth} | {r['question']} | {r['answer']} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
