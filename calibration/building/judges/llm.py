"""The LLM judge: a LangChain chat model asked for a verdict, with retries and backoff, and
the helpers every chat-model-backed judge shares (model identity, prompt hash, retries,
reading a reply's text). Verdict parsing (:func:`parse_verdict`) reads text replies of models
without structured output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from langchain_core.language_models import BaseChatModel
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda
from pydantic import BaseModel, Field

from abstain_guard.errors import JudgeError

from .base import Judge, Judgment
from .lexical import refusal_verdict

logger = logging.getLogger(__name__)


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


DEFAULT_JUDGE_SYSTEM_NO_REFERENCE = (
    "You are a strict, fair grader of short answers to questions. There is no reference "
    "answer: decide from what you know whether the proposed answer is factually correct and "
    "answers the question asked. It is incorrect if it states something false, hedges between "
    "several candidates, refuses, or does not answer. If you are not sure it is correct, say "
    "it is incorrect."
)
DEFAULT_JUDGE_HUMAN_NO_REFERENCE = (
    "Question: {question}\n{options}"
    "Proposed answer: {prediction}\n\n"
    "Is the proposed answer correct? Reply with a JSON object "
    '{{"correct": true or false, "rationale": "<one short sentence>"}} and nothing else.'
)


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


def prompt_hash(*parts: str) -> str:
    """A short sha256 of the parts (a prompt's repr), part of a judge's identity."""
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:10]


def message_text(message: Any) -> str:
    """The text of a chat reply: its ``content`` string, or its text blocks joined."""
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
    :data:`DEFAULT_JUDGE_HUMAN`) asks for ``{"correct": bool, "rationale": str}``. A question
    without gold answers (a file of questions only) is asked with ``prompt_no_reference``
    (variables ``question``, ``prediction``, ``options``; default
    :data:`DEFAULT_JUDGE_SYSTEM_NO_REFERENCE` / :data:`DEFAULT_JUDGE_HUMAN_NO_REFERENCE`): the
    model decides from what it knows, so its quality is what a human review measures. When the
    model supports ``with_structured_output`` the :class:`Verdict` schema is used (not, by
    default, for a local model whose template has no tools: ``tool_call_format ==
    "prompted"``); otherwise,
    or when the structured reply does not parse, the text reply is parsed
    (:func:`parse_verdict`). API errors and unparseable replies are retried ``retries`` times
    with exponential backoff (``Runnable.with_retry``); still failing → ``Judgment(None, …)``.
    """

    name = "llm"
    concurrent = True
    #: Bumped whenever verdicts change, so cached judgments of an older judge are not reused.
    version: ClassVar[int] = 3

    def __init__(
        self,
        chat_model: BaseChatModel,
        prompt: Any = None,
        retries: int = 3,
        *,
        prompt_no_reference: Any = None,
        structured: bool | None = None,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
    ) -> None:
        if retries < 1:
            raise JudgeError(f"retries must be at least 1, got {retries}")
        self.chat_model = chat_model
        self.prompt = prompt or ChatPromptTemplate.from_messages(
            [("system", DEFAULT_JUDGE_SYSTEM), ("human", DEFAULT_JUDGE_HUMAN)]
        )
        self.prompt_no_reference = prompt_no_reference or ChatPromptTemplate.from_messages(
            [
                ("system", DEFAULT_JUDGE_SYSTEM_NO_REFERENCE),
                ("human", DEFAULT_JUDGE_HUMAN_NO_REFERENCE),
            ]
        )
        self.retries = retries
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        model: Any = chat_model
        self.structured = False
        if structured is None and getattr(chat_model, "tool_call_format", None) == "prompted":
            # a local model whose chat template knows no tools: structured output would be a
            # forced call through the prompted tool block, worse than a text verdict
            structured = False
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
        self._chain: Runnable[Any, Verdict] = with_retry(
            self.prompt | model | RunnableLambda(self._to_verdict),
            retries,
            backoff_initial,
            backoff_max,
        )
        self._free_chain: Runnable[Any, Verdict] = with_retry(
            self.prompt_no_reference | model | RunnableLambda(self._to_verdict),
            retries,
            backoff_initial,
            backoff_max,
        )

    def params(self) -> dict[str, Any]:
        return {
            "model": chat_model_identity(self.chat_model),
            "prompt": prompt_hash(repr(self.prompt)),
            "prompt_no_reference": prompt_hash(repr(self.prompt_no_reference)),
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
        return parse_verdict(message_text(reply))

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
        refused = refusal_verdict(gold_answers, prediction)
        if refused is not None:  # no need to ask the model
            return refused
        inputs = {
            "question": question,
            "gold": " | ".join(gold_answers),
            "prediction": prediction,
            "options": options,
        }
        chain = self._chain if gold_answers else self._free_chain
        try:
            verdict = chain.invoke(inputs)
        except Exception as exc:  # an API or parse failure after all retries
            logger.warning(
                "LLM judge %s failed after %d tries: %r", self.identity, self.retries, exc
            )
            return Judgment(None, None, f"no judgment after {self.retries} tries: {exc!r}"[:300])
        return Judgment(verdict.correct, float(verdict.correct), verdict.rationale or "")


def with_retry(runnable: Any, retries: int, initial: float, maximum: float) -> Any:
    """``runnable`` retried up to ``retries`` times with exponential backoff (jittered,
    ``initial`` to ``maximum`` seconds; none when ``initial`` is 0)."""
    if retries <= 1:
        return runnable
    return runnable.with_retry(
        stop_after_attempt=retries,
        wait_exponential_jitter=initial > 0,
        exponential_jitter_params={"initial": initial, "max": maximum},
    )
