"""The LLM judge and the paper's two-stage pipeline with the real embedded model as the judge
(the other judge tests use scripted chat models). The verdicts of a 135M model are not
checked for accuracy: the real path must run, parse its replies (or say it could not), and
keep stable identities."""

from __future__ import annotations

from typing import Any

import pytest

from abstain_guard.calibration.building.judges import (
    Judgment,
    LLMJudge,
    PaperPipelineJudge,
    SimilarityJudge,
    StatementRewriter,
)

pytestmark = [pytest.mark.model, pytest.mark.slow]

ITEMS = [
    ("What is the capital of France?", ["Paris"], "Paris"),
    ("What is the capital of France?", ["Paris"], "Lyon"),
    ("What is the chemical symbol of gold?", ["Au"], "Its symbol is Au."),
    ("On which continent is Kenya?", ["Africa"], "I don't know."),  # decided without the model
]


@pytest.fixture(scope="module")
def judge_model(default_model: Any) -> Any:
    """The session's embedded model as a judge: same weights, no geometry capture, 16 new
    tokens (a verdict word comes first: "The proposed answer is correct.")."""
    model = default_model.model_copy(update={"capture_geometry": False, "max_new_tokens": 16})
    assert model.hf_model is default_model.hf_model  # no second copy of the weights
    return model


def _check(judgment: Judgment) -> None:
    """A parsed verdict or an explicit no-verdict, never anything else."""
    assert judgment.correct in (True, False, None)
    if judgment.correct is None:
        assert judgment.score is None and judgment.rationale
    else:
        assert judgment.score is not None


def test_llm_judge_with_the_embedded_model(judge_model: Any) -> None:
    judge = LLMJudge(judge_model, retries=1)
    out = judge.judge_many(ITEMS, max_concurrency=1, progress=False)
    assert len(out) == len(ITEMS)
    for j in out:
        _check(j)
        if j.correct is None:
            assert "no judgment" in j.rationale
        else:
            assert j.score == float(j.correct)
    assert any(j.correct is not None for j in out[:3]), [j.rationale for j in out]
    assert out[3].refusal and out[3].correct is False
    # identities: stable across instances, tied to the model's generation settings
    assert LLMJudge(judge_model, retries=1).identity == judge.identity
    assert "SmolLM2" in judge.identity and f"version={LLMJudge.version}" in judge.identity
    shorter = judge_model.model_copy(update={"max_new_tokens": 8})
    assert LLMJudge(shorter).identity != judge.identity


def test_paper_pipeline_with_the_embedded_model(judge_model: Any) -> None:
    def build() -> PaperPipelineJudge:
        stage2 = [LLMJudge(judge_model, retries=1), LLMJudge(judge_model, retries=1)]
        return PaperPipelineJudge(SimilarityJudge(), stage2)

    paper = build()
    out = paper.judge_many(ITEMS, max_concurrency=2, progress=False)
    assert len(out) == len(ITEMS)
    for j in out[:3]:
        _check(j)
        assert "stage 1" in j.rationale
    assert out[3].refusal and out[3].correct is False
    assert out[0].correct is True and "stage 1 accepted" in out[0].rationale  # identical texts
    assert build().identity == paper.identity
    assert "similarity(model='all-MiniLM-L6-v2'" in paper.identity


def test_statement_rewriter_with_the_embedded_model(judge_model: Any) -> None:
    rewriter = StatementRewriter(judge_model, retries=1)
    statement = rewriter.rewrite("What is the capital of France?", "Paris")
    assert statement is None or (statement.strip() and "\n" not in statement)
    assert StatementRewriter(judge_model).identity == rewriter.identity
