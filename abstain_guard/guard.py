"""`AbstentionGuard`: a runnable that answers or says "I don't know" with a guarantee.

The guard runs the wrapped runnable (a chat model, or a chain ending in one), scores the
``AIMessage`` with the artifact's scorer, and returns either that message or an
abstention message. Both carry ``response_metadata["abstention"]`` = ``{abstained,
score, threshold, scorer, mode, target, guarantee, reason, error}``; an abstention keeps
the withheld answer under ``response_metadata["withheld_response"]``. Every decision is
recorded in traces (see :mod:`abstain_guard.tracing`).
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

from langchain_core.callbacks.manager import (
    AsyncCallbackManagerForChainRun,
    CallbackManagerForChainRun,
)
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from langchain_core.runnables.config import run_in_executor
from pydantic import BaseModel, ConfigDict, PrivateAttr

from abstain_guard.artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.decision import DecisionRule
from abstain_guard.deployment import (
    API_UNVERIFIED,
    DeploymentRecord,
    api_response_mismatches,
    generation_mismatches,
    model_mismatches,
)
from abstain_guard.errors import (
    ArtifactMismatchError,
    ContextLengthError,
    GuardError,
    InvalidInputError,
    KernelMismatchWarning,
    ScoringError,
)
from abstain_guard.groups import GroupRules, group_of
from abstain_guard.kernels import kernel_differences, kernel_note
from abstain_guard.metadata import ResponseMetadata
from abstain_guard.monitor import GuardMonitor
from abstain_guard.monitor_binding import fit_monitor
from abstain_guard.runnables import find_chat_models
from abstain_guard.tracing import arecord_decision, logger, record_decision

__all__ = ["AbstentionGuard", "AbstentionPolicy"]


def _as_config(config: GuardConfig | Mapping[str, Any] | None) -> GuardConfig:
    if config is None:
        return GuardConfig()
    if isinstance(config, GuardConfig):
        return config
    if isinstance(config, Mapping):
        return GuardConfig.from_dict(config)
    raise InvalidInputError(
        f"config must be a GuardConfig, a mapping or None, got {type(config).__name__}."
    )


def _withheld(message: Any) -> dict[str, Any]:
    if isinstance(message, BaseMessage):
        out: dict[str, Any] = {
            "content": message.content,
            "response_metadata": dict(message.response_metadata or {}),
        }
        if message.additional_kwargs:
            out["additional_kwargs"] = dict(message.additional_kwargs)
        tool_calls = getattr(message, "tool_calls", None)
        if tool_calls:
            out["tool_calls"] = list(tool_calls)
        return out
    return {"content": repr(message)[:2000], "type": type(message).__name__}


#: Kernel notes already given as a warning in this process
#: (:meth:`AbstentionPolicy.kernel_warnings`).
_KERNEL_NOTES_GIVEN: set[str] = set()


class AbstentionPolicy:
    """Scores a message and turns it into the guard's output (shared by guard and middleware).

    Args:
        artifact: the calibrated artifact (scorer + calibration scores).
        config: the target and behaviour.
    """

    def __init__(self, artifact: GuardArtifact, config: GuardConfig | None = None) -> None:
        if not isinstance(artifact, GuardArtifact):
            raise InvalidInputError(
                f"artifact must be a GuardArtifact, got {type(artifact).__name__}. Load one with "
                "GuardArtifact.load(path)."
            )
        self.artifact = artifact
        self.config = _as_config(config)
        self.rule: DecisionRule = artifact.decision_rule(self.config)
        self.groups: GroupRules | None = (
            artifact.group_rules(self.config) if self.config.group_by is not None else None
        )
        self.deployment: DeploymentRecord | None = DeploymentRecord.from_metadata(artifact.metadata)
        self._standing_warnings: list[str] = []

    def mismatch(self, problems: list[str], where: str) -> list[str]:
        """Raise (``on_mismatch="raise"``) or return the problems as warnings.

        Raises:
            ArtifactMismatchError: when there are problems and the config says raise.
        """
        if not problems:
            return []
        notes = [f"{where}: {p}" for p in problems]
        if self.config.on_mismatch == "raise":
            raise ArtifactMismatchError(
                "The guard does not run as it was calibrated, so its guarantee would not hold: "
                + "; ".join(notes)
                + ". Run the model, prompt and settings recorded in the artifact (see "
                "load_guard_chain), recalibrate for this deployment, or set "
                "on_mismatch='warn' to go on with the mismatch recorded in every decision."
            )
        return notes

    def check_models(self, runnable: Any) -> None:
        """Check every chat model inside ``runnable`` (fallbacks too) against the artifact's
        model fingerprint; in ``on_mismatch="warn"`` mode the problems are kept and added to
        every decision's ``guarantee["warnings"]``."""
        api = self.deployment.chat_model if self.deployment is not None else None
        problems = model_mismatches(
            self.artifact.model_fingerprint, find_chat_models(runnable), chat_model=api
        )
        for note in self.mismatch(problems, "model"):
            if note not in self._standing_warnings:
                self._standing_warnings.append(note)

    def response_warnings(self, message: Any) -> list[str]:
        """Mismatches between the settings a response was generated with and the artifact's
        deployment record (none when the artifact has no record)."""
        if self.deployment is None or not isinstance(message, AIMessage):
            return []
        generation = ResponseMetadata.of(message).generation()
        if generation is None and self.deployment.chat_model is not None:
            problems = api_response_mismatches(self.deployment, message.response_metadata)
        else:
            problems = generation_mismatches(self.deployment, generation)
        return self.mismatch(problems, "response") + self.kernel_warnings(generation)

    def kernel_warnings(self, generation: Mapping[str, Any] | None) -> list[str]:
        """The kernel note when ``generation`` was computed on other kernels than the
        calibration (:mod:`abstain_guard.kernels`): not a refusal, since the score moves only
        in its last bits, but a :class:`~abstain_guard.errors.KernelMismatchWarning` and a log
        record the first time in the process, and a note in every such decision."""
        if self.deployment is None or generation is None:
            return []
        differences = kernel_differences(
            generation.get("kernels"), self.deployment.decoding.get("kernels")
        )
        if not differences:
            return []
        note = kernel_note(differences, self.artifact.scores, self.rule.threshold)
        if note not in _KERNEL_NOTES_GIVEN:  # once per process, however many guards
            _KERNEL_NOTES_GIVEN.add(note)
            warnings.warn(note, KernelMismatchWarning, stacklevel=2)
            logger.warning(note)
        return [note]

    def group_of(self, input: Any, metadata: Mapping[str, Any] | None = None) -> str | None:
        """The question's group (:func:`abstain_guard.groups.group_of`); None without
        ``group_by``. Raises GuardError when ``group_by`` fails and ``on_error="raise"``."""
        return group_of(self.config, input, metadata)

    def _rule(self, group: str | None) -> tuple[DecisionRule, dict[str, Any]]:
        """The rule for a question of ``group`` and the decision's group fields."""
        if self.groups is None:
            return self.rule, {}
        rule, kind = self.groups.rule_for(group)
        return rule, {"group": group, "group_rule": kind}

    def _base(
        self, extra_warnings: list[str] | None = None, rule: DecisionRule | None = None
    ) -> dict[str, Any]:
        rule = rule or self.rule
        guarantee = rule.guarantee
        extra = self._standing_warnings + list(extra_warnings or [])
        if extra:
            guarantee = {**guarantee, "warnings": [*guarantee.get("warnings", []), *extra]}
        if self.deployment is not None and self.deployment.chat_model is not None:
            guarantee = {**guarantee, "unverified": [API_UNVERIFIED]}
        return {
            "scorer": self.artifact.scorer.name,
            "threshold": rule.threshold,
            "mode": rule.mode,
            "target": rule.target,
            "guarantee": guarantee,
        }

    def score(self, message: Any) -> float:
        """The scorer's score of ``message``; raises ScoringError on anything unusable."""
        if not isinstance(message, AIMessage):
            raise ScoringError(
                f"The wrapped runnable returned {type(message).__name__}, not an AIMessage; "
                "put the guard right after the chat model (before any output parser)."
            )
        value = self.artifact.scorer.score(message)
        try:
            score = float(value)
        except (TypeError, ValueError) as exc:
            raise ScoringError(f"Scorer returned a non-number {value!r}.") from exc
        if math.isnan(score):
            raise ScoringError("Scorer returned NaN.")
        return score

    def decide(
        self, message: Any, warnings: list[str] | None = None, group: str | None = None
    ) -> tuple[AIMessage, dict[str, Any]]:
        """Score ``message`` and return ``(output message, decision dict)``.

        ``warnings`` (deployment mismatches found upstream, ``on_mismatch="warn"``) are added
        to the decision's ``guarantee["warnings"]``. With ``config.group_by`` the rule is
        ``group``'s (:meth:`group_of`; None: an unknown group, ``config.unknown_group``) and
        the decision records ``group`` and ``group_rule`` (``"group"``, ``"pooled"`` or
        ``"abstain"``).

        Raises:
            GuardError: when scoring fails and ``config.on_error == "raise"``.
            ArtifactMismatchError: the response was generated with other settings than the
                artifact was calibrated with (``config.on_mismatch == "raise"``).
        """
        rule, group_fields = self._rule(group)
        decision = self._base([*(warnings or []), *self.response_warnings(message)], rule)
        decision.update(group_fields)
        try:
            score = self.score(message)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if self.config.on_error == "raise":
                raise GuardError(
                    f"The guard could not score the response ({reason}). Set on_error='abstain' "
                    "to withhold unscorable responses instead."
                ) from exc
            decision.update(abstained=True, score=None, reason="scoring failed", error=reason)
            return self._abstention(message, decision), decision
        answered = rule.answers(score)
        decision.update(
            abstained=not answered,
            score=score,
            reason="score <= threshold" if answered else "score > threshold",
            error=None,
        )
        if group_fields.get("group_rule") == "abstain":
            decision["reason"] = "group without a rule: abstain"
        if answered:
            assert isinstance(message, AIMessage)
            meta = {**(message.response_metadata or {}), "abstention": decision}
            return message.model_copy(update={"response_metadata": meta}), decision
        return self._abstention(message, decision), decision

    def decide_unanswerable(
        self, exc: ContextLengthError, group: str | None = None
    ) -> tuple[AIMessage, dict[str, Any]]:
        """Abstain on an input the model cannot take (too long for its context window) when
        ``on_error="abstain"``; with ``"raise"`` the error propagates."""
        if self.config.on_error == "raise":
            raise exc
        rule, group_fields = self._rule(group)
        decision = self._base(rule=rule)
        decision.update(group_fields)
        reason = f"{type(exc).__name__}: {exc}"
        decision.update(abstained=True, score=None, reason="input too long", error=reason)
        return self._abstention(None, decision), decision

    def _abstention(self, message: Any, decision: dict[str, Any]) -> AIMessage:
        kwargs: dict[str, Any] = {}
        if isinstance(message, AIMessage):
            kwargs["id"] = message.id
            if message.usage_metadata is not None:
                kwargs["usage_metadata"] = message.usage_metadata
        return AIMessage(
            content=self.config.abstain_message,
            response_metadata={"abstention": decision, "withheld_response": _withheld(message)},
            **kwargs,
        )


