"""AbstentionGuard with real LangChain machinery: LCEL, callbacks, tracers, astream_events,
batching with max_concurrency, streaming, failures, fingerprints and scorer.prepare."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any, ClassVar
from uuid import UUID

import numpy as np
import pytest
from _core_fakes import ScriptedChatModel
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tracers.base import BaseTracer
from langchain_core.tracers.schemas import Run

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.contract.metadata import ResponseLike
from abstain_guard.contract.runnables import map_chat_models
from abstain_guard.errors import ArtifactMismatchError, GuardError, ScoringError
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.scorers import PerplexityScorer, Scorer, ScorerState, register_scorer

KEYS = {"abstained", "score", "threshold", "scorer", "mode", "target", "guarantee"}

SCRIPT = {
    "easy": ("Paris", [-0.01]),  # perplexity 1.01: answered
    "hard": ("Lima is it", [-2.0, -1.5, -2.5]),  # perplexity e^2 = 7.39: abstained
    "empty": ("", []),  # no tokens: cannot be scored
}


@pytest.fixture(scope="module")
def artifact() -> GuardArtifact:
    # calibration perplexities in [1, 3]; threshold at 80 % participation is about 2.6
    rng = np.random.default_rng(0)
    scores = rng.uniform(1.0, 3.0, size=300)
    correct = rng.uniform(size=300) > (scores - 1.0) / 2.0
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, correct),
        model_fingerprint="m-1",
    )


@pytest.fixture
def model() -> ScriptedChatModel:
    return ScriptedChatModel(script=SCRIPT, fingerprint="m-1")


@pytest.fixture
def guard(model: ScriptedChatModel, artifact: GuardArtifact) -> AbstentionGuard:
    return AbstentionGuard(model, artifact=artifact, config=GuardConfig(participation=0.8))


class EventRecorder(BaseCallbackHandler):
    """A real callback handler that records custom events and chain starts."""

    def __init__(self) -> None:
        self.custom: list[tuple[str, Any, UUID, list[str] | None]] = []
        self.chain_starts: list[tuple[str | None, UUID]] = []

    def on_custom_event(
        self, name: str, data: Any, *, run_id: UUID, tags: list[str] | None = None, **kw: Any
    ) -> None:
        self.custom.append((name, data, run_id, tags))

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, **kw: Any) -> None:
        self.chain_starts.append((kw.get("name"), run_id))


class MemoryTracer(BaseTracer):
    """A real tracer (the same base class as LangSmith's LangChainTracer) kept in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: list[Run] = []

    def _persist_run(self, run: Run) -> None:  # called once per finished root run
        self.finished.append(run)


def _decision(msg: AIMessage) -> dict[str, Any]:
    return msg.response_metadata["abstention"]


def test_answers_and_abstains(guard: AbstentionGuard, artifact: GuardArtifact) -> None:
    tau = guard.threshold
    assert 2.0 < tau < 3.0
    assert tau == artifact.decision_rule(GuardConfig(participation=0.8)).threshold

    ok = guard.invoke("easy")
    assert isinstance(ok, AIMessage) and ok.content == "Paris"
    d = _decision(ok)
    assert set(d) >= KEYS and d["abstained"] is False
    assert d["score"] == pytest.approx(math.exp(0.01)) and d["threshold"] == tau
    assert (d["scorer"], d["mode"], d["target"]) == ("perplexity", "participation", 0.8)
    assert d["guarantee"]["participation_interval"] == pytest.approx([0.8, 0.8 + 1 / 301])
    assert "logprobs" in ok.response_metadata  # the answer keeps its own metadata

    no = guard.invoke("hard")
    assert no.content == "I don't know."
    d = _decision(no)
    assert d["abstained"] is True and d["score"] == pytest.approx(math.exp(2.0))
    withheld = no.response_metadata["withheld_response"]
    assert withheld["content"] == "Lima is it" and "logprobs" in withheld["response_metadata"]


def test_custom_abstain_message_and_risk_mode(
    model: BaseChatModel, artifact: GuardArtifact
) -> None:
    cfg = GuardConfig(mode="risk", risk_target=0.3, delta=0.1, abstain_message="Not sure.")
    g = AbstentionGuard(model, artifact=artifact, config=cfg)
    assert g.decision_rule.mode == "risk"
    out = g.invoke("hard")
    assert out.content == "Not sure."
    d = _decision(out)
    assert d["mode"] == "risk" and d["target"] == 0.3
    assert d["guarantee"]["kind"] == "risk" and d["guarantee"]["confidence"] == pytest.approx(0.9)


def test_lcel_chain_invoke_and_stream(guard: AbstentionGuard) -> None:
    prompt = ChatPromptTemplate.from_messages([("human", "{question}")])
    chain = prompt | guard | StrOutputParser()
    assert chain.invoke({"question": "easy"}) == "Paris"
    assert chain.invoke({"question": "hard"}) == "I don't know."
    # streaming buffers until the decision, then yields it
    assert "".join(chain.stream({"question": "easy"})) == "Paris"
    assert "".join(chain.stream({"question": "hard"})) == "I don't know."
    chunks = list(guard.stream("hard"))
    assert len(chunks) == 1 and _decision(chunks[0])["abstained"]


def test_with_config_and_input_schema(guard: AbstentionGuard) -> None:
    tagged = guard.with_config(tags=["mine"], run_name="my-guard")
    tracer = MemoryTracer()
    out = tagged.invoke("easy", config={"callbacks": [tracer]})
    assert not _decision(out)["abstained"]
    run = next(r for r in tracer.finished if r.name == "my-guard")
    assert "mine" in run.tags and "answered" in run.tags
    assert guard.get_input_schema() is not None


def test_batch_honours_max_concurrency(artifact: GuardArtifact) -> None:
    slow = ScriptedChatModel(script=SCRIPT, fingerprint="m-1", delay=0.05)
    g = AbstentionGuard(slow, artifact=artifact)
    inputs = ["easy", "hard"] * 4
    outs = g.batch(inputs, config={"max_concurrency": 2})
    assert [o.content for o in outs] == ["Paris", "I don't know."] * 4
    assert slow.max_active <= 2 and slow.calls == 8


def test_async_paths(artifact: GuardArtifact) -> None:
    slow = ScriptedChatModel(script=SCRIPT, fingerprint="m-1", delay=0.02)
    g = AbstentionGuard(slow, artifact=artifact)

    async def main() -> tuple[Any, ...]:
        one = await g.ainvoke("easy")
        many = await g.abatch(["hard", "easy", "hard"], config={"max_concurrency": 1})
        streamed = [c async for c in g.astream("hard")]
        return one, many, streamed

    one, many, streamed = asyncio.run(main())
    assert one.content == "Paris"
    assert [m.content for m in many] == ["I don't know.", "Paris", "I don't know."]
    assert slow.max_active == 1
    assert len(streamed) == 1 and _decision(streamed[0])["abstained"]


def test_callback_handler_and_tracer_see_the_decision(guard: AbstentionGuard) -> None:
    handler, tracer = EventRecorder(), MemoryTracer()
    guard.invoke("hard", config={"callbacks": [handler, tracer]})
    guard.invoke("easy", config={"callbacks": [handler, tracer]})
    events = [(name, data) for name, data, _, _ in handler.custom]
    assert [n for n, _ in events] == ["abstention", "abstention"]
    assert events[0][1]["abstained"] is True and events[1][1]["abstained"] is False
    assert set(events[0][1]) >= KEYS
    # the custom events come from inside the guard's own runs
    guard_runs = [rid for name, rid in handler.chain_starts if name == "AbstentionGuard"]
    assert [rid for _, _, rid, _ in handler.custom] == guard_runs
    # the guard's own runs carry tags and metadata (what LangSmith records)
    runs = [r for r in tracer.finished if r.name == "AbstentionGuard"]
    assert len(runs) == 2
    first, second = runs
    assert "abstained" in first.tags and "answered" not in first.tags
    assert "answered" in second.tags
    assert first.extra["metadata"]["abstention"]["abstained"] is True
    assert any(e.get("name") == "abstention" for e in first.events)


def test_astream_events_v2_carries_the_custom_event(guard: AbstentionGuard) -> None:
    prompt = ChatPromptTemplate.from_messages([("human", "{question}")])
    chain = prompt | guard | StrOutputParser()

    async def collect() -> list[dict[str, Any]]:
        return [e async for e in chain.astream_events({"question": "hard"}, version="v2")]

    events = asyncio.run(collect())
    custom = [e for e in events if e["event"] == "on_custom_event"]
    assert len(custom) == 1 and custom[0]["name"] == "abstention"
    assert custom[0]["data"]["abstained"] is True
    ends = [e for e in events if e["event"] == "on_chain_end" and e["name"] == "AbstentionGuard"]
    assert ends and _decision(ends[0]["data"]["output"])["abstained"] is True


def test_log_record(guard: AbstentionGuard, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="abstain_guard"):
        guard.invoke("hard")
    records = [r for r in caplog.records if r.name == "abstain_guard" and hasattr(r, "abstention")]
    assert records and records[-1].abstention["abstained"] is True  # type: ignore[attr-defined]
    assert "abstained" in records[-1].getMessage()


def test_langsmith_run_tree_gets_the_event(guard: AbstentionGuard) -> None:
    from langsmith.run_helpers import tracing_context
    from langsmith.run_trees import RunTree

    outer = RunTree(name="outer", run_type="chain", inputs={})
    with tracing_context(parent=outer, enabled=False):
        guard.invoke("hard")
    assert any(e.get("name") == "abstention" for e in (outer.events or []))


class ExplodingScorer(Scorer):
    kind: ClassVar[str] = "test_exploding"

    def score(self, response: ResponseLike) -> float:
        raise RuntimeError("scorer crashed")

    def get_state(self) -> ScorerState:
        return ScorerState(kind=self.kind)

    @classmethod
    def from_state(cls, state: ScorerState) -> Scorer:
        return cls()


register_scorer(ExplodingScorer)


def test_scoring_failure_abstains_and_records_why(model: BaseChatModel) -> None:
    art = GuardArtifact.from_calibration(
        scorer=ExplodingScorer(), calibration=CalibrationSet([1.0, 2.0, 3.0, 4.0], [1, 1, 0, 0])
    )
    g = AbstentionGuard(model, artifact=art, config=GuardConfig(participation=0.5))
    handler = EventRecorder()
    out = g.invoke("easy", config={"callbacks": [handler]})
    d = _decision(out)
    assert out.content == "I don't know." and d["abstained"] is True and d["score"] is None
    assert "RuntimeError: scorer crashed" in d["error"]
    assert handler.custom[0][1]["error"] == d["error"]
    assert out.response_metadata["withheld_response"]["content"] == "Paris"

    strict = AbstentionGuard(
        model, artifact=art, config=GuardConfig(participation=0.5, on_error="raise")
    )
    with pytest.raises(GuardError, match="scorer crashed"):
        strict.invoke("easy")


def test_unscorable_response_abstains(guard: AbstentionGuard) -> None:
    out = guard.invoke("empty")
    d = _decision(out)
    assert d["abstained"] and d["score"] is None and "ScoringError" in d["error"]
    # a guard placed after an output parser cannot score strings: fail closed
    g = AbstentionGuard(guard.runnable | StrOutputParser(), artifact=guard.artifact)
    d2 = _decision(g.invoke("easy"))
    assert d2["abstained"] and "not an AIMessage" in d2["error"]


def test_policy_score_raises_scoring_error(guard: AbstentionGuard) -> None:
    with pytest.raises(ScoringError):
        guard._policy.score("not a message")


def test_fingerprint_mismatch(artifact: GuardArtifact, tmp_path: Path) -> None:
    other = ScriptedChatModel(script=SCRIPT, fingerprint="m-2")
    with pytest.raises(ArtifactMismatchError, match="m-2"):
        AbstentionGuard(other, artifact=artifact)
    path = artifact.save(tmp_path / "a")
    with pytest.raises(ArtifactMismatchError):
        AbstentionGuard.from_artifact(path, other)
    # inside a chain, the last chat model is checked
    prompt = ChatPromptTemplate.from_messages([("human", "{q}")])
    with pytest.raises(ArtifactMismatchError):
        AbstentionGuard(prompt | other, artifact=artifact)
    # a model without a fingerprint cannot be verified: an error by default
    with pytest.raises(ArtifactMismatchError, match="no fingerprint"):
        AbstentionGuard(ScriptedChatModel(script=SCRIPT), artifact=artifact)
    g = AbstentionGuard.from_artifact(path, ScriptedChatModel(script=SCRIPT, fingerprint="m-1"))
    assert g.invoke("easy").content == "Paris"


def test_every_chat_model_is_checked_fallbacks_too(artifact: GuardArtifact) -> None:
    good = ScriptedChatModel(script=SCRIPT, fingerprint="m-1")
    other = ScriptedChatModel(script=SCRIPT, fingerprint="m-2")
    # the primary model of a fallback chain is checked, not only the last one
    with pytest.raises(ArtifactMismatchError, match="m-2"):
        AbstentionGuard(other.with_fallbacks([good]), artifact=artifact)
    with pytest.raises(ArtifactMismatchError, match="m-2"):
        AbstentionGuard(good.with_fallbacks([other]), artifact=artifact)
    AbstentionGuard(good.with_fallbacks([good.model_copy()]), artifact=artifact)


def test_opt_in_mismatch_is_recorded_in_the_guarantee(artifact: GuardArtifact) -> None:
    guard = AbstentionGuard(
        ScriptedChatModel(script=SCRIPT),
        artifact=artifact,
        config=GuardConfig(on_mismatch="warn"),
    )
    handler = EventRecorder()
    msg = guard.invoke("easy", config={"callbacks": [handler]})
    warnings = msg.response_metadata["abstention"]["guarantee"]["warnings"]
    assert any("no fingerprint" in w for w in warnings)
    (_, traced, _, _), *_ = handler.custom
    assert any("no fingerprint" in w for w in traced["guarantee"]["warnings"])
    # the artifact's own rule is not modified by a decision's warnings
    assert not any("fingerprint" in w for w in guard.decision_rule.guarantee.warnings)


class PreparingScorer(Scorer):
    """Like the geometry scorer: prepare() swaps the chat model for a configured copy."""

    kind: ClassVar[str] = "test_preparing"

    def score(self, response: ResponseLike) -> float:
        meta = response.response_metadata
        if not meta.get("prepared"):
            raise ScoringError("the model was not prepared")
        return 0.0

    def prepare(self, runnable: Any) -> Any:
        def install(m: BaseChatModel) -> BaseChatModel:
            script = {k: v for k, v in m.script.items()}  # type: ignore[attr-defined]
            return PreparedModel(script=script, fingerprint=m.fingerprint)  # type: ignore[attr-defined]

        return map_chat_models(runnable, install)

    def get_state(self) -> ScorerState:
        return ScorerState(kind=self.kind)

    @classmethod
    def from_state(cls, state: ScorerState) -> Scorer:
        return cls()


class PreparedModel(ScriptedChatModel):
    def _answer(self, messages: list[Any]) -> AIMessage:
        msg = super()._answer(messages)
        return msg.model_copy(
            update={"response_metadata": {**msg.response_metadata, "prepared": 1}}
        )


def test_prepare_is_applied(model: ScriptedChatModel) -> None:
    art = GuardArtifact.from_calibration(
        scorer=PreparingScorer(), calibration=CalibrationSet([0.0, 1.0, 2.0, 3.0], [1, 1, 0, 0])
    )
    prompt = ChatPromptTemplate.from_messages([("human", "{q}")])
    g = AbstentionGuard(prompt | model, artifact=art, config=GuardConfig(participation=0.5))
    assert isinstance(g.bound_runnable.last, PreparedModel)  # type: ignore[attr-defined]
    assert g.runnable.last is model  # type: ignore[attr-defined]  # the original is untouched
    out = g.invoke({"q": "easy"})
    assert _decision(out)["abstained"] is False and out.content == "Paris"


def test_core_import_needs_no_local_extra_and_no_langchain_agents() -> None:
    import subprocess
    import sys

    code = (
        "import sys, abstain_guard\n"
        "from abstain_guard import *\n"
        "core_free = ('torch', 'transformers', 'xgboost', 'sklearn', 'tqdm', 'langchain.agents')\n"
        "bad = [m for m in core_free if m in sys.modules]\n"
        "assert not bad, bad\n"
        "sys.modules['langchain.agents.middleware'] = None\n"
        "try:\n"
        "    abstain_guard.AbstentionMiddleware\n"
        "except ImportError as e:\n"
        "    assert 'agents' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('expected ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_monitor_fitted_for_another_rule_is_refused(
    model: ScriptedChatModel, artifact: GuardArtifact
) -> None:
    """Same calibration set, another rule: the monitor's tests would watch a threshold and
    target the guard does not use (only the calibration checksum was compared before)."""
    monitor = GuardMonitor(seed=0).fit_artifact(artifact, GuardConfig(participation=0.8))
    with pytest.raises(ArtifactMismatchError, match="another decision rule"):
        AbstentionGuard(
            model, artifact=artifact, config=GuardConfig(participation=0.9), monitor=monitor
        )
    # the rule it was fitted for is accepted
    AbstentionGuard(
        model, artifact=artifact, config=GuardConfig(participation=0.8), monitor=monitor
    )


def test_a_pooled_monitor_under_per_group_rules_is_refused(model: ScriptedChatModel) -> None:
    rng = np.random.default_rng(1)
    scores = rng.uniform(1.0, 3.0, size=400)
    groups = np.array(["a", "b"] * 200)
    art = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(
            scores, rng.uniform(size=400) > (scores - 1.0) / 2.0, groups=groups
        ),
        model_fingerprint="m-1",
    )
    grouped = GuardConfig(participation=0.8, group_by="tenant", group_targets={"a": 0.6})
    pooled = GuardMonitor(seed=0).fit_artifact(art, GuardConfig(participation=0.8))
    with pytest.raises(ArtifactMismatchError, match="pooled rules"):
        AbstentionGuard(model, artifact=art, config=grouped, monitor=pooled)
    other = GuardMonitor(seed=0).fit_artifact(
        art, GuardConfig(participation=0.8, group_by="tenant", group_targets={"a": 0.7})
    )
    with pytest.raises(ArtifactMismatchError, match="group 'a'"):
        AbstentionGuard(model, artifact=art, config=grouped, monitor=other)
