"""Black-box scorers on a scripted chat model: the k samples are drawn concurrently at the
recorded temperature, the primary answer by the recorded rule, the statistics are the
formulas', the plan and the similarity model are recorded and a deployment that samples
otherwise is refused; the verbalized confidence's parser, and the guard failing closed."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.prompts import ChatPromptTemplate
from pydantic import Field

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.errors import (
    ArtifactMismatchError,
    ConfidenceParseError,
    ConfigError,
    SamplingMismatchError,
    ScoringError,
)
from abstain_guard.scorers._base import ScorerState
from abstain_guard.scorers._blackbox_sampling import (
    SAMPLES_KEY,
    SampledChatModel,
    SamplingPlan,
    SimilarityModel,
    read_samples,
    with_sampling,
)
from abstain_guard.scorers._similarity_graph import (
    affinity,
    cosine_similarities,
    degree_uncertainties,
    discrete_semantic_entropy,
    eccentricity_uncertainty,
    eigenvalue_uncertainty,
    equivalent_by_threshold,
    semantic_ids,
)
from abstain_guard.scorers.blackbox import BlackBoxScorer, graph_statistic
from abstain_guard.scorers.verbalized_confidence import (
    CONFIDENCE_PROMPT,
    VerbalizedConfidenceScorer,
    parse_verbalized_confidence,
)

#: Each answer's embedding: "Paris" twice alike, "Lyon" apart, "Paris, France" near Paris.
VECTORS = {
    "Paris": [1.0, 0.0, 0.0],
    "Paris, France": [0.95, 0.31, 0.0],
    "Lyon": [0.0, 1.0, 0.0],
    "Berlin": [0.0, 0.0, 1.0],
    "85": [0.5, 0.5, 0.5],
}


class SamplingFake(BaseChatModel):
    """Answers from ``answers`` in turn when ``temperature > 0``, always the first at 0;
    a confidence question gets ``confidence``. Every call's temperature and the most calls
    in flight at once are logged in ``log`` (shared by copies: a list field)."""

    temperature: float = 0.0
    answers: list[str] = Field(default_factory=lambda: ["Paris"])
    confidence: str = "85"
    delay: float = 0.02
    log: list[Any] = Field(default_factory=lambda: [0, 0, threading.Lock(), []])

    @property
    def _llm_type(self) -> str:
        return "sampling-fake"

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> ChatResult:
        lock = self.log[2]
        with lock:
            self.log[0] += 1
            self.log[1] = max(self.log[1], self.log[0])
        try:
            time.sleep(self.delay)
            text = self._answer(messages)
        finally:
            with lock:
                self.log[0] -= 1
        msg = AIMessage(content=text, response_metadata={"model_name": "fake"})
        return ChatResult(generations=[ChatGeneration(message=msg)])

    def _answer(self, messages: list[BaseMessage]) -> str:
        calls = self.log[3]
        with self.log[2]:
            n = len(calls)
            calls.append(self.temperature)
        if CONFIDENCE_PROMPT in str(messages[-1].content):
            return self.confidence
        return self.answers[n % len(self.answers)] if self.temperature > 0 else self.answers[0]

    @property
    def calls(self) -> list[float]:
        return self.log[3]

    @property
    def peak(self) -> int:
        return self.log[1]


class FakeSimilarity:
    """A SimilarityModel over :data:`VECTORS` (no model loaded)."""

    kind = "embedding"
    name = "fake-embedder"
    digest = "0" * 64

    def record(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "digest": self.digest}

    def embeddings(self, texts: Any) -> np.ndarray:
        return np.asarray([VECTORS[t] for t in texts], dtype=np.float64)

    def similarities(self, texts: Any) -> np.ndarray:
        return cosine_similarities(self.embeddings(texts))

    def equivalences(self, question: str, texts: Any, threshold: float) -> np.ndarray:
        return equivalent_by_threshold(self.similarities(texts), threshold)


ANSWERS = ["Paris", "Lyon", "Paris, France", "Paris", "Berlin"]


def scorer(statistic: str = "discrete_semantic_entropy", **kw: Any) -> BlackBoxScorer:
    settings = {"num_samples": 5, "temperature": 0.7, **kw}
    return BlackBoxScorer(statistic, similarity=FakeSimilarity(), **settings)  # type: ignore[arg-type]


def test_samples_are_drawn_concurrently_at_the_recorded_temperature() -> None:
    model = SamplingFake(answers=ANSWERS)
    sampled = scorer(max_concurrency=3).prepare(model)
    assert isinstance(sampled, SampledChatModel)
    msg = sampled.invoke("Capital of France?")
    assert model.calls == [0.7] * 5  # k calls, each at the plan's temperature
    assert 2 <= model.peak <= 3  # concurrent, at most max_concurrency in flight
    block = msg.response_metadata[SAMPLES_KEY]
    assert sorted(block["texts"]) == sorted(ANSWERS)  # in the order the calls returned
    assert block["question"] == "Capital of France?"
    assert block["primary_index"] == 0 and msg.content == block["texts"][0]
    assert block["plan"] == {
        "num_samples": 5,
        "temperature": 0.7,
        "primary": "first",
        "similarity": None,
        "confidence_prompt": None,
    }
    assert msg.response_metadata["model_name"] == "fake"  # the primary's own metadata kept


def test_the_async_path_samples_with_abatch() -> None:
    model = SamplingFake(answers=ANSWERS)
    msg = asyncio.run(scorer(max_concurrency=5).prepare(model).ainvoke("Capital of France?"))
    assert sorted(msg.response_metadata[SAMPLES_KEY]["texts"]) == sorted(ANSWERS)
    assert model.calls == [0.7] * 5


def test_the_medoid_rule_returns_the_answer_most_like_the_others() -> None:
    model = SamplingFake(answers=["Lyon", "Paris", "Paris, France", "Paris", "Berlin"])
    msg = scorer(primary="medoid").prepare(model).invoke("Capital of France?")
    block = msg.response_metadata[SAMPLES_KEY]
    # row sums of the cosines: "Paris, France" 1 + 2 * 0.951 + 0.310 (Lyon) = 3.21 beats
    # "Paris" 1 + 1 + 0.951 = 2.95
    assert msg.content == block["texts"][block["primary_index"]] == "Paris, France"
    assert block["plan"]["similarity"] == FakeSimilarity().record()


def test_the_wrapper_sits_inside_a_chain_and_keeps_the_model_fingerprint() -> None:
    model = SamplingFake(answers=ANSWERS)
    chain = ChatPromptTemplate.from_messages([("human", "{question}")]) | model
    prepared = scorer().prepare(chain)
    msg = prepared.invoke({"question": "Capital of France?"})
    assert msg.response_metadata[SAMPLES_KEY]["question"] == "Capital of France?"
    wrapped = SampledChatModel(inner=model, plan=scorer().plan)
    from abstain_guard.contract.chat_model_specs import chat_model_fingerprint

    assert wrapped.fingerprint() == chat_model_fingerprint(model)


def test_a_model_without_a_temperature_cannot_be_sampled() -> None:
    from langchain_core.language_models import GenericFakeChatModel

    fake = GenericFakeChatModel(messages=iter([AIMessage(content="x")] * 5))
    with pytest.raises(ConfigError, match="temperature"):
        scorer().prepare(fake).invoke("q")
    with pytest.raises(ConfigError, match="no LangChain chat model"):
        with_sampling(ChatPromptTemplate.from_messages([("human", "{q}")]), scorer().plan)


def test_a_model_already_sampling_under_another_plan_is_refused() -> None:
    model = SamplingFake(answers=ANSWERS)
    other = scorer(temperature=1.0).prepare(model)
    with pytest.raises(SamplingMismatchError, match=r"temperature=1\.0"):
        scorer().prepare(other)
    assert scorer().prepare(scorer().prepare(model)).plan == scorer().plan  # same plan: kept


def _sampled(statistic: str = "discrete_semantic_entropy", **kw: Any) -> tuple[Any, AIMessage]:
    s = scorer(statistic, **kw)
    return s, s.prepare(SamplingFake(answers=ANSWERS)).invoke("Capital of France?")


def test_each_statistic_is_its_formula_of_the_samples() -> None:
    sim = FakeSimilarity().similarities(ANSWERS)
    w = affinity(sim)
    eq = equivalent_by_threshold(sim, 0.8)
    ids = semantic_ids(eq)
    assert ids.tolist() == [0, 1, 0, 0, 2]  # Paris x3 (with "Paris, France"), Lyon, Berlin
    expected = {
        "discrete_semantic_entropy": discrete_semantic_entropy(ids),
        "num_semantic_sets": 3.0,
        "eigv": eigenvalue_uncertainty(w),
        "degree": float(np.mean(degree_uncertainties(w))),
        "eccentricity": eccentricity_uncertainty(w),
    }
    for statistic, value in expected.items():
        s, msg = _sampled(statistic)
        assert s.kind == statistic
        assert s.score(msg) == pytest.approx(value)
        assert s.score(dict(msg.response_metadata)) == pytest.approx(value)  # stored metadata
        embeddings = FakeSimilarity().embeddings(ANSWERS)
        assert s.score_embeddings(embeddings) == pytest.approx(value)
    assert expected["discrete_semantic_entropy"] == pytest.approx(
        -(0.6 * np.log(0.6) + 2 * 0.2 * np.log(0.2))
    )


def test_answer_level_degree_scores_the_primary_answer() -> None:
    s, msg = _sampled("degree", of="answer", primary="medoid")
    block = msg.response_metadata[SAMPLES_KEY]
    w = affinity(FakeSimilarity().similarities(block["texts"]))
    assert msg.content == "Paris, France"
    assert s.score(msg) == pytest.approx(degree_uncertainties(w)[block["primary_index"]])
    assert graph_statistic("degree", np.ones((3, 3)), of="answer") == pytest.approx(0.0)
    with pytest.raises(ConfigError):
        BlackBoxScorer("eigv", of="answer", similarity=FakeSimilarity())  # type: ignore[arg-type]


def test_scores_are_lower_when_the_samples_agree() -> None:
    for statistic in (
        "discrete_semantic_entropy",
        "num_semantic_sets",
        "eigv",
        "degree",
        "eccentricity",
    ):
        s = scorer(statistic)
        agree = s.prepare(SamplingFake(answers=["Paris"])).invoke("q")
        differ = s.prepare(SamplingFake(answers=["Paris", "Lyon", "Berlin"])).invoke("q")
        assert s.score(agree) < s.score(differ), statistic


def test_the_state_records_k_temperature_rule_and_similarity_model() -> None:
    state = scorer("eigv", primary="medoid").get_state()
    assert state.kind == "eigv"
    assert state.params["num_samples"] == 5
    assert state.params["temperature"] == 0.7
    assert state.params["primary"] == "medoid"
    assert state.params["similarity"] == FakeSimilarity().record()


def test_a_stored_scorer_refuses_another_similarity_model() -> None:
    real = SimilarityModel()  # the shipped all-MiniLM-L6-v2 (its weights hashed, not loaded)
    assert real.record()["name"] == "all-MiniLM-L6-v2" and len(real.digest) == 64
    state = BlackBoxScorer("eigv", num_samples=3, similarity=real).get_state()
    loaded = BlackBoxScorer.from_state(state)
    assert loaded.get_state() == state
    state.params["similarity"] = {**state.params["similarity"], "digest": "f" * 64}
    with pytest.raises(SamplingMismatchError, match="weights"):
        BlackBoxScorer.from_state(state)


def test_responses_sampled_otherwise_are_refused() -> None:
    _, msg = _sampled()
    for other in (scorer(num_samples=4), scorer(temperature=1.0), scorer(primary="medoid")):
        with pytest.raises(SamplingMismatchError, match="sampled otherwise"):
            other.score(msg)
    with pytest.raises(ScoringError, match="no sampled answers"):
        scorer().score(AIMessage(content="Paris"))


def test_unusable_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        scorer("bleu")
    with pytest.raises(ConfigError):
        scorer(num_samples=1)
    with pytest.raises(ConfigError):
        scorer(temperature=-0.1)
    with pytest.raises(ConfigError):
        scorer(primary="longest")
    with pytest.raises(ConfigError):
        SamplingPlan(3, 1.0, "medoid", None)


@pytest.mark.parametrize(
    ("reply", "confidence"),
    [
        ("85", 0.85),
        ("85%", 0.85),
        (" Confidence: 85/100", 0.85),
        ("I would say 85 out of 100.", 0.85),
        ("I am 90 percent sure", 0.9),
        ("On a scale of 0 to 100: 40", 0.4),
        ("0-100: 7", 0.07),
        ("0.85", 0.85),
        ("85. My confidence is 85%.", 0.85),
        ("0", 0.0),
        ("100", 1.0),
    ],
)
def test_verbalized_confidence_is_parsed(reply: str, confidence: float) -> None:
    assert parse_verbalized_confidence(reply) == pytest.approx(confidence)


@pytest.mark.parametrize(
    "reply",
    ["", "I cannot say.", "70 or 80", "between 70 and 80", "8/10", "7 out of 10", "150", "-5"],
)
def test_a_reply_with_no_single_confidence_is_a_scoring_error(reply: str) -> None:
    with pytest.raises(ConfidenceParseError):
        parse_verbalized_confidence(reply)


def test_verbalized_confidence_asks_about_the_primary_answer() -> None:
    model = SamplingFake(answers=["Paris"], confidence="Confidence: 85%")
    s = VerbalizedConfidenceScorer()
    msg = s.prepare(model).invoke("Capital of France?")
    assert msg.content == "Paris"
    assert model.calls == [0.0, 0.0]  # the answer, then the confidence question
    block = msg.response_metadata[SAMPLES_KEY]
    assert block["confidence_reply"] == "Confidence: 85%"
    assert block["plan"]["confidence_prompt"] == CONFIDENCE_PROMPT
    assert s.score(msg) == pytest.approx(0.15)
    state = s.get_state()
    assert VerbalizedConfidenceScorer.from_state(state).get_state() == state
    assert state.params["similarity"] is None and state.params["num_samples"] == 1


def test_read_samples_checks_the_count() -> None:
    s, msg = _sampled()
    meta = dict(msg.response_metadata)
    meta[SAMPLES_KEY] = {**meta[SAMPLES_KEY], "texts": ANSWERS[:3]}
    with pytest.raises(ScoringError, match="3 samples"):
        read_samples(meta, s.plan)


def _guard(scorer_: Any, model: BaseChatModel) -> AbstentionGuard:
    rng = np.random.default_rng(0)
    scores = rng.uniform(0.0, 1.0, size=200)
    artifact = GuardArtifact.from_calibration(
        scorer=scorer_, calibration=CalibrationSet(scores, scores < 0.5)
    )
    return AbstentionGuard(model, artifact=artifact, config=GuardConfig(participation=0.8))


def test_the_guard_samples_through_the_scorer_and_fails_closed_on_an_unparsed_reply() -> None:
    confident = _guard(VerbalizedConfidenceScorer(), SamplingFake(confidence="95"))
    msg = confident.invoke([HumanMessage("Capital of France?")])
    decision = msg.response_metadata["abstention"]
    assert not decision["abstained"] and decision["score"] == pytest.approx(0.05)
    refusing = _guard(VerbalizedConfidenceScorer(), SamplingFake(confidence="I can't tell."))
    msg = refusing.invoke([HumanMessage("Capital of France?")])
    decision = msg.response_metadata["abstention"]
    assert decision["abstained"] and decision["reason"] == "scoring failed"
    assert decision["error"].startswith("ConfidenceParseError")
    assert issubclass(ConfidenceParseError, ScoringError)
    assert issubclass(SamplingMismatchError, ArtifactMismatchError)


def test_a_stored_state_rebuilds_the_same_plan() -> None:
    state = ScorerState(
        kind="num_semantic_sets",
        params={
            **scorer("num_semantic_sets").get_state().params,
            "similarity": SimilarityModel().record(),
        },
    )
    loaded = BlackBoxScorer.from_state(state)
    assert loaded.plan == scorer("num_semantic_sets").plan
