"""Judges: decide whether a generated answer is correct (the calibration labels).

Offline judges (:mod:`.lexical`, :mod:`.similarity`; their answer text analysis is
:mod:`..questions.answer_text`) need no model call;
LLM judges (:mod:`.llm`, :mod:`.paper`) ask a chat model; :mod:`.tool_calls` judges an agent
run's executed tool calls against a row's expected calls. The interface is in :mod:`.base`;
:func:`make_judge` (:mod:`.registry`) builds any of them by name; :mod:`.cache` stores
verdicts in the run cache; :mod:`.judging` judges a run's answers and turns the verdicts into
the calibration labels.

May import: ``abstain_guard.calibration.building.questions``,
``abstain_guard.calibration.building.run``, ``abstain_guard.adapters.tools``,
``abstain_guard.scorers``, ``abstain_guard.contract``, ``abstain_guard.errors``.
"""

from __future__ import annotations

from .base import Judge, JudgeInput, Judgment
from .lexical import ChoiceJudge, LexicalJudge, NumericJudge
from .llm import LLMJudge
from .paper import PaperPipelineJudge, StatementRewriter
from .registry import JUDGE_NAMES, make_judge
from .similarity import SimilarityJudge

__all__ = [
    "JUDGE_NAMES",
    "ChoiceJudge",
    "Judge",
    "JudgeInput",
    "Judgment",
    "LLMJudge",
    "LexicalJudge",
    "NumericJudge",
    "PaperPipelineJudge",
    "SimilarityJudge",
    "StatementRewriter",
    "make_judge",
]
