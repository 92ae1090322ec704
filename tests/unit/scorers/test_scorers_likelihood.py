"""Likelihood scorers: definitions (lm-polygraph / paper Eq. 1), errors, state round-trip."""

from __future__ import annotations

import math

import numpy as np
import pytest
from langchain_core.messages import AIMessage

from abstain_guard.errors import ScoringError
from abstain_guard.scorers import (
    MaxSequenceProbabilityScorer,
    MeanTokenEntropyScorer,
    PerplexityScorer,
    scorer_class,
    scorer_from_state,
)


def _message(logprobs: list[float], **extra: object) -> AIMessage:
    content = [
        {"token": f"t{i}", "logprob": lp, "top_logprobs": [{"token": f"t{i}", "logprob": lp}]}
        for i, lp in enumerate(logprobs)
    ]
    return AIMessage(content="x", response_metadata={"logprobs": {"content": content}, **extra})


LPS = [-0.1, -2.0, -0.5, -0.0]  # the last one: a generated EOS with probability 1


def test_perplexity_is_paper_eq1() -> None:
    expected = math.exp(-np.mean(LPS))
    assert PerplexityScorer().score(_message(LPS)) == pytest.approx(expected)
    # a metadata mapping works as well as a message
    assert PerplexityScorer().score(_message(LPS).response_metadata) == pytest.approx(expected)


def test_max_sequence_probability() -> None:
    assert MaxSequenceProbabilityScorer().score(_message(LPS)) == pytest.approx(2.6)
    assert MaxSequenceProbabilityScorer().score(_message([0.0])) == 0.0


def test_higher_means_more_uncertain() -> None:
    confident, unsure = _message([-0.01, -0.02]), _message([-1.5, -2.5])
    for scorer in (PerplexityScorer(), MaxSequenceProbabilityScorer()):
        assert scorer.score(confident) < scorer.score(unsure)
    scores = PerplexityScorer().score_many([confident, unsure])
    assert scores.shape == (2,) and scores[0] < scores[1]


def test_mean_token_entropy_reads_entropy_list() -> None:
    msg = _message(LPS, entropy=[0.5, 1.5, 1.0, 0.0])
    assert MeanTokenEntropyScorer().score(msg) == pytest.approx(0.75)


def test_mean_token_entropy_top_logprobs_fallback_is_opt_in() -> None:
    top = [{"token": "a", "logprob": math.log(0.5)}, {"token": "b", "logprob": math.log(0.25)}]
    meta = {
        "logprobs": {"content": [{"token": "a", "logprob": math.log(0.5), "top_logprobs": top}]}
    }
    with pytest.raises(ScoringError, match="entropy"):
        MeanTokenEntropyScorer().score(meta)
    # renormalised (2/3, 1/3)
    p = np.array([2 / 3, 1 / 3])
    expected = float(-(p * np.log(p)).sum())
    scorer = MeanTokenEntropyScorer(top_logprobs_fallback=True)
    assert scorer.score(meta) == pytest.approx(expected)
    rebuilt = scorer_from_state(scorer.get_state())
    assert rebuilt == scorer


@pytest.mark.parametrize(
    "meta",
    [
        {},
        {"logprobs": None},
        {"logprobs": {"content": []}},
        {"logprobs": {"content": "abc"}},
        {"logprobs": {"content": [{"token": "a"}]}},
        {"logprobs": {"content": [{"token": "a", "logprob": float("nan")}]}},
        {"logprobs": {"content": [{"token": "a", "logprob": float("-inf")}]}},
        {"logprobs": {"content": [{"token": "a", "logprob": 0.7}]}},
    ],
)
def test_missing_or_bad_logprobs_raise(meta: dict) -> None:
    for scorer in (PerplexityScorer(), MaxSequenceProbabilityScorer()):
        with pytest.raises(ScoringError):
            scorer.score(AIMessage(content="x", response_metadata=meta))


@pytest.mark.parametrize("entropy", [[], [float("nan")], [-1.0], "abc"])
def test_bad_entropy_raises(entropy: object) -> None:
    with pytest.raises(ScoringError):
        MeanTokenEntropyScorer().score({"entropy": entropy})


def test_not_a_message_raises_scoring_error() -> None:
    with pytest.raises(ScoringError):
        PerplexityScorer().score("just a string")


@pytest.mark.parametrize(
    "cls", [PerplexityScorer, MaxSequenceProbabilityScorer, MeanTokenEntropyScorer]
)
def test_registry_and_state_round_trip(cls: type) -> None:
    scorer = cls()
    assert scorer_class(scorer.kind) is cls
    state = scorer.get_state()
    assert state.kind == scorer.kind and not state.arrays and not state.files
    assert scorer_from_state(state) == scorer
