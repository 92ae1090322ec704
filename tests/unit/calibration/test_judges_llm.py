"""LLM judges, the statement rewriter, the paper pipeline and the judgment cache, with scripted
chat models (real ``BaseChatModel`` subclasses returning fixed replies)."""

from __future__ import annotations

import gc
import re
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import Field, PrivateAttr

from abstain_guard.calibration.building.judges import (
    Judge,
    Judgment,
    LexicalJudge,
    LLMJudge,
    PaperPipelineJudge,
    SimilarityJudge,
    StatementRewriter,
    make_judge,
)
from abstain_guard.calibration.building.judges.cache import CachedJudge, JudgmentCache, judgment_key
from abstain_guard.calibration.building.judges.llm import parse_verdict
from abstain_guard.errors import JudgeError


class ScriptedChat(BaseChatModel):
    """Replies with ``reply(prompt_text)``; raises for the first ``fail_first`` calls, or
    always when ``fail_when`` matches the prompt. Records every prompt it sees."""

    replies: dict[str, str] = Field(default_factory=dict)
    default: str = '{"correct": false, "rationale": "different"}'
    fail_first: int = 0
    fail_when: str | None = None
    label: str = "scripted"
    _calls: list[str] = PrivateAttr(default_factory=list)
    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    @property
    def _llm_type(self) -> str:
        return "scripted-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"label": self.label}

    @property
    def calls(self) -> list[str]:
        return self._calls

    def _reply(self, text: str) -> str:
        for pattern, reply in self.replies.items():
            if re.search(pattern, text):
                return reply
        return self.default

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        text = "\n".join(str(m.content) for m in messages)
        with self._lock:
            self._calls.append(text)
            n = len(self._calls)
        if n <= self.fail_first or (self.fail_when and re.search(self.fail_when, text)):
            raise ConnectionError("scripted API outage")
        return ChatResult(
            generations=[ChatGeneration(message=AIMessage(content=self._reply(text)))]
        )


class ToolChat(ScriptedChat):
    """Supports ``with_structured_output`` by returning a tool call with fixed arguments."""

    verdict: bool = True

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        return self.bind(structured=True)

    def _generate(self, messages, stop=None, run_manager=None, **kwargs):  # type: ignore[override]
        if not kwargs.get("structured"):
            return super()._generate(messages, stop, run_manager, **kwargs)
        self._calls.append("structured")
        call = {
            "name": "Verdict",
            "args": {"correct": self.verdict, "rationale": "tool"},
            "id": "1",
        }
        return ChatResult(
            generations=[ChatGeneration(message=AIMessage(content="", tool_calls=[call]))]
        )


YES = '{"correct": true, "rationale": "same fact"}'
NO = '{"correct": false, "rationale": "different fact"}'


def _llm(model: BaseChatModel, **kw: Any) -> LLMJudge:
    return LLMJudge(model, backoff_initial=0.0, **kw)


# --- the LLM judge ---------------------------------------------------------------------------


def test_parse_verdict_forms() -> None:
    assert parse_verdict('Sure! {"correct": true, "rationale": "ok"}').correct is True
    assert parse_verdict('{"correct": "false"}').correct is False
    assert parse_verdict("Verdict: INCORRECT - wrong city").correct is False
    assert parse_verdict("**Correct**. Lima is the capital.").correct is True
    # a JSON reply cut off by the token budget: the field, not the key's name, decides
    assert parse_verdict('{"correct": false, "rationale": "Lyon is not the cap').correct is False
    assert parse_verdict('{"correct": true, "rational').correct is True
    assert parse_verdict("The proposed answer is not correct.").correct is False
    assert parse_verdict("That isn't right").correct is False
    with pytest.raises(ValueError):
        parse_verdict("Let me think about it.")


def test_llm_judge_text_mode_prompt_and_verdict() -> None:
    model = ScriptedChat(replies={r"Proposed answer: Lima": YES})
    judge = _llm(model)
    assert judge.structured is False  # BaseChatModel without bind_tools
    j = judge.judge("Capital of Peru?", ["Lima", "Ciudad de los Reyes"], "Lima")
    assert j == Judgment(True, 1.0, "same fact")
    assert "Reference answer(s): Lima | Ciudad de los Reyes" in model.calls[0]
    assert judge.judge("Capital of Peru?", ["Lima"], "Cusco").correct is False
    j = judge.judge("Where?", ["B", "library"], "B", choices=("bank", "library"))
    assert "Options: A) bank; B) library" in model.calls[-1]


