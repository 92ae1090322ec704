"""`AbstentionPolicy`: how one message becomes the guard's output, shared by the
:class:`~abstain_guard.AbstentionGuard` runnable and the agent middleware: it holds the
artifact and the config's rule (one per group with ``group_by``), checks the chat models and
each call's settings against the deployment record, scores the message and returns the
answer or the abstention with its :class:`~abstain_guard.guarantee.decision.Decision`::

    message, decision = AbstentionPolicy(artifact, config).decide(ai_message)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.contract.deployment import (
    API_UNVERIFIED,
    DeploymentRecord,
    api_response_mismatches,
    generation_mismatches,
    model_mismatches,
)
from abstain_guard.contract.kernels import kernel_differences, kernel_note
from abstain_guard.contract.metadata import ResponseMetadata
from abstain_guard.contract.runnables import find_chat_models
from abstain_guard.contract.streaming import ChunkRule
from abstain_guard.errors import (
    ArtifactMismatchError,
    ContextLengthError,
    GuardError,
    InvalidInputError,
    KernelMismatchWarning,
    ScoringError,
)
from abstain_guard.guarantee.agent_steps import running_statistic
from abstain_guard.guarantee.certificate import Certificate
from abstain_guard.guarantee.decision import Decision, DecisionRule
from abstain_guard.guarantee.groups import GroupRules, group_of
from abstain_guard.guard.tracing import logger


def as_guard_config(config: GuardConfig | Mapping[str, Any] | None) -> GuardConfig:
    """``config`` as a :class:`GuardConfig` (``None``: the defaults; a mapping: its fields)."""
    if config is None:
        return GuardConfig()
    if isinstance(config, GuardConfig):
        return config
    if isinstance(config, Mapping):
        return GuardConfig.from_dict(config)
    raise InvalidInputError(
        f"config must be a GuardConfig, a mapping or None, got {type(config).__name__}."
    )


def with_decision(message: AIMessage, decision: Decision) -> AIMessage:
    """``message`` carrying ``decision`` (``response_metadata["abstention"]``, its JSON)."""
    meta = {**(message.response_metadata or {}), "abstention": decision.to_dict()}
    return message.model_copy(update={"response_metadata": meta})


def decision_of(message: Any) -> Decision | None:
    """The decision a message carries (:func:`with_decision`), or None."""
    meta = getattr(message, "response_metadata", None) or {}
    data = meta.get("abstention")
    return Decision.from_dict(data) if data else None


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


#: Why a guard calibrated for certified streaming cannot decide a whole answer alone.
WHOLE_ANSWER_REFUSED = (
    "the artifact was calibrated with a chunk rule: its threshold is on the maximum of the "
    "answer's prefix scores, which a finished message does not carry; run the answer through "
    "AbstentionGuard (invoke/stream, certified streaming) or use an artifact calibrated on "
    "whole answers"
)


def batch_variance_note(bound: float) -> dict[str, Any]:
    """``guarantee["batch_variance"]`` of an engine whose kernels are not batch-invariant: a
    live score may differ from calibration's by up to ``bound`` (docs/vllm.md)."""
    return {
        "bound": bound,
        "statement": (
            f"this engine's scores depend on which requests share its batches: a live score "
            f"may differ from calibration's by up to {bound:g}, so a score within {bound:g} "
            "of the threshold may be decided the other way"
        ),
    }


