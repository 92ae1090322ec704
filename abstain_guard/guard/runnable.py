"""`AbstentionGuard`: a runnable that answers or says "I don't know" with a guarantee: it runs
the wrapped runnable, and the :class:`~.policy.AbstentionPolicy` (shared with the agent
middleware) scores the ``AIMessage`` and returns it or the abstention, both carrying
``response_metadata["abstention"]``; every decision is traced (:mod:`.tracing`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.callbacks.manager import (
    AsyncCallbackManagerForChainRun,
    CallbackManagerForChainRun,
)
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from langchain_core.runnables.config import (
    get_config_list,
    get_executor_for_config,
    run_in_executor,
)
from langchain_core.runnables.utils import gather_with_concurrency
from pydantic import BaseModel, ConfigDict, PrivateAttr

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.contract.given_answer import GivenAnswer
from abstain_guard.contract.runnables import find_chat_models, with_calibrated_capture
from abstain_guard.contract.streaming import ChunkRule
from abstain_guard.errors import (
    ContextLengthError,
    InvalidInputError,
)
from abstain_guard.guarantee.decision import Decision, DecisionRule
from abstain_guard.guard.answer_check import answer_problems, given_runnable
from abstain_guard.guard.policy import (
    AbstentionPolicy,
    as_guard_config,
    decision_of,
    with_decision,
)
from abstain_guard.guard.stream_gate import (
    GateEvent,
    acertified_stream,
    as_chunks,
    certified_stream,
    check_streamable,
)
from abstain_guard.guard.tracing import arecord_decision, record_decision
from abstain_guard.monitor.binding import fit_monitor
from abstain_guard.monitor.guard_monitor import GuardMonitor


class AbstentionGuard(RunnableSerializable[Any, AIMessage]):
    """Wraps a runnable that returns an ``AIMessage`` and withholds unreliable answers.

    Example::

        artifact = GuardArtifact.load("guard/")
        guard = AbstentionGuard(chat_model, artifact=artifact,
                                config=GuardConfig(mode="risk", risk_target=0.2))
        msg = guard.invoke("Who wrote Hamlet?")
        msg.response_metadata["abstention"]["abstained"]

    It composes in LCEL (``prompt | guard | StrOutputParser()``) and supports ``invoke``,
    ``batch`` and ``stream`` (and their async forms). For whole answers ``stream`` is
    buffered: one message after the decision. With a chunk rule (certified streaming,
    docs/streaming.md) it releases each chunk only once the running maximum of the prefix
    scores is still under τ; the first that crosses τ stops generation and the last chunk
    carries the decision. ``astream_events`` also reports the wrapped model's undecided
    tokens (filter with ``exclude_types=["chat_model"]``).

    Args:
        runnable: a chat model or a chain ending in one, passed through
            ``artifact.scorer.prepare`` at construction.
        artifact: the :class:`GuardArtifact` from calibration.
        config: a :class:`GuardConfig` (or a mapping); defaults to participation 0.8.
        monitor: a :class:`~abstain_guard.GuardMonitor` fed every decision; each decision
            then carries ``run_id``, the key of ``monitor.record_feedback``.

    Raises:
        ArtifactMismatchError: a chat model inside ``runnable`` (any of them, fallbacks
            included) is not the calibrated model or cannot be verified to be, or
            ``config.scorer`` names another scorer (``config.on_mismatch="warn"`` records
            model mismatches in every decision instead).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    runnable: Runnable[Any, Any]
    artifact: GuardArtifact
    config: GuardConfig = GuardConfig()
    monitor: GuardMonitor | None = None

    _prepared: Runnable[Any, Any] = PrivateAttr()
    _policy: AbstentionPolicy = PrivateAttr()

    def __init__(
        self,
        runnable: Runnable[Any, Any] | None = None,
        *,
        artifact: GuardArtifact,
        config: GuardConfig | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if runnable is None:
            runnable = kwargs.pop("runnable", None)
        if not isinstance(runnable, Runnable):
            raise InvalidInputError(
                f"AbstentionGuard needs a runnable (a chat model or a chain ending in one), "
                f"got {type(runnable).__name__}."
            )
        super().__init__(  # type: ignore[call-arg]
            runnable=runnable, artifact=artifact, config=as_guard_config(config), **kwargs
        )

    def model_post_init(self, context: Any, /) -> None:
        self._policy = AbstentionPolicy(self.artifact, self.config)
        fit_monitor(self.monitor, self.artifact, self.config)
        prepared = self.artifact.scorer.prepare(self.runnable)
        if not isinstance(prepared, Runnable):
            raise InvalidInputError(
                f"{type(self.artifact.scorer).__name__}.prepare returned "
                f"{type(prepared).__name__}, not a runnable."
            )
        prepared = with_calibrated_capture(prepared, self._policy.deployment)
        self._policy.check_models(prepared)
        if self._policy.chunk_rule is not None:
            check_streamable(self.artifact.scorer.kind, find_chat_models(prepared))
        self._prepared = prepared

    @classmethod
    def from_artifact(
        cls,
        path: str | os.PathLike[str],
        runnable: Runnable[Any, Any],
        config: GuardConfig | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> AbstentionGuard:
        """Load the artifact at ``path`` and guard ``runnable`` (run as calibrated:
        :func:`~abstain_guard.guard.chains.load_guard_chain` builds it from the artifact)."""
        artifact = GuardArtifact.load(path)
        return cls(runnable, artifact=artifact, config=config, **kwargs)

    @property
    def decision_rule(self) -> DecisionRule:
        """The threshold and guarantee in force."""
        return self._policy.rule

    @property
    def chunk_rule(self) -> ChunkRule | None:
        """The artifact's chunk rule (certified streaming), or None: whole answers."""
        return self._policy.chunk_rule

    @property
    def threshold(self) -> float:
        """τ: answers with ``score <= threshold`` are returned."""
        return self._policy.rule.threshold

    @property
    def policy(self) -> AbstentionPolicy:
        """The decision policy (scoring, deployment checks), e.g. to decide a message the
        caller generated itself (``serve`` with tools: only final answers are decided)."""
        return self._policy

    @property
    def bound_runnable(self) -> Runnable[Any, Any]:
        """The runnable that actually runs (after ``scorer.prepare``)."""
        return self._prepared

    @property
    def InputType(self) -> Any:
        return self.runnable.InputType

    @property
    def OutputType(self) -> Any:
        return AIMessage

    def get_input_schema(self, config: RunnableConfig | None = None) -> type[BaseModel]:
        return self.runnable.get_input_schema(config)  # type: ignore[return-value]

    def decide(self, message: Any, group: str | None = None) -> AIMessage:
        """Apply the decision to an existing message (no run, no trace entries); with
        ``config.group_by``, ``group`` is the question's group."""
        return self._policy.decide(message, group=group)[0]

    def _observe(
        self, message: AIMessage, decision: Decision, run_manager: Any
    ) -> tuple[AIMessage, Decision]:
        """The monitor's record of the decision: its ``run_id`` on the decision and message."""
        if self.monitor is None:
            return message, decision
        run_id = str(run_manager.run_id) if run_manager is not None else None
        decision = decision.replace(run_id=self.monitor.observe(decision, run_id=run_id))
        return with_decision(message, decision), decision

    def _observed(self, event: GateEvent, run_manager: Any) -> GateEvent:
        """A certified stream's event with its decision observed (text events as they are)."""
        if event.decision is None or event.message is None:
            return event
        message, decision = self._observe(event.message, event.decision, run_manager)
        return GateEvent(event.kind, event.text, message, decision)

    def _decide(
        self, output: Any, group: str | None, route: str | None = None
    ) -> tuple[AIMessage, Decision]:
        """Decide what the wrapped runnable generated for a question of ``group``: its output,
        or the :class:`ContextLengthError` it raised. With ``route`` (a :meth:`check`'s
        given answer, :mod:`.answer_check`) the answer's problems are the decision's warnings
        and the decision names the calibrated model."""
        if isinstance(output, ContextLengthError):
            message, decision = self._policy.decide_unanswerable(output, group)
        else:
            notes = None if route is None else answer_problems(self._policy, output, route)
            message, decision = self._policy.decide(output, notes, group)
        if route is None:
            return message, decision
        decision = decision.replace(model=self.artifact.model_fingerprint)
        return with_decision(message, decision), decision

    def _run(
        self,
        input: Any,
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
        given: tuple[Runnable[Any, Any], str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        """Generate (or with ``given``, re-read a check's answer) and decide, observed (not
        for a check) and traced."""
        if given is None and self._policy.chunk_rule is not None:  # on the prefix scores
            last = None
            for event in self._gate(input, run_manager, config, **kwargs):
                last = event
            assert last is not None and last.message is not None
            return last.message
        runnable, route = given or (self._prepared, None)
        group = self._policy.group_of(input, config.get("metadata"))
        try:
            output = runnable.invoke(input, config, **kwargs)
        except ContextLengthError as exc:
            output = exc
        message, decision = self._decide(output, group, route)
        if route is None:
            message, decision = self._observe(message, decision, run_manager)
        record_decision(decision, run_manager=run_manager, config=config)
        return message

    async def _arun(
        self,
        input: Any,
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
        given: tuple[Runnable[Any, Any], str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        """Async :meth:`_run` (the decision is scored in the config's executor)."""
        if given is None and self._policy.chunk_rule is not None:  # on the prefix scores
            last = None
            async for event in self._agate(input, run_manager, config, **kwargs):
                last = event
            assert last is not None and last.message is not None
            return last.message
        runnable, route = given or (self._prepared, None)
        group = self._policy.group_of(input, config.get("metadata"))
        try:
            output = await runnable.ainvoke(input, config, **kwargs)
        except ContextLengthError as exc:
            output = exc
        message, decision = await run_in_executor(config, self._decide, output, group, route)
        if route is None:
            message, decision = self._observe(message, decision, run_manager)
        await arecord_decision(decision, run_manager=run_manager, config=config)
        return message

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> AIMessage:
        """Run the wrapped runnable and answer or abstain."""
        return self._call_with_config(
            functools.partial(self._run, **kwargs), input, config, run_type="chain"
        )

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AIMessage:
        """Async :meth:`invoke`."""
        return await self._acall_with_config(
            functools.partial(self._arun, **kwargs), input, config, run_type="chain"
        )

    def check(self, input: Any, answer: Any, config: RunnableConfig | None = None) -> Decision:
        """The decision the guard would have made had its model answered ``input`` (what
        ``invoke`` takes) with ``answer``: a string, a mapping (``answer``, optional
        ``token_ids``, ``finish_reason``), an ``AIMessage`` or a :class:`GivenAnswer`. The
        wrapped runnable runs as deployed, its chat model re-reading the answer instead of
        generating it (:mod:`.answer_check`: a local model's replay, or a black-box scorer's
        fresh samples beside it). The decision is traced, not fed to the monitor, and names
        the model whose calibration it relies on (``model``).

        Raises:
            GivenAnswerError: the scorer cannot score a given answer (the message names
                those that can), or a chat model in the runnable cannot re-read one.
            ArtifactMismatchError: the answer could not have come from the calibrated
                deployment (another prompt or settings; under greedy decoding, tokens that
                are not the model's greedy choices; more tokens than the budget), unless
                ``config.on_mismatch="warn"``.
        """
        given = given_runnable(self._prepared, self.artifact, GivenAnswer.of(answer))
        run = functools.partial(self._run, given=given)
        return self._checked(self._call_with_config(run, input, config, run_type="chain"))

    async def acheck(
        self, input: Any, answer: Any, config: RunnableConfig | None = None
    ) -> Decision:
        """Async :meth:`check` (a black-box scorer's samples drawn with ``abatch``)."""
        given = given_runnable(self._prepared, self.artifact, GivenAnswer.of(answer))
        run = functools.partial(self._arun, given=given)
        return self._checked(await self._acall_with_config(run, input, config, run_type="chain"))

    def check_batch(
        self,
        pairs: Sequence[tuple[Any, Any]],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """:meth:`check` of each ``(input, answer)`` pair, ``max_concurrency`` at a time in
        threads (a local model's replays run side by side on its engines); with
        ``return_exceptions`` a pair's error is its result."""
        configs = get_config_list(config, len(pairs))

        def one(pair: tuple[Any, Any], cfg: RunnableConfig) -> Any:
            try:
                return self.check(pair[0], pair[1], cfg)
            except Exception as exc:
                if not return_exceptions:
                    raise
                return exc

        if not pairs:
            return []
        with get_executor_for_config(configs[0]) as executor:
            return list(executor.map(one, pairs, configs))

    async def acheck_batch(
        self,
        pairs: Sequence[tuple[Any, Any]],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Async :meth:`check_batch` (``max_concurrency`` checks awaited at once)."""
        configs = get_config_list(config, len(pairs))

        async def one(pair: tuple[Any, Any], cfg: RunnableConfig) -> Any:
            try:
                return await self.acheck(pair[0], pair[1], cfg)
            except Exception as exc:
                if not return_exceptions:
                    raise
                return exc

        limit = configs[0].get("max_concurrency") if configs else None
        return list(await gather_with_concurrency(limit, *map(one, pairs, configs)))

    @staticmethod
    def _checked(message: AIMessage) -> Decision:
        decision = decision_of(message)
        assert decision is not None
        return decision

    def _gate(
        self,
        input: Any,
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
        **kwargs: Any,
    ) -> Iterator[GateEvent]:
        """The certified stream of one input (:mod:`abstain_guard.guard.stream_gate`): released
        text events, then the decision (observed and traced before it is yielded)."""
        rule = self._policy.chunk_rule
        assert rule is not None
        group = self._policy.group_of(input, config.get("metadata"))
        for event in certified_stream(
            self._policy, rule, lambda: self._prepared.stream(input, config, **kwargs), group
        ):
            event = self._observed(event, run_manager)
            if event.decision is not None:
                record_decision(event.decision, run_manager=run_manager, config=config)
            yield event

    async def _agate(
        self,
        input: Any,
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
        **kwargs: Any,
    ) -> AsyncIterator[GateEvent]:
        """Async :meth:`_gate`."""
        rule = self._policy.chunk_rule
        assert rule is not None
        group = self._policy.group_of(input, config.get("metadata"))
        async for event in acertified_stream(
            self._policy, rule, lambda: self._prepared.astream(input, config, **kwargs), group
        ):
            event = self._observed(event, run_manager)
            if event.decision is not None:
                await arecord_decision(event.decision, run_manager=run_manager, config=config)
            yield event

    def _stream_chunks(
        self,
        inputs: Iterator[Any],
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        for input in inputs:
            for event in self._gate(input, run_manager, config, **kwargs):
                yield from as_chunks(event)

    async def _astream_chunks(
        self,
        inputs: AsyncIterator[Any],
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        async for input in inputs:
            async for event in self._agate(input, run_manager, config, **kwargs):
                for chunk in as_chunks(event):
                    yield chunk

    def stream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[AIMessage]:
        """Buffered (one message after the decision), or with a chunk rule certified: the
        answer's chunks as they pass, the last one carrying the decision (class docstring)."""
        if self._policy.chunk_rule is None:
            yield from super().stream(input, config, **kwargs)
            return
        yield from self._transform_stream_with_config(
            iter([input]), functools.partial(self._stream_chunks, **kwargs), config, "chain"
        )

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[AIMessage]:
        """Async :meth:`stream`."""
        if self._policy.chunk_rule is None:
            async for out in super().astream(input, config, **kwargs):
                yield out
            return

        async def one() -> AsyncIterator[Any]:
            yield input

        async for chunk in self._atransform_stream_with_config(
            one(), functools.partial(self._astream_chunks, **kwargs), config, "chain"
        ):
            yield chunk