def test_llm_judge_structured_output() -> None:
    model = ToolChat(verdict=True)
    judge = _llm(model)
    assert judge.structured is True
    j = judge.judge("q", ["a"], "b")
    assert j.correct is True and j.rationale == "tool"
    assert model.calls == ["structured"]


def test_llm_judge_retries_then_succeeds() -> None:
    model = ScriptedChat(default=YES, fail_first=2)
    j = _llm(model, retries=3).judge("q", ["a"], "a")
    assert j.correct is True
    assert len(model.calls) == 3


def test_llm_judge_failing_api_gives_none_not_incorrect() -> None:
    model = ScriptedChat(fail_when=".")
    j = _llm(model, retries=2).judge("q", ["a"], "a")
    assert j.correct is None and j.score is None
    assert "ConnectionError" in j.rationale and "2 tries" in j.rationale
    assert len(model.calls) == 2


def test_llm_judge_unparseable_reply_is_retried_then_none() -> None:
    model = ScriptedChat(default="Hmm, hard to say.")
    j = _llm(model, retries=3).judge("q", ["a"], "a")
    assert j.correct is None and "no verdict" in j.rationale
    assert len(model.calls) == 3


def test_llm_judge_identity_depends_on_model_and_prompt() -> None:
    a = _llm(ScriptedChat(label="a"))
    b = _llm(ScriptedChat(label="b"))
    assert a.identity != b.identity
    assert a.identity == _llm(ScriptedChat(label="a")).identity
    assert "scripted-chat" in a.identity


def test_llm_judge_many_concurrent_in_order() -> None:
    model = ScriptedChat(replies={r"Proposed answer: yes\d": YES})
    judge = _llm(model)
    inputs = [("q", ["g"], f"yes{i}" if i % 2 else f"no{i}") for i in range(12)]
    out = judge.judge_many(inputs, max_concurrency=4, progress=False)
    assert [j.correct for j in out] == [bool(i % 2) for i in range(12)]
    assert len(model.calls) == 12


def test_statement_rewriter() -> None:
    model = ScriptedChat(default='Statement: "The capital of Peru is Lima."\nextra')
    rw = StatementRewriter(model, backoff_initial=0.0)
    assert rw.rewrite("Capital of Peru?", "Lima") == "The capital of Peru is Lima."
    failing = StatementRewriter(ScriptedChat(fail_when="."), retries=2, backoff_initial=0.0)
    assert failing.rewrite("q", "a") is None


# --- the paper pipeline ----------------------------------------------------------------------


class CountingJudge(Judge):
    """Stage-1 stand-in: accepts when the prediction text is in the gold list; counts calls."""

    name = "counting"

    def __init__(self, verdict: Callable[[Sequence[str], str], bool] | None = None) -> None:
        self.verdict = verdict or (lambda gold, pred: pred in gold)
        self.calls: list[tuple[tuple[str, ...], str]] = []

    def judge(self, question, gold_answers, prediction, *, choices=()):  # type: ignore[override]
        self.calls.append((tuple(gold_answers), prediction))
        ok = self.verdict(gold_answers, prediction)
        return Judgment(ok, float(ok), "stage-1 stand-in")


def _pipeline(a: BaseChatModel, b: BaseChatModel, **kw: Any) -> tuple[PaperPipelineJudge, Any]:
    sim = CountingJudge()
    return PaperPipelineJudge(sim, judges=(_llm(a, retries=1), _llm(b, retries=1)), **kw), sim


def test_pipeline_stage1_accepts_without_llm_calls() -> None:
    a, b = ScriptedChat(default=YES), ScriptedChat(default=YES)
    judge, _ = _pipeline(a, b)
    j = judge.judge("q", ["Lima"], "Lima")
    assert j.correct is True and "stage 1 accepted" in j.rationale
    assert a.calls == [] and b.calls == []


@pytest.mark.parametrize(
    ("reply_a", "reply_b", "expected"),
    [
        (YES, YES, True),  # both agree → flipped to correct
        (YES, NO, False),  # disagreement → stays incorrect
        (NO, YES, False),
        (NO, NO, False),
    ],
)
def test_pipeline_two_judge_agreement_rule(reply_a: str, reply_b: str, expected: bool) -> None:
    a, b = ScriptedChat(default=reply_a), ScriptedChat(default=reply_b)
    judge, _ = _pipeline(a, b)
    j = judge.judge("Capital of Peru?", ["Lima"], "It is Lima, the city of kings")
    assert j.correct is expected, j.rationale
    assert len(a.calls) == 1 and len(b.calls) == 1