class AbstentionPolicy:
    """Scores a message and turns it into the guard's output (module docstring)."""

    def __init__(self, artifact: GuardArtifact, config: GuardConfig | None = None) -> None:
        if not isinstance(artifact, GuardArtifact):
            raise InvalidInputError(
                f"artifact must be a GuardArtifact, got {type(artifact).__name__}. Load one with "
                "GuardArtifact.load(path)."
            )
        self.artifact = artifact
        self.config = as_guard_config(config)
        self.rule: DecisionRule = artifact.decision_rule(self.config)
        self.groups: GroupRules | None = (
            artifact.group_rules(self.config) if self.config.group_by is not None else None
        )
        self.deployment: DeploymentRecord | None = DeploymentRecord.from_metadata(artifact.metadata)
        #: certified streaming's chunk rule (the artifact's), None: whole answers
        self.chunk_rule: ChunkRule | None = (
            ChunkRule.parse(self.deployment.streaming.chunk_rule)
            if self.deployment is not None and self.deployment.streaming is not None
            else None
        )
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
        model fingerprint (with ``on_mismatch="warn"``: a warning in every decision)."""
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
        """The kernel note when ``generation`` ran on other kernels than calibration
        (:mod:`abstain_guard.contract.kernels`): not a refusal, but a
        :class:`~abstain_guard.errors.KernelMismatchWarning` once per process and a note in
        every such decision."""
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
        """The question's group (:func:`abstain_guard.guarantee.groups.group_of`); None without
        ``group_by``. Raises GuardError when ``group_by`` fails and ``on_error="raise"``."""
        return group_of(self.config, input, metadata)

    def _rule(self, group: str | None) -> tuple[DecisionRule, dict[str, Any]]:
        """The rule for a question of ``group`` and the decision's group fields."""
        if self.groups is None:
            return self.rule, {}
        rule, kind = self.groups.rule_for(group)
        return rule, {"group": group, "group_rule": kind}

    def _certificate(self, rule: DecisionRule, extra_warnings: list[str]) -> Certificate:
        """The rule's certificate as this deployment carries it: the standing and the
        response's warnings, what an API model leaves unverified, an engine's batch variance."""
        certificate = rule.guarantee.with_warnings(self._standing_warnings + extra_warnings)
        if self.deployment is not None and self.deployment.chat_model is not None:
            certificate = certificate.replace(unverified=(API_UNVERIFIED,))
        bound = self.deployment.decoding.get("live_bound") if self.deployment else None
        if bound is not None:  # an engine whose scores move with its batches (vLLM on CPU)
            certificate = certificate.replace(batch_variance=batch_variance_note(float(bound)))
        return certificate

    def _decision(
        self,
        group: str | None,
        extra_warnings: list[str] | None = None,
        **fields: Any,
    ) -> Decision:
        """The decision under the rule of ``group`` with ``fields`` (abstained, score, ...)."""
        rule, group_fields = self._rule(group)
        return Decision(
            scorer=self.artifact.scorer.name,
            threshold=rule.threshold,
            mode=rule.mode,
            target=rule.target,
            guarantee=self._certificate(rule, list(extra_warnings or [])),
            **group_fields,
            **fields,
        )

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
        self,
        message: Any,
        warnings: list[str] | None = None,
        group: str | None = None,
        *,
        step: int | None = None,
        previous: float | None = None,
    ) -> tuple[AIMessage, Decision]:
        """Score ``message`` and return ``(output message, decision)`` under ``group``'s rule.

        With ``step`` (an agent's model call or a stream's chunk, 0-based) the rule decides
        on the running maximum ``max(previous, step score)``, recorded as ``step_score`` and
        ``run_statistic``; an abstention keeps the withheld message (tool calls included) in
        ``withheld_response``. ``warnings``: mismatches found upstream (warn mode), added to
        the guarantee's.

        Raises:
            GuardError: when scoring fails and ``config.on_error == "raise"``.
            ArtifactMismatchError: the response was generated with other settings than the
                artifact was calibrated with (``config.on_mismatch == "raise"``).
        """
        notes = [*(warnings or []), *self.response_warnings(message)]
        stepped: dict[str, Any] = {} if step is None else {"step": step, "run_statistic": previous}
        try:
            if self.chunk_rule is not None and step is None:
                raise ScoringError(WHOLE_ANSWER_REFUSED)
            score = self.score(message)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if self.config.on_error == "raise":
                raise GuardError(
                    f"The guard could not score the response ({reason}). Set on_error='abstain' "
                    "to withhold unscorable responses instead."
                ) from exc
            decision = self._decision(
                group, notes, **stepped, abstained=True, score=None, reason="scoring failed",
                error=reason,
            )  # fmt: skip
            return self.abstention_message(message, decision), decision
        if step is not None:
            stepped["step_score"] = score
            score = stepped["run_statistic"] = running_statistic(previous, score)
        rule, group_fields = self._rule(group)
        answered = rule.answers(score)
        reason = "score <= threshold" if answered else "score > threshold"
        if group_fields.get("group_rule") == "abstain":
            reason = "group without a rule: abstain"
        decision = self._decision(
            group, notes, **stepped, abstained=not answered, score=score, reason=reason
        )
        if answered:
            assert isinstance(message, AIMessage)
            return with_decision(message, decision), decision
        return self.abstention_message(message, decision), decision

    def abstain(
        self, reason: str, error: str, group: str | None = None, **fields: Any
    ) -> tuple[AIMessage, Decision]:
        """Abstain without scoring: the abstention message and its decision (``score=None``,
        ``reason``, ``error`` and the extra :class:`Decision` ``fields``)."""
        decision = self._decision(
            group, None, **fields, abstained=True, score=None, reason=reason, error=error
        )
        return self.abstention_message(None, decision), decision

    def decide_unanswerable(
        self, exc: ContextLengthError, group: str | None = None
    ) -> tuple[AIMessage, Decision]:
        """Abstain on an input the model cannot take (too long for its context window) when
        ``on_error="abstain"``; with ``"raise"`` the error propagates."""
        if self.config.on_error == "raise":
            raise exc
        reason = f"{type(exc).__name__}: {exc}"
        return self.abstain("input too long", reason, group)

    def abstention_message(self, message: Any, decision: Decision) -> AIMessage:
        """The abstention message for ``decision`` (``message``: the withheld answer, or
        the part of it generated before a certified stream stopped; None for none)."""
        kwargs: dict[str, Any] = {}
        if isinstance(message, AIMessage):
            kwargs["id"] = message.id
            if message.usage_metadata is not None:
                kwargs["usage_metadata"] = message.usage_metadata
        return AIMessage(
            content=self.config.abstain_message,
            response_metadata={
                "abstention": decision.to_dict(),
                "withheld_response": _withheld(message),
            },
            **kwargs,
        )
