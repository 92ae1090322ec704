"""`AbstentionMiddleware`: the guard for LangChain v1 agents (``create_agent``).

Needs the optional ``agents`` extra (``pip install 'abstain-guard[agents]'``, i.e.
``langchain>=1``). Usage::

    from langchain.agents import create_agent
    from abstain_guard import AbstentionMiddleware, GuardConfig

    agent = create_agent(model, tools=[...], middleware=[
        AbstentionMiddleware("guard/", config=GuardConfig(mode="risk", risk_target=0.2)),
    ])

After each model call (``after_model``), a final answer - an AI message without tool
calls - is scored. An unreliable one is replaced (same message id) by the abstention
message and the run jumps to the end; a reliable one is kept, annotated with
``response_metadata["abstention"]``. Intermediate tool-calling messages are not judged;
every decision says how many tool steps preceded the answer in this turn
(``tool_steps``: tool results since the user's last message). With
``GuardConfig(group_by="key")`` the question's group is the agent state's ``key``, else the
run metadata's or a mapping ``runtime.context``'s (a ``group_by`` function gets the state).

An agent with tools keeps the guarantee when its artifact was built by
``abstain-guard calibrate --agent`` from the same agent (docs/agents.md): the artifact
records its system prompt, tool schemas, tool-call format and step limit, and every model
call is checked against them.
The model is passed through ``artifact.scorer.prepare`` (``wrap_model_call``), so scorers
that need the model to compute extra signals work here as in :class:`AbstentionGuard`.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

try:
    from langchain.agents.middleware import AgentMiddleware, hook_config
    from langchain.agents.middleware.types import ModelRequest, ModelResponse
    from langgraph.config import get_config
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "AbstentionMiddleware needs LangChain v1 agents (the 'agents' extra): "
        "pip install 'abstain-guard[agents]' (langchain>=1.0)."
    ) from exc

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.utils.function_calling import convert_to_openai_tool

from abstain_guard.artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.deployment import sha256_text, tools_sha256
from abstain_guard.monitor import GuardMonitor
from abstain_guard.monitor_binding import fit_monitor
from abstain_guard.policy import AbstentionPolicy
from abstain_guard.tracing import arecord_decision, record_decision

__all__ = ["AbstentionMiddleware"]


class AbstentionMiddleware(AgentMiddleware):  # type: ignore[type-arg]
    """Replaces an unreliable final agent answer with an abstention and ends the run.

    Args:
        artifact: a :class:`GuardArtifact` or the path of an artifact directory.
        config: a :class:`GuardConfig` (or mapping); defaults to participation 0.8.
        monitor: a :class:`~abstain_guard.monitor.GuardMonitor` fed every final-answer
            decision (fitted here when it is not yet); the decision's ``run_id`` (the
            message id) is the key of ``monitor.record_feedback``.
    """

    def __init__(
        self,
        artifact: GuardArtifact | str | os.PathLike[str],
        config: GuardConfig | Mapping[str, Any] | None = None,
        monitor: GuardMonitor | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(artifact, GuardArtifact):
            artifact = GuardArtifact.load(artifact)
        self.policy = AbstentionPolicy(artifact, config)  # type: ignore[arg-type]
        self.monitor = monitor
        fit_monitor(monitor, self.policy.artifact, self.policy.config)
        self._prepared: dict[int, tuple[BaseChatModel, BaseChatModel]] = {}

    @property
    def artifact(self) -> GuardArtifact:
        """The artifact in use."""
        return self.policy.artifact

    @property
    def config(self) -> GuardConfig:
        """The configuration in use."""
        return self.policy.config

    # --- the model: prepared once per model object -------------------------------------

    def prepare_model(self, model: BaseChatModel) -> BaseChatModel:
        """``artifact.scorer.prepare(model)`` (cached), with the fingerprint check."""
        cached = self._prepared.get(id(model))
        if cached is not None and cached[0] is model:
            return cached[1]
        prepared = self.artifact.scorer.prepare(model)
        if not isinstance(prepared, BaseChatModel):
            prepared = model
        self.policy.check_models(prepared)
        self._prepared[id(model)] = (model, prepared)
        return prepared

    def check_request(self, request: ModelRequest) -> list[str]:  # type: ignore[type-arg]
        """Compare what the agent sends (system prompt, tool schemas) with what the artifact
        was calibrated with; raise (``on_mismatch="raise"``) or return warnings.

        An artifact without a deployment record (built by hand) has nothing to compare.
        """
        record = self.policy.deployment
        if record is None:
            return []
        problems: list[str] = []
        system = request.system_message
        system_text = None if system is None else str(system.text)
        prompts = record.prompts.values()
        if prompts and all(sha256_text(system_text) != p.system_prompt_sha256 for p in prompts):
            calibrated = sorted({str(p.system_prompt) for p in prompts})
            problems.append(
                f"the agent's system prompt {system_text!r} is not the calibrated one "
                f"({calibrated}); pass the deployment's system prompt to calibrate"
            )
        schemas = [convert_to_openai_tool(t) for t in request.tools or []]
        if tools_sha256(schemas) != record.tools_sha256:
            how = (
                f"calibrate this agent with `abstain-guard calibrate --agent` "
                f"(this artifact's agent: {record.agent.factory})"
                if record.agent is not None
                else "calibrate the agent as deployed with `abstain-guard calibrate --agent`"
            )
            problems.append(
                f"the agent offers tools {[_tool_name(t) for t in schemas]} but calibration "
                f"offered {[_tool_name(t) for t in record.tools or []] or 'no tools'}; {how}"
            )
        return self.policy.mismatch(problems, "agent request")

    def _prepare_request(self, request: ModelRequest) -> tuple[ModelRequest, list[str]]:  # type: ignore[type-arg]
        notes = self.check_request(request)
        prepared = self.prepare_model(request.model)
        if prepared is not request.model:
            request = request.override(model=prepared)
        return request, notes

    def wrap_model_call(
        self,
        request: ModelRequest,  # type: ignore[type-arg]
        handler: Callable[[ModelRequest], ModelResponse],  # type: ignore[type-arg]
    ) -> ModelResponse:  # type: ignore[type-arg]
        request, notes = self._prepare_request(request)
        return _annotate(handler(request), notes)

    async def awrap_model_call(
        self,
        request: ModelRequest,  # type: ignore[type-arg]
        handler: Callable[[ModelRequest], Awaitable[ModelResponse]],  # type: ignore[type-arg]
    ) -> ModelResponse:  # type: ignore[type-arg]
        request, notes = self._prepare_request(request)
        return _annotate(await handler(request), notes)

    # --- the decision ------------------------------------------------------------------

    @staticmethod
    def _final_answer(state: Any) -> AIMessage | None:
        messages = state.get("messages") if isinstance(state, Mapping) else None
        if not messages:
            return None
        last = messages[-1]
        if not isinstance(last, AIMessage) or last.tool_calls:
            return None
        return last

    def _update(self, message: AIMessage, decision: Mapping[str, Any]) -> dict[str, Any]:
        update: dict[str, Any] = {"messages": [message]}
        if decision.get("abstained"):
            update["jump_to"] = "end"
        return update

    def _observe(self, decision: dict[str, Any], message: AIMessage) -> None:
        if self.monitor is not None:
            decision["run_id"] = self.monitor.observe(decision, run_id=message.id)

    @hook_config(can_jump_to=["end"])
    def after_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Score the final answer; abstain (and end the run) when it is unreliable."""
        last = self._final_answer(state)
        if last is None:
            return None
        group = self.policy.group_of(state, _run_metadata(runtime))
        message, decision = self.policy.decide(last, _request_notes(last), group)
        decision["tool_steps"] = _tool_steps(state)
        self._observe(decision, last)
        record_decision(decision)
        return self._update(message, decision)

    @hook_config(can_jump_to=["end"])
    async def aafter_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Async :meth:`after_model`."""
        last = self._final_answer(state)
        if last is None:
            return None
        group = self.policy.group_of(state, _run_metadata(runtime))
        message, decision = self.policy.decide(last, _request_notes(last), group)
        decision["tool_steps"] = _tool_steps(state)
        self._observe(decision, last)
        await arecord_decision(decision)
        return self._update(message, decision)


_NOTES_KEY = "abstention_request_warnings"


def _run_metadata(runtime: Any) -> dict[str, Any]:
    """Where a ``group_by`` key is looked up after the agent state: the run's ``metadata``
    (``agent.invoke(..., config={"metadata": {...}})``), then a mapping ``runtime.context``
    on top."""
    try:
        metadata = dict(get_config().get("metadata") or {})
    except RuntimeError:  # not inside a graph run (a direct call of the hook)
        metadata = {}
    context = getattr(runtime, "context", None)
    if isinstance(context, Mapping):
        metadata.update(context)
    return metadata


def _tool_steps(state: Any) -> int:
    """Tool results in the run's messages since the user's last message."""
    count = 0
    for message in reversed(state.get("messages") or []):
        if isinstance(message, HumanMessage):
            break
        count += isinstance(message, ToolMessage)
    return count


def _tool_name(schema: Mapping[str, Any]) -> str:
    return str((schema.get("function") or {}).get("name", schema.get("name", "?")))


def _annotate(response: Any, notes: list[str]) -> Any:
    """Carry request-level mismatch warnings (warn mode) on the AI message to ``after_model``."""
    if not notes:
        return response
    for i, msg in enumerate(getattr(response, "result", None) or []):
        if isinstance(msg, AIMessage):
            meta = {**(msg.response_metadata or {}), _NOTES_KEY: list(notes)}
            response.result[i] = msg.model_copy(update={"response_metadata": meta})
    return response


def _request_notes(message: AIMessage) -> list[str]:
    return list((message.response_metadata or {}).get(_NOTES_KEY) or [])
