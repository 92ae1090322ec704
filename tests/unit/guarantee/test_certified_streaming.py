"""Certified streaming without a model: the chunk rules, the partial-release certificate
(checked against a distribution with a closed form), the artifact's stream record, and the
guard's stream gate on a chat model that serves its prefixes (real LangChain streaming)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from _core_fakes import ScriptedChatModel, logprob_metadata
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration import CalibrationConfig
from abstain_guard.contract.deployment import DeploymentRecord, StreamingRecord
from abstain_guard.contract.streaming import (
    ChunkRule,
    StreamPrefix,
    active_prefix_sink,
    first_release_statistic,
    stream_statistic,
)
from abstain_guard.errors import (
    ArtifactMismatchError,
    ConfigError,
    ContextLengthError,
    InvalidInputError,
    UncertifiableTargetError,
)
from abstain_guard.guarantee.decision import decision_rule
from abstain_guard.guarantee.partial_release import (
    certified_partial_release,
    dkw_margin,
    partial_release_certificate,
    partial_release_rate,
)
from abstain_guard.scorers import PerplexityScorer

# -- chunk rules -------------------------------------------------------------------------------

CHARS = "Paris is big. Yes, it is!\nOk"


def _decode(ids: Any) -> str:  # a character tokenizer: token i is CHARS[i]
    return "".join(CHARS[i] for i in ids)


def test_chunk_rule_parses_and_prints_back():
    for text in ("sentence", "clause", "tokens:8", " tokens:1 "):
        assert str(ChunkRule.parse(text)) == text.strip()
    for bad in ("tokens:0", "tokens", "word", "tokens:-2", ""):
        with pytest.raises(ConfigError):
            ChunkRule.parse(bad)


def test_chunk_ends_read_only_the_tokens():
    ids = list(range(len(CHARS)))
    assert ChunkRule.parse("tokens:5").interior_ends(ids, _decode) == [5, 10, 15, 20, 25]
    sentence = ChunkRule.parse("sentence").interior_ends(ids, _decode)
    assert [CHARS[t - 1] for t in sentence] == [".", "!", "\n"]
    clause = ChunkRule.parse("clause").interior_ends(ids, _decode)
    assert [CHARS[t - 1] for t in clause] == [".", ",", "!", "\n"]
    # the last token never counts as interior; live and stored agree token by token
    rule = ChunkRule.parse("clause")
    assert [t for t in range(1, len(ids)) if rule.ends_at(ids[:t], _decode)] == clause


def test_stream_and_first_statistics():
    assert stream_statistic([0.2, 0.7], 0.5) == 0.7
    assert stream_statistic([], 0.5) == 0.5
    assert first_release_statistic([0.2, 0.7]) == 0.2
    assert first_release_statistic([]) == math.inf


# -- the partial-release certificate -------------------------------------------------------------


def _draw(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """F ~ U(0, 1), M = F + U(0, 1): G_F(t) = t on [0, 1], G_M triangular; a fifth of the
    answers have no interior chunk (F = inf, M ~ U(0, 2))."""
    f = rng.uniform(size=n)
    m = f + rng.uniform(size=n)
    none = rng.uniform(size=n) < 0.2
    return np.where(none, np.inf, f), np.where(none, rng.uniform(0, 2, size=n), m)


def _true_rate(t: np.ndarray) -> np.ndarray:
    """R_p(t) = P(F <= t < M) = 0.8 (G_U(t) - G_tri(t)) (the answers without chunks never
    release part of an answer)."""
    tri = np.where(t <= 0, 0.0, np.where(t <= 1, t**2 / 2, 1 - (2 - np.minimum(t, 2)) ** 2 / 2))
    return 0.8 * (np.clip(t, 0, 1) - tri)


def test_partial_release_rate_is_the_brute_force_share():
    rng = np.random.default_rng(1)
    f, m = _draw(rng, 500)
    for t in (-1.0, 0.3, 0.9, 1.4, 3.0):
        brute = np.mean([(fi <= t) and (mi > t) for fi, mi in zip(f, m, strict=True)])
        assert partial_release_rate(f, m, t) == pytest.approx(brute)


def test_partial_release_bound_covers_uniformly_at_its_level():
    """The band holds for every threshold at once in at least 1 - delta of the draws (the
    bound read at a data-chosen threshold): 400 draws of n = 300, delta = 0.1."""
    rng = np.random.default_rng(7)
    grid = np.linspace(-0.1, 2.1, 221)
    misses = 0
    for _ in range(400):
        f, m = _draw(rng, 300)
        points = np.concatenate([grid, f[np.isfinite(f)], m])
        bounds = np.array([certified_partial_release(f, m, t, 0.1) for t in points[::7]])
        misses += bool((_true_rate(points[::7]) > bounds + 1e-12).any())
    assert misses / 400 <= 0.1


def test_partial_release_ceiling_certifies_everything_below_it():
    rng = np.random.default_rng(3)
    f, m = _draw(rng, 2000)
    cert = partial_release_certificate(f, m, 0.2, 0.05)
    c = dkw_margin(2000, 0.05)
    assert cert.feasible and cert.margin == pytest.approx(c)
    values = np.unique(np.concatenate([f[np.isfinite(f)], m]))
    below = values[values < cert.ceiling]
    assert below.size > 100
    assert all(partial_release_rate(f, m, t) + 2 * c <= 0.2 for t in below)
    assert partial_release_rate(f, m, cert.ceiling) + 2 * c > 0.2
    assert not partial_release_certificate(f[:20], m[:20], 0.2, 0.05).feasible


def test_partial_release_inputs_are_checked():
    with pytest.raises(InvalidInputError, match="exceed"):
        partial_release_rate([0.9], [0.5], 0.6)
    with pytest.raises(InvalidInputError, match="same length"):
        partial_release_rate([0.1, 0.2], [0.5], 0.6)


def test_decision_rule_with_a_partial_release_target():
    rng = np.random.default_rng(5)
    f, m = _draw(rng, 3000)
    correct = rng.uniform(size=3000) > m / 3  # higher statistic, more often wrong
    plain = decision_rule(m, correct, GuardConfig(mode="risk", risk_target=0.2), stream_first=f)
    block = plain.guarantee.partial_release
    assert block["level"] == 0.1 and block["certified_bound"] >= block["calibration_rate"]
    both = decision_rule(
        m,
        correct,
        GuardConfig(mode="risk", risk_target=0.2, partial_release_target=0.15),
        stream_first=f,
    )
    assert both.guarantee.partial_release["ceiling"] > both.threshold
    assert both.guarantee.partial_release["certified_bound"] <= 0.15
    assert both.guarantee.delta == 0.1 and both.guarantee.partial_release["level"] == 0.05
    with pytest.raises(UncertifiableTargetError, match="partial_release_target"):
        decision_rule(
            m,
            correct,
            GuardConfig(mode="risk", risk_target=0.2, partial_release_target=0.01),
            stream_first=f,
        )
    with pytest.raises(ConfigError, match="chunk rule"):
        decision_rule(
            m, correct, GuardConfig(mode="risk", risk_target=0.2, partial_release_target=0.1)
        )


def test_config_refusals():
    with pytest.raises(ConfigError, match="partial_release_target needs mode='risk'"):
        GuardConfig(partial_release_target=0.1)
    with pytest.raises(ConfigError, match="not supported with scorer 'auto'"):
        CalibrationConfig(
            chunk_rule="sentence", scorer="auto", candidates="probe_mid,perplexity", risk_target=0.3
        )
    assert CalibrationConfig(chunk_rule=" tokens:4", scorer="probe_mid").chunk_rule == "tokens:4"


# -- the guard's stream gate ---------------------------------------------------------------------

SCRIPT = {
    "good": ("Paris is nice", [-0.01, -0.01, -0.01]),  # every prefix passes
    "late": ("Lima is it", [-0.01, -3.0, -3.0]),  # chunk 1 passes, chunk 2 crosses
    "early": ("Oslo maybe yes", [-3.0, -0.01, -0.01]),  # chunk 1 crosses: nothing shown
}


class PrefixScriptedChatModel(ScriptedChatModel):
    """A scripted model whose stream serves its prefixes (one word a token), as the
    project's engine does: at each chunk end the message cut there goes into the sink
    before the chunk's text is yielded."""

    serves_prefixes: ClassVar[bool] = True
    streamed: ClassVar[list[int]] = []  # tokens generated, stream after stream

    def _stream(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> Iterator[ChatGenerationChunk]:
        whole = self._answer(messages)
        words = str(whole.content).split()
        lps = [e["logprob"] for e in whole.response_metadata["logprobs"]["content"]]
        sink = active_prefix_sink()
        for t in range(1, len(words) + 1):
            PrefixScriptedChatModel.streamed.append(t)
            piece = (" " if t > 1 else "") + words[t - 1]
            if sink is not None and sink.rule.ends_at(list(range(t)), lambda ids: ""):
                sink.served = True
                cut = AIMessage(
                    content=" ".join(words[:t]),
                    response_metadata=logprob_metadata(words[:t], lps[:t]),
                )
                sink.put(StreamPrefix(t, cut))
            yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
        yield ChatGenerationChunk(
            message=AIMessageChunk(content="", response_metadata=whole.response_metadata)
        )


def _stream_artifact(rule: str = "tokens:1") -> GuardArtifact:
    rng = np.random.default_rng(0)
    scores = rng.uniform(1.0, 3.0, size=300)  # τ at participation 0.8 is about 2.6
    correct = rng.uniform(size=300) > (scores - 1.0) / 2.0
    record = DeploymentRecord(model_fingerprint="m-1", streaming=StreamingRecord(chunk_rule=rule))
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(
            scores, correct, stream_first=scores - rng.uniform(0, 0.5, size=300)
        ),
        model_fingerprint="m-1",
        metadata={"deployment": record.to_json()},
    )


