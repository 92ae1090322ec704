"""How often the lookup agent's actions and answers are right on the embedded model.

``examples/lookup_agent.py:build_agent`` (three tools, the first model call forced to call
one) on the first ``--questions`` of ``builtin-lookup`` (seed 0: relations mixed), with the
embedded SmolLM2-135M. Per run: the first AI message's call — the right tool? the right
tool *and* arguments (:func:`~abstain_guard.calibration.building.judges.tool_calls.
judge_tool_calls` against the tools' schemas)? a malformed call? — the tool label of the
whole run (every call right, every expected call made) and the final answer (lexical
judge). Counts with Wilson 95 % intervals, per relation, a few wrong calls as examples,
seconds per run.

    flock /tmp/heavy.lock python experiments/agents/lookup_agent_calls.py --questions 40

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from scipy.stats import binomtest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402

from abstain_guard.calibration.building.answering.agents import agent_inputs, run_agent  # noqa: E402
from abstain_guard.calibration.building.judges import LexicalJudge  # noqa: E402
from abstain_guard.calibration.building.judges.tool_calls import (  # noqa: E402
    judge_tool_calls,
)
from abstain_guard.calibration.building.questions.agent_questions import lookup_questions  # noqa: E402
from examples.lookup_agent import TOOLS, build_agent  # noqa: E402


def rate(k: int, n: int) -> dict[str, Any]:
    """``k/n`` with its Wilson 95 % interval."""
    if n == 0:
        return {"k": 0, "n": 0, "rate": None}
    ci = binomtest(k, n).proportion_ci(method="wilson")
    return {"k": k, "n": n, "rate": round(k / n, 3), "ci95": [round(ci.low, 3), round(ci.high, 3)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--step-limit", type=int, default=8)
    args = ap.parse_args()

    from abstain_guard.adapters import load_default_model

    model = load_default_model(max_new_tokens=args.max_new_tokens)
    agent = build_agent(model)
    schemas = [convert_to_openai_tool(t) for t in TOOLS]
    judge = LexicalJudge()
    items = lookup_questions()[: args.questions]
    counts: Counter[str] = Counter()
    by_group: dict[str, Counter[str]] = {}
    examples: list[dict[str, Any]] = []
    start = time.perf_counter()
    for item in items:
        run = run_agent(agent, agent_inputs(item), args.step_limit)
        ais = [m for m in run.messages if m["role"] == "ai"]
        first = ais[0] if ais else {}
        calls = [c for m in ais for c in m.get("tool_calls") or []]
        want = item.expected_tool_calls[0]
        g = by_group.setdefault(item.group or "", Counter())
        for c in (counts, g):
            c["runs"] += 1
        first_call = (first.get("tool_calls") or [None])[0]
        if first_call is not None:
            right_tool = first_call["name"] == want.name
            verdict = judge_tool_calls([first_call], item.expected_tool_calls, schemas=schemas)[0]
            for c in (counts, g):
                c["first_call"] += 1
                c["first_right_tool"] += right_tool
                c["first_right_call"] += verdict.correct
            if not verdict.correct and len(examples) < 8:
                examples.append({"q": item.question, "call": first_call, "why": verdict.reason})
        elif first.get("invalid_tool_calls"):
            counts["first_malformed"] += 1
            if len(examples) < 8:
                examples.append({"q": item.question, "malformed": first["invalid_tool_calls"][0]})
        verdicts = judge_tool_calls(calls, item.expected_tool_calls, schemas=schemas)
        made = {v.expected_index for v in verdicts if v.correct}
        right = all(v.correct for v in verdicts) and len(made) == len(item.expected_tool_calls)
        counts["runs_actions_right"] += right
        if run.final is not None:
            counts["final_answers"] += 1
            ok = judge.judge(item.question, item.answers, str(run.final.text)).correct
            for c in (counts, g):
                c["final_right"] += ok
        else:
            counts["no_final:" + run.reason.split(":")[0]] += 1
    seconds = time.perf_counter() - start
    n = counts["runs"]
    out = {
        "questions": n,
        "first_call_right_tool": rate(counts["first_right_tool"], n),
        "first_call_right_tool_and_args": rate(counts["first_right_call"], n),
        "first_call_malformed": rate(counts["first_malformed"], n),
        "runs_all_actions_right": rate(counts["runs_actions_right"], n),
        "final_answer_right": rate(counts["final_right"], n),
        "final_answers": counts["final_answers"],
        "without_final": {k: v for k, v in counts.items() if k.startswith("no_final:")},
        "per_relation": {
            k: {
                "runs": v["runs"],
                "right_tool": v["first_right_tool"],
                "right_call": v["first_right_call"],
                "final_right": v["final_right"],
            }
            for k, v in sorted(by_group.items())
        },
        "seconds_per_run": round(seconds / max(n, 1), 2),
        "max_new_tokens": args.max_new_tokens,
    }
    for e in examples:
        print("wrong first call:", json.dumps(e, ensure_ascii=False, default=str))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
