"""Baselines: every formula on hand-computed cases, CalibratedScorer, typed errors; a few
quick checks on the real model (marked ``model``)."""

from __future__ import annotations

import io
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from abstain_guard.calibration.measure import metrics
from abstain_guard.errors import (
    ConfigError,
    InsufficientDataError,
    InvalidInputError,
    NotFittedError,
    ScoringError,
)
from abstain_guard.scorers import (
    AttentionScoreScorer,
    CalibratedScorer,
    EigenScoreScorer,
    PerplexityScorer,
    PTrueScorer,
    SampleSource,
    SARScorer,
    ScorerState,
    SemanticEntropyScorer,
    question_from_prompt,
    scorer_from_state,
)
from abstain_guard.scorers.attention_score import attention_score
from abstain_guard.scorers.eigenscore import eigenscore
from abstain_guard.scorers.sar import sar, token_sar
from abstain_guard.scorers.semantic_entropy import greedy_semantic_classes, semantic_entropy

# --- formulas --------------------------------------------------------------------------


def test_token_sar_hand_computed() -> None:
    # R = [0.5, 0.25] → weights [2/3, 1/3]; Σ −log p · w = 1·2/3 + 2·1/3 = 4/3
    assert token_sar(np.array([-1.0, -2.0]), np.array([0.5, 0.75])) == pytest.approx(4 / 3)


def test_token_sar_zero_relevance_is_uniform() -> None:
    assert token_sar(np.array([-1.0, -2.0]), np.array([1.0, 1.0])) == pytest.approx(1.5)


def test_sar_hand_computed() -> None:
    # p̃ = [1, 0.5]; off-diagonal sim 0.5; t = 1:
    # E_0 = −log(0.5·0.5 + 1) = −log 1.25, E_1 = −log(0.5·1 + 0.5) = 0
    sim = np.array([[1.0, 0.5], [0.5, 1.0]])
    assert sar(np.array([0.0, math.log(2)]), sim, t=1.0) == pytest.approx(-math.log(1.25) / 2)


def test_sar_default_temperature() -> None:
    # identical samples, p̃ = 1, sim 1: E = −log(1/0.001 + 1) for each
    ones = np.ones((3, 3))
    assert sar(np.zeros(3), ones) == pytest.approx(-math.log(2 / 1e-3 + 1))


def test_greedy_semantic_classes() -> None:
    texts = ["Paris", "paris.", "Lyon", "PARIS", "lyon"]
    same = lambda a, b: a.lower().strip(".") == b.lower().strip(".")  # noqa: E731
    assert greedy_semantic_classes(texts, same) == [0, 0, 1, 0, 1]


def test_semantic_entropy_hand_computed() -> None:
    lp = np.log([0.5, 0.25, 0.25])
    expected = -(2 * math.log(0.75) + math.log(0.25)) / 3
    assert semantic_entropy(lp, [0, 0, 1]) == pytest.approx(expected)


def test_eigenscore_hand_computed() -> None:
    # rows centred over features: [.5, −.5], [−.5, .5] → Gram [[.5, −.5], [−.5, .5]],
    # eigenvalues 0 and 1, plus α
    z = np.array([[1.0, 0.0], [0.0, 1.0]])
    a = 1e-3
    assert eigenscore(z, a) == pytest.approx((math.log(a) + math.log(1 + a)) / 2)


def test_eigenscore_matches_explicit_centering_matrix() -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(5, 7))
    j = np.eye(7) - np.ones((7, 7)) / 7
    eig = np.linalg.eigvalsh(z @ j @ z.T + 1e-3 * np.eye(5))
    assert eigenscore(z) == pytest.approx(float(np.mean(np.log(eig))))


def test_attention_score_hand_computed() -> None:
    d = np.array([[1.0, 0.5], [0.5, 0.25]])
    expected = -((math.log(1) + math.log(0.5)) + (math.log(0.5) + math.log(0.25))) / 2
    assert attention_score(d) == pytest.approx(expected, rel=1e-9)
    assert np.isfinite(attention_score(np.zeros((2, 3))))  # eps keeps log(0) finite


