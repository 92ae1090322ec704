"""Checking answers the guard did not generate: ``AbstentionGuard.check`` / ``acheck`` /
``check_batch`` / ``acheck_batch`` and ``abstain-guard score``, on a guard calibrated on a
tiny random-weight model (perplexity) and on a black-box guard over a deterministic fake.

Why the bits of a replayed check match: ``check`` replays the answer's token ids behind the
prompt ids the deployment builds, one sequence per forward pass, split at the same prefix,
on one BLAS thread -- the computation calibration ran to store each calibration score
(``replay_as_deployed``). Same kernels, same inputs, same order of operations: the same
float32 bits, so the check's score of a calibration answer IS its stored score. The guard's
own live score comes from KV-cached decoding, whose products have other row counts; where
BLAS rows do not depend on the row count (the embedded model on its calibration machine)
that is bitwise too, but at the tiny model's widths it moves the float32 last bits (about
1e-6 in perplexity here), so the live comparison is of decisions, with scores within the
library's stated tolerance.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _core_fakes import ScriptedChatModel
from _pipeline_fakes import ITEMS, HashJudge, _config, _judges
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from tiny_models import tiny_chat_model

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.cli import main
from abstain_guard.contract.kernels import STATED_TOLERANCE
from abstain_guard.errors import ArtifactMismatchError, GivenAnswerError
from abstain_guard.guard import chains
from abstain_guard.guard.chains import load_guard_chain
from abstain_guard.guard.policy import decision_of
from abstain_guard.scorers import BlackBoxScorer, PerplexityScorer, Scorer, ScorerState
from abstain_guard.scorers._similarity_graph import cosine_similarities, equivalent_by_threshold


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A perplexity guard calibrated on the tiny llama, its chain and 6 calibration answers
    generated again by the guard itself."""
    tmp = tmp_path_factory.mktemp("answer_check")
    model = tiny_chat_model("llama", seed=0)
    calibrate(
        ITEMS,
        tmp / "guard",
        config=_config(tmp, "guard"),
        model=model,
        judges=_judges(tmp, "guard", HashJudge()),
        progress=False,
    )
    artifact = GuardArtifact.load(tmp / "guard")
    chain, guard, _ = load_guard_chain(artifact, GuardConfig(participation=0.5), model=model)
    by_id = {it.id: it for it in ITEMS}
    questions = [by_id[i].question for i in artifact.metadata["calibration_ids"][:6]]
    live = [chain.invoke({"question": q}) for q in questions]
    return {
        "tmp": tmp,
        "model": model,
        "artifact": artifact,
        "chain": chain,
        "guard": guard,
        "questions": questions,
        "inputs": [chain.first.invoke({"question": q}) for q in questions],
        "live": live,
    }


def _answer(message: AIMessage) -> tuple[str, dict[str, Any]]:
    """The text and metadata of the answer a guard's message answered or withheld."""
    withheld = message.response_metadata.get("withheld_response")
    if withheld:
        return withheld["content"], withheld["response_metadata"]
    return str(message.content), dict(message.response_metadata)


def test_check_scores_the_guards_own_answers_as_calibration_stored_them(tiny) -> None:
    guard, artifact = tiny["guard"], tiny["artifact"]
    compared = 0
    for i, (x, live) in enumerate(zip(tiny["inputs"], tiny["live"], strict=True)):
        checked = guard.check(x, live)  # the guard's message: its token ids are replayed
        own = decision_of(live)
        assert own is not None
        assert checked.score == artifact.scores[i]  # bitwise: calibration's computation
        assert abs(checked.score - own.score) <= STATED_TOLERANCE * max(1.0, own.score)
        assert (checked.scorer, checked.threshold, checked.mode) == (
            own.scorer,
            own.threshold,
            own.mode,
        )
        assert checked.guarantee == own.guarantee
        assert checked.model == artifact.model_fingerprint and own.model is None
        if abs(own.score - own.threshold) > STATED_TOLERANCE * max(1.0, own.score):
            assert checked.abstained == own.abstained and checked.reason == own.reason
            compared += 1
    assert compared >= 4