def test_pipeline_judge_that_raises_gives_none() -> None:
    a, b = ScriptedChat(default=YES), ScriptedChat(fail_when=".")
    judge, _ = _pipeline(a, b)
    j = judge.judge("q", ["Lima"], "the city of kings")
    assert j.correct is None and "incomplete" in j.rationale
    # a definite "incorrect" from the other judge cannot be flipped by any verdict: stays False
    c = ScriptedChat(default=NO)
    judge2, _ = _pipeline(c, b)
    assert judge2.judge("q", ["Lima"], "the city of kings").correct is False


def test_pipeline_stage2_judge_raising_an_exception_gives_none() -> None:
    class Broken(Judge):
        name = "broken"

        def judge(self, question, gold_answers, prediction, *, choices=()):  # type: ignore[override]
            raise RuntimeError("judge crashed")

    judge = PaperPipelineJudge(CountingJudge(), judges=(_llm(ScriptedChat(default=YES)), Broken()))
    out = judge.judge_many([("q", ["Lima"], "Lima"), ("q", ["Lima"], "Cusco")], progress=False)
    assert [j.correct for j in out] == [True, None]
    assert "incomplete" in out[1].rationale


def test_pipeline_rewrites_statements_for_stage1() -> None:
    rewriter_model = ScriptedChat(
        replies={r"Answer: (Lima|lima city)\b": "Peru's capital is Lima."}, default="Other."
    )
    a, b = ScriptedChat(default=NO), ScriptedChat(default=NO)
    judge, sim = _pipeline(a, b, rewriter=StatementRewriter(rewriter_model, backoff_initial=0.0))
    j = judge.judge("Capital of Peru?", ["Lima"], "lima city")
    assert j.correct is True and "rewritten statements" in j.rationale
    assert sim.calls == [(("Peru's capital is Lima.",), "Peru's capital is Lima.")]
    assert a.calls == []
    assert "rewriter(" in judge.identity


def test_pipeline_judge_many_mixes_stages_and_counts_none() -> None:
    a = ScriptedChat(default=YES)
    b = ScriptedChat(
        replies={r"Proposed answer: flip": YES, r"Proposed answer: keep": NO},
        fail_when=r"Proposed answer: down",
    )
    judge, _ = _pipeline(a, b)
    inputs = [
        ("q", ["Lima"], "Lima"),  # stage 1
        ("q", ["Lima"], "flip"),  # both agree
        ("q", ["Lima"], "keep"),  # b disagrees
        ("q", ["Lima"], "down"),  # b's API fails
    ]
    out = judge.judge_many(inputs, max_concurrency=2, progress=False)
    assert [j.correct for j in out] == [True, True, False, None]
    assert sum(j.correct is None for j in out) == 1
    assert len(a.calls) == 3


def test_pipeline_stage1_uses_the_batched_similarity() -> None:
    class Encoder:
        calls = 0

        def encode(self, texts, **kwargs):
            Encoder.calls += 1
            return np.array([[1.0, 0.0] if "Lima" in t else [0.0, 1.0] for t in texts])

    sim = SimilarityJudge(encoder=Encoder())
    a, b = ScriptedChat(default=YES), ScriptedChat(default=YES)
    judge = PaperPipelineJudge(sim, judges=(_llm(a), _llm(b)))
    out = judge.judge_many(
        [("q", ["Lima"], "It is Lima"), ("q", ["Lima"], "Cusco")], progress=False
    )
    assert [j.correct for j in out] == [True, True]
    assert "stage 1 accepted" in out[0].rationale and "agree" in out[1].rationale
    assert Encoder.calls == 1 and len(a.calls) == 1 and len(b.calls) == 1


def test_make_judge_builds_llm_and_paper_without_loading() -> None:
    models = {"a": ScriptedChat(label="a"), "b": ScriptedChat(label="b")}
    llm = make_judge({"name": "llm", "model": "a", "retries": 2}, chat_models=models)
    assert isinstance(llm, LLMJudge) and llm.retries == 2
    paper = make_judge(
        {"name": "paper", "similarity": {"name": "lexical"}, "judges": ["a", "b"], "rewriter": "a"},
        chat_models=models,
    )
    assert isinstance(paper, PaperPipelineJudge) and len(paper.judges) == 2
    assert isinstance(paper.similarity, LexicalJudge) and paper.rewriter is not None
    default_paper = make_judge("paper", chat_models=models)
    assert isinstance(default_paper, PaperPipelineJudge)
    with pytest.raises(JudgeError, match="available: a, b"):
        make_judge({"name": "paper", "judges": ["a", "c"]}, chat_models=models)
    with pytest.raises(JudgeError, match="does not exist"):
        make_judge({"name": "similarity", "model_path": "/no/such/model"})


