"""Answers the guard did not generate: what a given answer is, and the chat model that
re-reads one in place of generating it (``AbstentionGuard.check``, ``abstain-guard score``).

A chat model that can score an answer it did not write has ``reread(messages, answer,
stop=None, **kwargs) -> AIMessage`` (and may have an async ``areread``): the message it would
have returned had it generated ``answer`` for ``messages`` under the call's settings, with
what a scorer reads and the generation record the guard checks. The local
:class:`~abstain_guard.adapters.GeometryChatModel` replays the answer in one teacher-forced
pass; a black-box scorer's ``SampledChatModel`` draws the other k - 1 samples beside it.
:func:`with_given_answer` puts a :class:`GivenAnswerModel` in place of every chat model of a
guarded runnable, so the prompt, bound settings and checks are the deployment's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.callbacks.manager import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict

from abstain_guard.contract.metadata import GENERATION
from abstain_guard.contract.runnables import map_chat_models
from abstain_guard.errors import GivenAnswerError, InvalidInputError

FINISH_REASONS = ("stop", "length")
"""How a given answer ended: ``"stop"`` (finished: the model's end-of-sequence token follows
its text) or ``"length"`` (cut at the token budget: no end token)."""


@dataclass(frozen=True)
class GivenAnswer:
    """An answer to check: its text, and where they were logged the exact token ids the
    model generated (replayed as they are: the bits of the generation's own score) and how it
    ended (:data:`FINISH_REASONS`; None: finished).

    Raises:
        InvalidInputError: a finish reason other than those.
    """

    text: str
    token_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in (None, *FINISH_REASONS):
            raise InvalidInputError(
                f"finish_reason must be one of {FINISH_REASONS} (or absent: finished), got "
                f"{self.finish_reason!r}."
            )

    @property
    def finished(self) -> bool:
        """Whether the answer ended with the model's end token (not cut at the budget)."""
        return self.finish_reason != "length"

    @classmethod
    def of(cls, answer: Any) -> GivenAnswer:
        """``answer`` as a given answer: a string, a mapping (``answer`` or ``content``,
        optional ``token_ids``, ``finish_reason``) or an ``AIMessage`` (its token ids and
        finish reason when its metadata has them; a guard's abstention: the withheld answer).

        Raises:
            InvalidInputError: none of those.
        """
        if isinstance(answer, GivenAnswer):
            return answer
        if isinstance(answer, str):
            return cls(answer)
        if isinstance(answer, AIMessage):
            meta = dict(answer.response_metadata or {})
            withheld = meta.get("withheld_response")
            if isinstance(withheld, Mapping) and "abstention" in meta:
                meta = dict(withheld.get("response_metadata") or {})
                return cls._from(str(withheld.get("content", "")), meta)
            return cls._from(str(answer.text), meta)
        if isinstance(answer, Mapping) and isinstance(
            answer.get("answer", answer.get("content")), str
        ):
            return cls._from(str(answer.get("answer", answer.get("content"))), answer)
        raise InvalidInputError(
            f"An answer to check is a string, a mapping with 'answer' (optional 'token_ids', "
            f"'finish_reason') or an AIMessage, got {type(answer).__name__}."
        )

    @classmethod
    def _from(cls, text: str, meta: Mapping[str, Any]) -> GivenAnswer:
        ids = meta.get("token_ids")
        if ids is not None and not (
            isinstance(ids, Sequence) and all(isinstance(t, int) for t in ids)
        ):
            raise InvalidInputError(f"token_ids must be a list of integers, got {ids!r}.")
        reason = meta.get("finish_reason")
        return cls(text, None if ids is None else tuple(ids), reason)


class GivenAnswerModel(BaseChatModel):
    """A chat model that answers every call with ``answer``, re-read by ``inner``
    (``inner.reread``; ``inner.areread`` when awaited, where it has one)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inner: BaseChatModel
    answer: GivenAnswer

    @property
    def _llm_type(self) -> str:
        return f"given-{self.inner._llm_type}"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        message = self.inner.reread(messages, self.answer, stop=stop, **kwargs)  # type: ignore[attr-defined]
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        areread = getattr(self.inner, "areread", None)
        if areread is None:
            return await super()._agenerate(messages, stop, run_manager, **kwargs)
        message = await areread(messages, self.answer, stop=stop, **kwargs)
        return ChatResult(generations=[ChatGeneration(message=message)])


def with_given_answer(runnable: Any, answer: GivenAnswer, why: str) -> Any:
    """``runnable`` with every chat model in it re-reading ``answer`` instead of generating.

    Raises:
        GivenAnswerError: a chat model in it cannot re-read an answer (no ``reread``);
            ``why`` says what the scorer needs.
    """

    def wrap(model: BaseChatModel) -> BaseChatModel:
        if not callable(getattr(model, "reread", None)):
            raise GivenAnswerError(
                f"The guarded chat model {type(model).__name__} cannot re-read an answer it "
                f"did not generate: {why}."
            )
        return GivenAnswerModel(inner=model, answer=answer)

    return map_chat_models(runnable, wrap)


def given_answer_mismatches(decoding: Mapping[str, Any], metadata: Mapping[str, Any]) -> list[str]:
    """Why a re-read answer is not one the calibrated deployment could have generated (empty:
    it could), from the replay's metadata and the calibration's ``decoding`` record (pure).

    Checked: no more tokens than the call's budget (``generation["max_new_tokens"]``), and
    under greedy decoding (temperature 0) that every token, the end token included, is the
    model's most probable one behind the prompt, which is what the model generated there:
    an answer of another model, prompt or tokenization is not one calibration scored.
    """
    problems: list[str] = []
    ids = list(metadata.get("token_ids") or [])
    budget = (metadata.get(GENERATION) or {}).get("max_new_tokens")
    if budget is not None and len(ids) > int(budget):
        problems.append(
            f"the answer has {len(ids)} tokens, but the deployment generates at most {budget}"
        )
    if float(decoding.get("temperature") or 0.0) != 0.0:
        return problems
    logprobs = metadata.get("logprobs") or {}
    for t, entry in enumerate(logprobs.get("content") or []):
        top = entry.get("top_logprobs") or []
        if top and float(entry["logprob"]) < float(top[0]["logprob"]):
            problems.append(
                f"token {t} of the answer ({entry.get('token')!r}) is not the calibrated "
                f"model's greedy choice there ({top[0].get('token')!r}): the answer was not "
                "generated by this model with this prompt and greedy decoding, so the "
                "calibration says nothing about it (a text answer tokenized otherwise than "
                "generated, or one cut at the budget without finish_reason='length': pass its "
                "token ids or finish reason)"
            )
            break
    return problems