@pytest.mark.parametrize(
    "call",
    [
        lambda: token_sar(np.array([]), np.array([])),
        lambda: sar(np.zeros(2), np.ones((3, 3))),
        lambda: semantic_entropy(np.zeros(2), [0]),
        lambda: eigenscore(np.zeros((0, 3))),
        lambda: attention_score(np.zeros(3)),
    ],
)
def test_formula_input_errors(call) -> None:
    with pytest.raises(InvalidInputError):
        call()


# --- calibrated baselines --------------------------------------------------------------


def _message(logprobs: list[float]) -> dict:
    return {
        "prompt_token_ids": [1, 2],
        "token_ids": list(range(len(logprobs))),
        "logprobs": {"content": [{"token": "t", "logprob": v} for v in logprobs]},
    }


def _labelled(seed: int, n: int) -> list[tuple[dict, bool]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        correct = bool(rng.uniform() < 0.5)
        mean_lp = -0.2 if correct else -1.5
        lps = np.minimum(mean_lp + 0.3 * rng.normal(size=3), 0.0)
        out.append((_message(lps.tolist()), correct))
    return out


def test_calibrated_scorer_keeps_ranking_and_round_trips() -> None:
    train, test = _labelled(0, 200), _labelled(1, 100)
    cal = CalibratedScorer(PerplexityScorer(), num_boost_round=100).fit(train)
    assert cal.name == "calibrated_perplexity"
    u = cal.score_many([m for m, _ in test])
    assert np.all((u >= 0) & (u <= 1))
    assert metrics.auroc(u, [c for _, c in test]) > 0.9
    state = cal.get_state()
    buf = io.BytesIO()
    np.savez(buf, **state.arrays)
    reloaded = scorer_from_state(
        ScorerState(state.kind, json.loads(json.dumps(state.params)), {}, dict(state.files))
    )
    assert isinstance(reloaded, CalibratedScorer)
    np.testing.assert_allclose(reloaded.score_many([m for m, _ in test]), u)
    assert reloaded.score(test[0][0]) == pytest.approx(u[0])


def test_calibrated_scorer_errors() -> None:
    cal = CalibratedScorer(PerplexityScorer())
    with pytest.raises(NotFittedError):
        cal.score(_message([-1.0]))
    with pytest.raises(InsufficientDataError):
        cal.fit([(m, True) for m, _ in _labelled(0, 20)])
    with pytest.raises(InvalidInputError):
        cal.fit_scores([0.1, float("nan")], [True, False])
    with pytest.raises(InvalidInputError):
        CalibratedScorer("perplexity")  # type: ignore[arg-type]


# --- configuration errors (no model needed) --------------------------------------------


def test_model_baselines_need_a_model() -> None:
    for cls in (PTrueScorer, AttentionScoreScorer, EigenScoreScorer):
        with pytest.raises(ConfigError, match="GeometryChatModel"):
            cls(None)  # type: ignore[arg-type]


def test_semantic_entropy_says_what_it_needs() -> None:
    fake = SimpleNamespace(hf_model=object(), tokenizer=object())
    with pytest.raises(ConfigError, match="nli_model_path"):
        SemanticEntropyScorer(fake)
    with pytest.raises(ConfigError, match="Unknown judge"):
        SemanticEntropyScorer(fake, judge="oracle")


def test_sample_source_rejects_one_sample() -> None:
    with pytest.raises(InvalidInputError):
        SampleSource(SimpleNamespace(hf_model=object(), tokenizer=object()), num_samples=1)


def test_from_state_needs_model() -> None:
    with pytest.raises(ConfigError, match="model="):
        scorer_from_state(ScorerState("attention_score", {"layer": None}))


def test_messages_without_prompt_ids_are_a_typed_error() -> None:
    fake = SimpleNamespace(hf_model=SimpleNamespace(config=None), tokenizer=None)
    with pytest.raises(ScoringError, match="prompt_token_ids"):
        AttentionScoreScorer(fake).score({"token_ids": [1]})


# --- real model ------------------------------------------------------------------------


@pytest.mark.model
def test_baselines_on_the_real_model(default_model) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage

    from abstain_guard.scorers import (
        SentenceSimilarity,
        SimilarityEquivalence,
    )

    conv = [SystemMessage("Answer in a few words."), HumanMessage("What is the capital of Peru?")]
    msg = default_model.invoke(conv, max_new_tokens=8)
    prompt = msg.response_metadata["prompt_token_ids"]
    assert question_from_prompt(default_model.tokenizer, prompt) == "What is the capital of Peru?"

    previous = default_model.hf_model.config._attn_implementation
    source = SampleSource(default_model, num_samples=3, max_new_tokens=8)
    sim = SentenceSimilarity()
    scorers = {
        "p_true": PTrueScorer(default_model),
        "attention_score": AttentionScoreScorer(default_model),
        "sar": SARScorer(default_model, similarity=sim, samples=source),
        "eigenscore": EigenScoreScorer(default_model, samples=source),
        "semantic_entropy": SemanticEntropyScorer(
            default_model, judge=SimilarityEquivalence(sim, 0.9), samples=source
        ),
    }
    scores = {name: scorer.score_many([msg, msg]) for name, scorer in scorers.items()}
    for name, s in scores.items():
        assert s.shape == (2,) and np.all(np.isfinite(s)), name
        assert s[0] == pytest.approx(s[1]), name  # cached samples: same prompt, same score
    assert default_model.hf_model.config._attn_implementation == previous
    samples = source.samples(prompt)
    assert len(samples) == 3
    assert all(len(s.logprobs) == len(s.token_ids) for s in samples)
    # P(True) is −log p("True"), a non-negative number; attention over prompt+answer
    assert scores["p_true"][0] >= 0
    n_tok = len(prompt) + len(msg.response_metadata["token_ids"])
    diag = scorers["attention_score"].diagonals(msg)  # type: ignore[attr-defined]
    assert diag.shape == (default_model.hf_model.config.num_attention_heads, n_tok)
    assert diag[:, 0] == pytest.approx(1.0)  # the first token attends only to itself


# --- auxiliary models --------------------------------------------------------------------


class _FakeChat:
    """Answers 'Yes' when both answers share their first word."""

    def __init__(self) -> None:
        self.calls = 0

    def invoke(self, messages):
        from langchain_core.messages import AIMessage

        self.calls += 1
        text = messages[0].content
        a = text.split("Answer 1: ")[1].split("\n")[0]
        b = text.split("Answer 2: ")[1].split("\n")[0]
        return AIMessage("Yes." if a.split()[0] == b.split()[0] else "No")


def test_chat_model_equivalence_asks_both_orders() -> None:
    from abstain_guard.scorers import ChatModelEquivalence

    chat = _FakeChat()
    judge = ChatModelEquivalence(chat)
    assert judge.equivalent("q?", "Paris city", "Paris, France") is False  # "Paris" vs "Paris,"
    assert judge.equivalent("q?", "Lima is it", "Lima it is") is True
    assert chat.calls == 3  # the first pair stops after one "No"
    assert judge.equivalent("q?", "same", "same ") is True and chat.calls == 3


def test_sentence_similarity_and_threshold_judge() -> None:
    from abstain_guard.scorers import (
        SentenceSimilarity,
        SimilarityEquivalence,
    )

    sim = SentenceSimilarity()
    m = sim.matrix(["The capital is Lima.", "Lima is the capital.", "I like bananas."])
    assert m.shape == (3, 3)
    np.testing.assert_allclose(np.diag(m), 1.0, atol=1e-5)
    assert m[0, 1] > 0.8 > m[0, 2]
    np.testing.assert_allclose(
        sim.pairs([("The capital is Lima.", "I like bananas.")]), m[0, 2], atol=1e-5
    )
    judge = SimilarityEquivalence(sim, threshold=0.8)
    assert judge.equivalent("q", "The capital is Lima.", "Lima is the capital.")
    assert not judge.equivalent("q", "The capital is Lima.", "I like bananas.")


def test_missing_similarity_model_is_a_typed_error(tmp_path) -> None:
    from abstain_guard.errors import ModelNotFoundError
    from abstain_guard.scorers import NLIEquivalence, SentenceSimilarity

    with pytest.raises(ModelNotFoundError):
        SentenceSimilarity(tmp_path / "nowhere")
    with pytest.raises(ModelNotFoundError):
        NLIEquivalence(tmp_path / "nowhere")