# --- the cache -------------------------------------------------------------------------------


def test_judgment_key() -> None:
    k = judgment_key("q", ["a", "b"], "p")
    assert k == judgment_key("q", ("a", "b"), "p")
    assert k != judgment_key("q", ["b", "a"], "p")
    assert k != judgment_key("q", ["a", "b"], "p", ("x", "y"))
    assert len(k) == 64


def test_second_run_makes_zero_judge_calls(tmp_path: Path) -> None:
    db = tmp_path / "cache" / "judgments.sqlite"
    model = ScriptedChat(replies={r"Proposed answer: yes": YES})
    inputs = [("q", ["g"], f"yes {i}" if i % 3 else f"no {i}") for i in range(9)]
    inputs.append(inputs[0])  # a duplicate is judged once
    first = CachedJudge(_llm(model), JudgmentCache(db)).judge_many(inputs, progress=False)
    assert len(model.calls) == 9
    model.calls.clear()
    again = CachedJudge(_llm(model), JudgmentCache(db))  # a fresh process would do the same
    second = again.judge_many(inputs, progress=False)
    assert second == first
    assert model.calls == [] and again.hits == 10 and again.misses == 0
    assert again.judge(*inputs[1]) == first[1] and model.calls == []
    # another judge identity does not see these entries
    other = CachedJudge(_llm(ScriptedChat(label="other", default=YES)), JudgmentCache(db))
    other.judge_many(inputs[:2], progress=False)
    assert other.misses == 2


def test_failed_judgments_are_not_cached_and_retried_later(tmp_path: Path) -> None:
    db = tmp_path / "j.sqlite"
    down = ScriptedChat(fail_when=".")
    judge = CachedJudge(_llm(down, retries=1), JudgmentCache(db))
    assert judge.judge_many([("q", ["a"], "a")], progress=False)[0].correct is None
    up = ScriptedChat(default=YES)
    judge = CachedJudge(_llm(up, retries=1), JudgmentCache(db))
    assert judge.judge_many([("q", ["a"], "a")], progress=False)[0].correct is True
    assert len(up.calls) == 1


def test_cache_concurrent_writers_one_process(tmp_path: Path) -> None:
    cache = JudgmentCache(tmp_path / "c.sqlite")
    judge = CachedJudge(_llm(ScriptedChat(default=YES)), cache)
    inputs = [("q", ["g"], f"p{i}") for i in range(40)]
    judge.judge_many(inputs, max_concurrency=8, progress=False)

    def writer(t: int) -> None:
        for i in range(25):
            cache.put("w", f"{t}-{i}", Judgment(bool(i % 2), 0.5, "x"))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert cache.count(judge.identity) == 40 and cache.count("w") == 100
    assert cache.get("w", "3-24") == Judgment(False, 0.5, "x")


def test_cache_survives_an_interrupted_write(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    cache = JudgmentCache(db)
    cache.put("j", "k1", Judgment(True, 1.0, "kept"))
    # a writer that dies mid-transaction (no commit) leaves the database as it was
    raw = sqlite3.connect(str(db), isolation_level=None)
    raw.execute("BEGIN IMMEDIATE")
    lost = '{"correct": true, "score": 1.0, "rationale": "lost"}'
    raw.execute("INSERT INTO kv VALUES ('j', 'k2', ?)", [lost])
    del raw  # closed without COMMIT, like a killed process
    gc.collect()
    reopened = JudgmentCache(db)
    assert reopened.get("j", "k1") == Judgment(True, 1.0, "kept")
    assert reopened.get("j", "k2") is None
    reopened.put("j", "k2", Judgment(False, 0.0, "new"))
    assert len(reopened) == 2


def test_cache_rejects_a_corrupt_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(JudgeError, match="delete it"):
        JudgmentCache(bad)


def test_cached_judge_wraps_rule_judges(tmp_path: Path) -> None:
    judge = CachedJudge(LexicalJudge(), JudgmentCache(tmp_path / "l.sqlite"))
    assert judge.identity == LexicalJudge().identity and judge.name == "lexical"
    assert judge.judge("q", ["Lima"], "Lima!").correct is True
    assert judge.judge("q", ["Lima"], "Lima!").correct is True
    assert (judge.hits, judge.misses) == (1, 1)
