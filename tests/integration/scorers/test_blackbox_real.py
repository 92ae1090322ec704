"""The black-box scorers on the embedded SmolLM2 and the shipped all-MiniLM-L6-v2: three
answers sampled in one batch at temperature 1, every statistic scored from the same samples,
the verbalized confidence asked after a greedy answer, and a guard deciding on them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.errors import ConfidenceParseError
from abstain_guard.scorers import BlackBoxScorer, SimilarityModel, VerbalizedConfidenceScorer
from abstain_guard.scorers._blackbox_sampling import SAMPLES_KEY
from abstain_guard.scorers._similarity_graph import cosine_similarities, medoid_index

QUESTION = "What is the capital of France? Answer in a few words."
STATISTICS = ("discrete_semantic_entropy", "num_semantic_sets", "eigv", "degree", "eccentricity")


@pytest.fixture(scope="module")
def similarity() -> SimilarityModel:
    return SimilarityModel()  # the shipped all-MiniLM-L6-v2


def test_every_statistic_scores_the_real_samples(default_model, similarity) -> None:
    scorers = {
        s: BlackBoxScorer(
            s, num_samples=3, temperature=1.0, primary="medoid", similarity=similarity
        )
        for s in STATISTICS
    }
    message = scorers["eigv"].prepare(default_model).invoke(QUESTION)
    block = message.response_metadata[SAMPLES_KEY]
    texts = block["texts"]
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
    emb = similarity.embeddings(texts)
    assert emb.shape == (3, 384) and np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert block["primary_index"] == medoid_index(cosine_similarities(emb))
    assert message.content == texts[block["primary_index"]]
    assert message.response_metadata["geometry"]  # the primary answer's own capture is kept
    scores = {s: scorer.score(message) for s, scorer in scorers.items()}
    assert all(math.isfinite(v) for v in scores.values())
    assert 0.0 <= scores["discrete_semantic_entropy"] <= math.log(3) + 1e-12
    assert scores["num_semantic_sets"] in (1.0, 2.0, 3.0)
    assert 1.0 - 1e-9 <= scores["eigv"] <= 3.0 + 1e-9
    assert 0.0 <= scores["degree"] <= 2 / 3 + 1e-12
    state = scorers["eigv"].get_state()
    assert state.params["similarity"]["name"] == "all-MiniLM-L6-v2"
    assert BlackBoxScorer.from_state(state).score(message) == pytest.approx(scores["eigv"])


def test_verbalized_confidence_and_the_guard_on_the_real_model(default_model) -> None:
    scorer = VerbalizedConfidenceScorer()  # one greedy answer, then the confidence question
    rng = np.random.default_rng(0)
    scores = rng.uniform(0.0, 1.0, size=100)
    artifact = GuardArtifact.from_calibration(
        scorer=scorer, calibration=CalibrationSet(scores, scores < 0.6)
    )
    guard = AbstentionGuard(default_model, artifact=artifact, config=GuardConfig(participation=0.8))
    message = guard.invoke(QUESTION)
    decision = message.response_metadata["abstention"]
    answer = message.response_metadata.get("withheld_response") or message.model_dump()
    reply = answer["response_metadata"][SAMPLES_KEY]["confidence_reply"]
    assert isinstance(reply, str)
    try:
        expected = scorer.score(answer["response_metadata"])
    except ConfidenceParseError:  # SmolLM2 may not give a number: the guard fails closed
        assert decision["abstained"] and decision["error"].startswith("ConfidenceParseError")
    else:
        assert decision["score"] == pytest.approx(expected) and 0.0 <= expected <= 1.0
