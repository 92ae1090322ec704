"""What the embedded model does with a tool: accuracy without and with it, call rates.

On the same probe questions (capital / currency / continent: the relations the
``country_facts`` tool of ``examples/country_agent.py`` answers), three agents built with
``create_agent`` on the embedded SmolLM2-135M:

* ``no_tool``: the same system prompt, no tools (what the model knows);
* ``free``: ``build_agent``: the tool offered, the model chooses;
* ``forced``: ``build_forced_agent``: the first model call must call the tool
  (``tool_choice``; the call's opening is prefilled).

Per agent: accuracy of the final answers (lexical judge) with a Wilson 95 % interval and
the counts behind it, the share of runs with a parsed tool call, the share with a malformed
call, runs without a final answer (by reason), and seconds per question.

    python experiments/agents/agent_tools.py --questions 60 --max-new-tokens 48

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from scipy.stats import binomtest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from abstain_guard.calibration.building.answering.agents import agent_inputs, run_agent  # noqa: E402
from abstain_guard.calibration.building.judges import LexicalJudge  # noqa: E402
from abstain_guard.calibration.building.questions.probe import builtin_probe_set  # noqa: E402
from examples.country_agent import (  # noqa: E402
    SYSTEM_PROMPT,
    TOOL_RELATIONS,
    build_agent,
    build_forced_agent,
)


def _no_tool_agent(model: Any) -> Any:
    from langchain.agents import create_agent

    return create_agent(model, tools=[], system_prompt=SYSTEM_PROMPT)


def wilson(k: int, n: int) -> list[float] | None:
    """Wilson 95 % interval of k successes in n (scipy), None for n = 0."""
    if n == 0:
        return None
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return [round(float(ci.low), 3), round(float(ci.high), 3)]


def measure(name: str, agent: Any, items: list[Any], step_limit: int) -> dict[str, Any]:
    """Run ``agent`` on ``items``; accuracy, call rates, endings, time."""
    judge = LexicalJudge()
    right = answered = called = malformed = 0
    endings: dict[str, int] = {}
    examples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for it in items:
        run = run_agent(agent, agent_inputs(it), step_limit)
        called += run.tool_calls > 0
        malformed += run.invalid_tool_calls > 0
        if run.final is None:
            key = run.reason.split(":")[0]
            endings[key] = endings.get(key, 0) + 1
            continue
        answered += 1
        ok = bool(judge.judge(it.question, list(it.answers), str(run.final.text)).correct)
        right += ok
        if len(examples) < 4:
            examples.append(
                {
                    "question": it.question,
                    "calls": [c for m in run.messages for c in m.get("tool_calls") or []],
                    "invalid": [c for m in run.messages for c in m.get("invalid_tool_calls") or []],
                    "answer": str(run.final.text),
                    "correct": ok,
                }
            )
    seconds = time.perf_counter() - t0
    n = len(items)
    return {
        "agent": name,
        "questions": n,
        "final_answers": answered,
        "correct": right,
        "accuracy": round(right / n, 3),
        "accuracy_wilson95": wilson(right, n),
        "runs_with_tool_call": called,
        "tool_call_rate": round(called / n, 3),
        "runs_with_malformed_call": malformed,
        "malformed_call_rate": round(malformed / n, 3),
        "without_final_answer": endings,
        "seconds_per_question": round(seconds / n, 2),
        "examples": examples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--step-limit", type=int, default=8)
    parser.add_argument("--agents", default="no_tool,free,forced")
    args = parser.parse_args()

    from abstain_guard.adapters import load_default_model

    model = load_default_model(max_new_tokens=args.max_new_tokens)
    items = builtin_probe_set(relations=list(TOOL_RELATIONS))[: args.questions]
    builders = {"no_tool": _no_tool_agent, "free": build_agent, "forced": build_forced_agent}
    results = [
        measure(name, builders[name](model), items, args.step_limit)
        for name in args.agents.split(",")
    ]
    for r in results:
        print(
            f"{r['agent']:8} accuracy {r['accuracy']:.2f} {r['accuracy_wilson95']} "
            f"({r['correct']}/{r['questions']}), tool call {r['tool_call_rate']:.2f}, "
            f"malformed {r['malformed_call_rate']:.2f}, no final answer "
            f"{r['without_final_answer']}, {r['seconds_per_question']} s/q",
            file=sys.stderr,
        )
    print(json.dumps({"max_new_tokens": args.max_new_tokens, "results": results}))


if __name__ == "__main__":
    main()