class AbstentionGuard(RunnableSerializable[Any, AIMessage]):
    """Wraps a runnable that returns an ``AIMessage`` and withholds unreliable answers.

    Example::

        artifact = GuardArtifact.load("guard/")
        guard = AbstentionGuard(chat_model, artifact=artifact,
                                config=GuardConfig(mode="risk", risk_target=0.2))
        msg = guard.invoke("Who wrote Hamlet?")
        msg.response_metadata["abstention"]["abstained"]

    It composes in LCEL (``prompt | guard | StrOutputParser()``), supports ``invoke``,
    ``ainvoke``, ``batch``/``abatch`` (honouring ``max_concurrency``), and ``stream`` /
    ``astream``, which stay buffered: they yield one message, the answer or the abstention,
    after the decision, never a token of an answer before it is decided (the wrapped model
    may stream token by token; the guard waits for its whole answer to score it). Note that
    ``astream_events`` also reports the wrapped model's own run, whose
    ``on_chat_model_stream`` events carry the undecided tokens; show users the guard's
    output (or filter with ``exclude_types=["chat_model"]``), not those events.

    Args:
        runnable: a chat model or a chain ending in one. At construction it is passed
            through ``artifact.scorer.prepare`` (the geometry scorer installs its
            reference directions there) and the result is what runs.
        artifact: the :class:`GuardArtifact` from calibration.
        config: a :class:`GuardConfig` (or a mapping of its fields); defaults to
            participation 0.8.
        monitor: a :class:`~abstain_guard.monitor.GuardMonitor` fed every decision (fitted
            here on the artifact and config when it is not yet); each decision then carries
            ``run_id``, the key of ``monitor.record_feedback``.

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
            runnable=runnable, artifact=artifact, config=_as_config(config), **kwargs
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
        self._policy.check_models(prepared)
        self._prepared = prepared

    @classmethod
    def from_artifact(
        cls,
        path: str | os.PathLike[str],
        runnable: Runnable[Any, Any],
        config: GuardConfig | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> AbstentionGuard:
        """Load the artifact at ``path`` and guard ``runnable`` with it.

        Every chat model in ``runnable`` must be the calibrated model, and each response
        must be generated with the recorded prompt, token budget and decoding (see
        :mod:`abstain_guard.deployment`); :func:`~abstain_guard.chains.load_guard_chain`
        builds such a chain from the artifact alone.
        """
        artifact = GuardArtifact.load(path)
        return cls(runnable, artifact=artifact, config=config, **kwargs)

    # --- introspection ------------------------------------------------------------------

    @property
    def decision_rule(self) -> DecisionRule:
        """The threshold and guarantee in force."""
        return self._policy.rule

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

    # --- running ------------------------------------------------------------------------

    def _observe(self, decision: dict[str, Any], run_manager: Any) -> None:
        if self.monitor is not None:
            run_id = str(run_manager.run_id) if run_manager is not None else None
            decision["run_id"] = self.monitor.observe(decision, run_id=run_id)

    def _run(
        self,
        input: Any,
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
        **kwargs: Any,
    ) -> AIMessage:
        group = self._policy.group_of(input, config.get("metadata"))
        try:
            output = self._prepared.invoke(input, config, **kwargs)
        except ContextLengthError as exc:
            message, decision = self._policy.decide_unanswerable(exc, group)
        else:
            message, decision = self._policy.decide(output, group=group)
        self._observe(decision, run_manager)
        record_decision(decision, run_manager=run_manager, config=config)
        return message

    async def _arun(
        self,
        input: Any,
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
        **kwargs: Any,
    ) -> AIMessage:
        group = self._policy.group_of(input, config.get("metadata"))
        try:
            output = await self._prepared.ainvoke(input, config, **kwargs)
        except ContextLengthError as exc:
            message, decision = self._policy.decide_unanswerable(exc, group)
        else:
            message, decision = await run_in_executor(
                config, self._policy.decide, output, None, group
            )
        self._observe(decision, run_manager)
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