@pytest.fixture
def stream_guard() -> AbstentionGuard:
    model = PrefixScriptedChatModel(script=SCRIPT, fingerprint="m-1")
    # the scripted responses carry no generation settings: recorded as mismatches ("warn")
    config = GuardConfig(participation=0.8, on_mismatch="warn")
    return AbstentionGuard(model, artifact=_stream_artifact(), config=config)


def test_artifact_keeps_its_stream_record(tmp_path):
    art = _stream_artifact("sentence")
    art.save(tmp_path / "a")
    back = GuardArtifact.load(tmp_path / "a")
    np.testing.assert_array_equal(back.stream_first, art.stream_first)
    assert DeploymentRecord.from_metadata(back.metadata).streaming.chunk_rule == "sentence"
    assert back.decision_rule(GuardConfig(participation=0.8)).guarantee.partial_release is not None


def test_answered_stream_releases_every_chunk_then_the_decision(stream_guard):
    chunks = list(stream_guard.stream("good"))
    assert [c.content for c in chunks] == ["Paris", " is", " nice", ""]
    decision = chunks[-1].response_metadata["abstention"]
    assert not decision["abstained"]
    assert decision["streaming"]["chunks_decided"] == 4  # three chunk ends and the whole
    assert not decision["streaming"]["partial_release"]
    assert stream_guard.invoke("good").content == "Paris is nice"