def test_a_text_answer_is_tokenized_as_generated_and_scores_the_same(tiny) -> None:
    guard, tokenizer = tiny["guard"], tiny["model"].tokenizer
    done = 0
    for x, live in zip(tiny["inputs"], tiny["live"], strict=True):
        text, meta = _answer(live)
        if tokenizer.encode(text, add_special_tokens=False) != meta["token_ids"]:
            continue  # a special token the text does not show
        logged = {"answer": text, "finish_reason": meta["finish_reason"]}
        assert guard.check(x, logged) == guard.check(x, live)
        done += 1
    assert done >= 3


def test_batch_and_async_checks_decide_as_check(tiny) -> None:
    guard = tiny["guard"]
    pairs = list(zip(tiny["inputs"], tiny["live"], strict=True))
    one_by_one = [guard.check(x, a) for x, a in pairs]
    assert guard.check_batch(pairs, {"max_concurrency": 3}) == one_by_one
    assert asyncio.run(guard.acheck_batch(pairs, {"max_concurrency": 3})) == one_by_one
    assert asyncio.run(guard.acheck(*pairs[0])) == one_by_one[0]
    mixed = guard.check_batch([pairs[0], (pairs[0][0], "zz")], return_exceptions=True)
    assert mixed[0] == one_by_one[0] and isinstance(mixed[1], ArtifactMismatchError)


def test_answers_the_deployment_could_not_have_generated_are_refused(tiny) -> None:
    guard, x = tiny["guard"], tiny["inputs"][0]
    text, meta = _answer(tiny["live"][0])
    with pytest.raises(ArtifactMismatchError, match="not the calibrated model's greedy choice"):
        guard.check(x, {"answer": "zz", "finish_reason": "length"})  # another model's answer
    with pytest.raises(ArtifactMismatchError, match="at most 6"):
        guard.check(x, {"answer": text + "zz", "finish_reason": "length"})  # over the budget
    if meta["finish_reason"] == "length":  # cut at the budget: no end token after it
        with pytest.raises(ArtifactMismatchError, match="greedy choice"):
            guard.check(x, {"answer": text, "finish_reason": "stop"})
    warned = AbstentionGuard(
        guard.runnable,
        artifact=tiny["artifact"],
        config=GuardConfig(participation=0.5, on_mismatch="warn"),
    ).check(x, "zz")
    assert any("greedy choice" in w for w in warned.guarantee.warnings)


def test_a_scorer_that_cannot_score_a_given_answer_is_refused_by_name(tiny) -> None:
    class Constant(Scorer):
        kind = "constant_for_check_test"

        def score(self, response: Any) -> float:
            return 0.0

        def get_state(self) -> ScorerState:
            return ScorerState(kind=self.kind)

        @classmethod
        def from_state(cls, state: ScorerState) -> Scorer:
            return cls()

    cal = CalibrationSet(np.linspace(0, 1, 50), np.arange(50) % 2 == 0)
    artifact = GuardArtifact.from_calibration(scorer=Constant(), calibration=cal)
    guard = AbstentionGuard(ScriptedChatModel(), artifact=artifact)
    with pytest.raises(GivenAnswerError, match="constant_for_check_test") as err:
        guard.check("Capital of France?", "Paris")
    assert "perplexity" in str(err.value) and "discrete_semantic_entropy" in str(err.value)
    # an API model cannot re-read an answer: a likelihood scorer needs the local model
    api = AbstentionGuard(
        ScriptedChatModel(),
        artifact=GuardArtifact.from_calibration(scorer=PerplexityScorer(), calibration=cal),
    )
    with pytest.raises(GivenAnswerError, match="ScriptedChatModel cannot re-read"):
        api.check("Capital of France?", "Paris")


# --- black-box: the given answer is the first of the k samples ---------------------------


class Fake(BaseChatModel):
    """Every sample of an "easy" question says Paris; each of a hard one says something
    new (counted per model): deterministic scores whatever order samples come back in."""

    temperature: float = 0.0
    calls: list[int]

    @property
    def _llm_type(self) -> str:
        return "check-fake"

    def _generate(self, messages: list[BaseMessage], *a: Any, **k: Any) -> ChatResult:
        self.calls.append(1)
        easy = "easy" in str(messages[-1].content)
        text = "Paris" if easy else f"guess {len(self.calls)}"
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])


