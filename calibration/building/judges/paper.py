"""The paper's correctness pipeline (appendix B): answers and gold answers rewritten as
statements (:class:`StatementRewriter`), a similarity judge on the statements, then LLM judges
re-judge its rejections and flip them only if all agree (:class:`PaperPipelineJudge`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from langchain_core.language_models import BaseChatModel
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda

from abstain_guard.errors import JudgeError

from .base import Judge, JudgeInput, Judgment, unpack_input
from .lexical import refusal_verdict
from .llm import (
    chat_model_identity,
    prompt_hash,
    with_retry,
)

logger = logging.getLogger(__name__)

DEFAULT_REWRITE_SYSTEM = (
    "You rewrite a question and its answer as one short declarative sentence that states the "
    "answer as a fact. Keep the answer's content exactly; do not correct it, add facts, or "
    "comment. Output only the sentence."
)
DEFAULT_REWRITE_HUMAN = "Question: {question}\nAnswer: {answer}\nStatement:"


class StatementRewriter:
    """Rewrite ``(question, answer)`` as one declarative statement with a chat model
    (``"Peru's capital is Lima."``), the optional first step of the paper's pipeline.
    Retries with backoff; :meth:`rewrite` returns None when the model still fails."""

    def __init__(
        self,
        chat_model: BaseChatModel,
        prompt: Any = None,
        retries: int = 3,
        *,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
    ) -> None:
        self.chat_model = chat_model
        self.prompt = prompt or ChatPromptTemplate.from_messages(
            [("system", DEFAULT_REWRITE_SYSTEM), ("human", DEFAULT_REWRITE_HUMAN)]
        )
        self.retries = retries
        self._chain = with_retry(
            self.prompt | chat_model | StrOutputParser() | RunnableLambda(_clean_statement),
            retries,
            backoff_initial,
            backoff_max,
        )

    @property
    def identity(self) -> str:
        """Model identity + prompt hash (part of the pipeline judge's identity)."""
        return (
            f"rewriter(model={chat_model_identity(self.chat_model)!r}, "
            f"prompt={prompt_hash(repr(self.prompt))!r})"
        )

    def rewrite(self, question: str, answer: str) -> str | None:
        """The statement, or None when the model failed after its retries."""
        try:
            return str(self._chain.invoke({"question": question, "answer": answer}))
        except Exception as exc:
            logger.warning("statement rewriting failed after %d tries: %r", self.retries, exc)
            return None


def _clean_statement(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        raise ValueError("the rewriter returned an empty statement")
    line = re.sub(r"^(?:statement\s*:\s*)", "", lines[0], flags=re.I).strip().strip('"').strip()
    if not line:
        raise ValueError("the rewriter returned an empty statement")
    return line


class PaperPipelineJudge(Judge):
    """The paper's correctness pipeline (appendix B), any stage swappable.

    Stage 1: the prediction and the gold answer(s) are rewritten as statements (when a
    ``rewriter`` is given; the first ``max_gold_statements`` aliases) and ``similarity`` accepts
    the answer when it judges the statements alike (0.8 cosine by default). Stage 2: each
    stage-1 rejection is re-judged on the original texts by every judge in ``judges`` (two in
    the paper) and flipped to correct only if **all** say correct. A stage-2 judge that could
    not judge (None) makes the result None (excluded and counted), unless another stage-2
    judge already said incorrect — then no verdict could flip it and it stays incorrect.
    A refusal (:func:`refusal_of`) is incorrect (flagged ``refusal``) before any stage runs.
    """

    name = "paper"
    #: Bumped whenever verdicts change, so cached judgments of an older judge are not reused.
    version: ClassVar[int] = 2
    concurrent = True

    def __init__(
        self,
        similarity: Judge,
        judges: Sequence[Judge] = (),
        rewriter: StatementRewriter | None = None,
        *,
        max_gold_statements: int = 3,
    ) -> None:
        if not judges:
            raise JudgeError("PaperPipelineJudge needs at least one stage-2 judge (two in paper)")
        self.similarity = similarity
        self.judges = tuple(judges)
        self.rewriter = rewriter
        self.max_gold_statements = max_gold_statements

    def params(self) -> dict[str, Any]:
        return {
            "similarity": self.similarity.identity,
            "judges": "[" + ", ".join(j.identity for j in self.judges) + "]",
            "rewriter": None if self.rewriter is None else self.rewriter.identity,
            "version": self.version,
        }

    def _statements(
        self, question: str, gold: Sequence[str], prediction: str
    ) -> tuple[str, list[str], str]:
        """(prediction statement, gold statements, note) — the raw texts without a rewriter
        or when rewriting failed."""
        if self.rewriter is None:
            return prediction, list(gold), "raw texts"
        pred_s = self.rewriter.rewrite(question, prediction)
        gold_s = [self.rewriter.rewrite(question, g) for g in gold[: self.max_gold_statements]]
        gold_ok = [g for g in gold_s if g]
        if pred_s is None or not gold_ok:
            return prediction, list(gold), "raw texts (rewriting failed)"
        return pred_s, gold_ok, "rewritten statements"

    @staticmethod
    def _safe(
        judge: Judge, question: str, gold: Sequence[str], prediction: str, choices: Sequence[str]
    ) -> Judgment:
        """A stage-2 verdict; a judge that raises counts as "could not judge" (None)."""
        try:
            return judge.judge(question, gold, prediction, choices=choices)
        except Exception as exc:
            logger.warning("stage-2 judge %s raised %r", judge.identity, exc)
            return Judgment(None, None, f"{judge.name} raised {exc!r}"[:300])

    def _stage2(
        self,
        question: str,
        gold: Sequence[str],
        prediction: str,
        choices: Sequence[str],
        stage1: Judgment,
    ) -> Judgment:
        verdicts = [self._safe(j, question, gold, prediction, choices) for j in self.judges]
        summary = "; ".join(
            f"judge {k + 1}: {'none' if v.correct is None else v.correct}"
            for k, v in enumerate(verdicts)
        )
        if any(v.correct is False for v in verdicts):
            why = f"stage 1 rejected ({stage1.rationale}); stage 2 did not agree ({summary})"
            return Judgment(False, stage1.score, why)
        if any(v.correct is None for v in verdicts):
            return Judgment(None, stage1.score, f"stage 1 rejected; stage 2 incomplete ({summary})")
        return Judgment(
            True, stage1.score, f"stage 1 rejected; all stage-2 judges agree ({summary})"
        )

    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        refused = refusal_verdict(gold_answers, prediction)
        if refused is not None:
            return refused
        pred_s, gold_s, note = self._statements(question, gold_answers, prediction)
        first = self.similarity.judge(question, gold_s, pred_s, choices=choices)
        if first.correct:
            return Judgment(True, first.score, f"stage 1 accepted on {note}: {first.rationale}")
        return self._stage2(question, gold_answers, prediction, choices, first)

    def iter_judge_many(
        self, inputs: Sequence[JudgeInput], *, max_concurrency: int = 4
    ) -> Iterator[tuple[int, Judgment]]:
        """Refusals first, then stage by stage: rewriting (concurrent), similarity (batched),
        stage 2 on the rejections (concurrent); stage-1 acceptances are yielded as soon as they
        are known."""
        unpacked = [unpack_input(t) for t in inputs]
        keep: list[int] = []
        for i, (_q, gold, pred, _c) in enumerate(unpacked):
            refused = refusal_verdict(gold, pred)
            if refused is None:
                keep.append(i)
            else:
                yield i, refused
        for k, judgment in self._stages([unpacked[i] for i in keep], max_concurrency):
            yield keep[k], judgment

    def _stages(
        self,
        unpacked: list[tuple[str, tuple[str, ...], str, tuple[str, ...]]],
        max_concurrency: int,
    ) -> Iterator[tuple[int, Judgment]]:
        if not unpacked:
            return
        config: Any = {"max_concurrency": max(1, max_concurrency)}
        if self.rewriter is not None:
            rewrite: Runnable[Any, tuple[str, list[str], str]] = RunnableLambda(
                lambda t: self._statements(t[0], t[1], t[2])
            )
            rewritten = rewrite.batch(unpacked, config=config)
        else:
            rewritten = [(p, list(g), "raw texts") for _q, g, p, _c in unpacked]
        stage1_inputs: list[JudgeInput] = [
            (q, gs, ps, c) for (q, _g, _p, c), (ps, gs, _n) in zip(unpacked, rewritten, strict=True)
        ]
        first: dict[int, Judgment] = {}
        for i, j in self.similarity.iter_judge_many(stage1_inputs, max_concurrency=max_concurrency):
            first[i] = j
            if j.correct:
                note = rewritten[i][2]
                yield i, Judgment(True, j.score, f"stage 1 accepted on {note}: {j.rationale}")
        rejected = [i for i in range(len(unpacked)) if not first[i].correct]
        if not rejected:
            return

        def second(i: int) -> Judgment:
            q, g, p, c = unpacked[i]
            return self._stage2(q, g, p, c, first[i])

        runner = RunnableLambda(second)
        for k, j in runner.batch_as_completed(rejected, config=config):
            yield rejected[k], j