def test_stream_stopped_after_a_chunk_shows_nothing_beyond_it(stream_guard):
    PrefixScriptedChatModel.streamed = []
    chunks = list(stream_guard.stream("late"))
    assert [c.content for c in chunks[:-1]] == ["Lima"]
    last = chunks[-1]
    assert last.content == stream_guard.config.abstain_message
    decision = last.response_metadata["abstention"]
    assert decision["abstained"] and decision["streaming"]["partial_release"]
    assert decision["streaming"]["stopped_at_tokens"] == 2
    assert decision["step"] == 1 and decision["run_statistic"] > stream_guard.threshold
    assert PrefixScriptedChatModel.streamed == [1, 2]  # generation stopped at the stop
    assert last.response_metadata["withheld_response"]["content"] == "Lima is"
    assert stream_guard.invoke("late").response_metadata["abstention"]["abstained"]


def test_stream_stopped_at_the_first_chunk_shows_nothing(stream_guard):
    chunks = list(stream_guard.stream("early"))
    assert len(chunks) == 1 and chunks[0].response_metadata["abstention"]["abstained"]
    assert not chunks[0].response_metadata["abstention"]["streaming"]["partial_release"]


def test_astream_matches_stream(stream_guard):
    async def run(q: str) -> list[Any]:
        return [c async for c in stream_guard.astream(q)]

    for q in SCRIPT:
        sync = [
            (c.content, c.response_metadata.get("abstention", {}).get("abstained"))
            for c in stream_guard.stream(q)
        ]
        got = asyncio.run(run(q))
        assert [
            (c.content, c.response_metadata.get("abstention", {}).get("abstained")) for c in got
        ] == sync


class TooLongPrefixChatModel(PrefixScriptedChatModel):
    def _stream(self, *args: Any, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        raise ContextLengthError("the prompt has 9000 tokens; the context window is 8192.")


def test_an_input_too_long_for_the_context_abstains_in_a_certified_stream():
    model = TooLongPrefixChatModel(script=SCRIPT, fingerprint="m-1")
    config = GuardConfig(participation=0.8, on_mismatch="warn")
    guard = AbstentionGuard(model, artifact=_stream_artifact(), config=config)

    async def run() -> list[Any]:
        return [c async for c in guard.astream("good")]

    for chunks in (list(guard.stream("good")), asyncio.run(run()), [guard.invoke("good")]):
        assert len(chunks) == 1 and chunks[0].content == config.abstain_message
        decision = chunks[0].response_metadata["abstention"]
        assert decision["abstained"] and decision["reason"] == "input too long"
        assert "9000 tokens" in decision["error"]
    strict = AbstentionGuard(
        model, artifact=_stream_artifact(), config=config.model_copy(update={"on_error": "raise"})
    )
    with pytest.raises(ContextLengthError):
        list(strict.stream("good"))


def test_model_that_serves_no_prefixes_is_refused_and_fails_closed():
    art = _stream_artifact()
    with pytest.raises(ArtifactMismatchError, match="serve the answer's prefixes"):
        AbstentionGuard(ScriptedChatModel(script=SCRIPT, fingerprint="m-1"), artifact=art)


def test_a_whole_message_alone_is_not_decided_on_a_stream_artifact(stream_guard):
    """decide() (and the agent middleware, which decides finished messages) cannot read the
    prefix scores the threshold is on: fail closed, saying why."""
    message = PrefixScriptedChatModel(script=SCRIPT, fingerprint="m-1").invoke("good")
    out = stream_guard.decide(message)
    decision = out.response_metadata["abstention"]
    assert decision["abstained"] and "chunk rule" in decision["error"]