class HashSimilarity:
    """Embeddings from each text's hash (no model loaded)."""

    kind, name, digest = "embedding", "hash-embedder", "0" * 64

    def record(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "digest": self.digest}

    def embeddings(self, texts: Any) -> np.ndarray:
        seeds = [int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) for t in texts]
        return np.asarray([np.random.default_rng(s).normal(size=16) for s in seeds])

    def similarities(self, texts: Any) -> np.ndarray:
        return cosine_similarities(self.embeddings(texts))

    def equivalences(self, question: str, texts: Any, threshold: float) -> np.ndarray:
        return equivalent_by_threshold(self.similarities(texts), threshold)


def _blackbox(primary: str = "first") -> AbstentionGuard:
    similarity: Any = HashSimilarity()
    scorer = BlackBoxScorer(num_samples=4, temperature=0.7, primary=primary, similarity=similarity)
    cal = CalibrationSet(np.linspace(0.0, 1.5, 40), np.linspace(0.0, 1.5, 40) < 0.7)
    artifact = GuardArtifact.from_calibration(scorer=scorer, calibration=cal)
    return AbstentionGuard(Fake(calls=[]), artifact=artifact, config={"participation": 0.5})


def test_a_black_box_check_decides_as_the_guard_on_its_own_answers() -> None:
    guard = _blackbox()
    for question in ("an easy one", "a hard one"):
        own = guard.invoke(question)
        checked = guard.check(question, own)  # its answer beside 3 fresh samples
        assert checked.score == decision_of(own).score  # type: ignore[union-attr]
        assert checked.abstained == decision_of(own).abstained  # type: ignore[union-attr]
        assert asyncio.run(guard.acheck(question, own)).score == checked.score
    assert guard.check("an easy one", "Lyon").score > 0  # a given answer is a sample


def test_the_medoid_rule_cannot_check_a_given_answer() -> None:
    with pytest.raises(GivenAnswerError, match="medoid"):
        _blackbox("medoid").check("an easy one", "Paris")


# --- abstain-guard score ------------------------------------------------------------------


def test_score_writes_one_decision_per_line_and_refuses_what_differs(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chains, "load_chat_model", lambda *a, **k: tiny["model"])
    artifact, guard = tiny["artifact"], tiny["guard"]
    system = artifact.metadata["deployment"]["prompts"]["open"]["system_prompt"]
    rows = []
    for i, (q, live) in enumerate(zip(tiny["questions"], tiny["live"], strict=True)):
        _, meta = _answer(live)
        row = {"id": f"a{i}", "question": q, "answer": _answer(live)[0]}
        rows.append({**row, "token_ids": meta["token_ids"], "system_prompt": system})
    rows.append({"id": "other-model", "question": "Q?", "answer": "x", "model_fingerprint": "m"})
    rows.append({"id": "other-prompt", "question": "Q?", "answer": "x", "system_prompt": None})
    rows.append({"id": "not-greedy", "question": tiny["questions"][0], "answer": "zz"})
    data, out = tmp_path / "answers.jsonl", tmp_path / "decisions.jsonl"
    lines = [json.dumps(r) for r in rows]
    data.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    assert main(["score", "--artifact", str(tiny["tmp"] / "guard"), "--data", str(data),
                 "--out", str(out), "--config", str(_guard_config(tmp_path)),
                 "--batch-size", "4"]) == 0  # fmt: skip
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["id"] for w in written] == ["a0", "a1", "3", *[r["id"] for r in rows[2:]]]
    by_id = {w["id"]: w["decision"] for w in written}
    for i, (x, live) in enumerate(zip(tiny["inputs"], tiny["live"], strict=True)):
        assert by_id[f"a{i}"] == guard.check(x, live).to_dict()  # the guard's check
        assert by_id[f"a{i}"]["model"] == artifact.model_fingerprint
    refused = {k: v for k, v in by_id.items() if v["reason"] == "answer refused"}
    assert sorted(refused) == ["3", "not-greedy", "other-model", "other-prompt"]
    assert all(v["abstained"] and v["score"] is None for v in refused.values())
    assert refused["3"]["error"].startswith("InvalidInputError: line 3 is not JSON")
    assert "generated by model 'm'" in refused["other-model"]["error"]
    assert "system prompt None" in refused["other-prompt"]["error"]
    assert "greedy choice" in refused["not-greedy"]["error"]


def _guard_config(tmp_path: Path) -> Path:
    path = tmp_path / "guard.json"
    path.write_text(json.dumps({"participation": 0.5}))
    return path
