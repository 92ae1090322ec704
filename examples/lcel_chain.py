"""Wrap an LCEL chain with the shipped default guard.

    python examples/lcel_chain.py

The prompt is the one the default guard was calibrated with (``question_prompt()``): the
guarantee holds for questions asked the way the calibration questions were asked.
"""

from __future__ import annotations

from typing import Any

from langchain_core.output_parsers import StrOutputParser

from abstain_guard import AbstentionGuard, GuardConfig, default_artifact_path
from abstain_guard.contract.prompts import question_prompt

QUESTIONS = [
    "What is the capital of France?",
    "Which chemical element has the atomic number 83?",
    "What is the currency of Japan called?",
    "What is the chemical symbol of the element tungsten?",
]


def main(model: Any = None) -> list[str]:
    """Answer ``QUESTIONS`` through ``prompt | guard | parser``; return the strings."""
    if model is None:
        from abstain_guard.adapters import load_default_model

        model = load_default_model(max_new_tokens=24)  # as calibrated
    guard = AbstentionGuard.from_artifact(
        default_artifact_path(), model, config=GuardConfig(participation=0.5)
    )
    chain = question_prompt() | guard | StrOutputParser()
    answers = chain.batch([{"question": q} for q in QUESTIONS])
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"{question}\n  -> {answer}")
    return answers


if __name__ == "__main__":
    main()
