"""`AbstentionMiddleware`: the guard for LangChain v1 agents (``create_agent``; the
``agents`` extra)::

    agent = create_agent(model, tools=[...], middleware=[
        AbstentionMiddleware("guard/", config=GuardConfig(mode="risk", risk_target=0.2)),
    ])

After each model call the guard decides: with step gating (``calibrate --agent``) every call
on the run's running maximum, stopping the run before the tool calls of the first call that
crosses τ; with final-answer gating only final answers. A stopped run goes where
``GuardConfig.on_abstain`` says (:mod:`.abstain_actions`); a run a human or a fallback
continued is outside the certificate. Every call is checked against the artifact's
deployment record (system prompt, tool schemas, tool choice). docs/agents.md.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any

try:
    from langchain.agents.middleware import AgentMiddleware, AgentState, hook_config
    from langchain.agents.middleware.types import ModelRequest, ModelResponse, PrivateStateAttr
    from langgraph.config import get_config
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "AbstentionMiddleware needs LangChain v1 agents (the 'agents' extra): "
        "pip install 'abstain-guard[agents]' (langchain>=1.0)."
    ) from exc

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage, ToolMessage
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.types import interrupt
from typing_extensions import NotRequired

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.contract.deployment import (
    schema_name,
    sha256_text,
    tool_steps_problem,
    tools_sha256,
)
from abstain_guard.contract.runnables import with_calibrated_capture
from abstain_guard.contract.tool_choice import free_choice, recorded_tool_choice
from abstain_guard.errors import ConfigError
from abstain_guard.guarantee.agent_steps import running_statistic
from abstain_guard.guarantee.decision import Decision
from abstain_guard.guard.abstain_actions import CONTINUED, apply_review, review_request
from abstain_guard.guard.policy import AbstentionPolicy, decision_of, with_decision
from abstain_guard.guard.tracing import arecord_decision, record_decision
from abstain_guard.monitor.binding import fit_monitor
from abstain_guard.monitor.guard_monitor import GuardMonitor

#: The agent-state key holding a fallback model's hand-over of a stopped turn.
FALLBACK_KEY = "abstention_fallback"

#: The fields of the stopping decision a fallback's messages carry (``stopped``).
_STOPPED_FIELDS = ("step", "step_score", "run_statistic", "score", "threshold", "group")


class AbstentionState(AgentState):  # type: ignore[type-arg]
    """The agent state with the guard's one key: the hand-over to a fallback chat model of
    the turn the guard stopped, ``{"turn": <id of the turn's question>, "stopped": {...}}``.
    Private (:data:`PrivateStateAttr`: no caller can send it) and valid for that turn only."""

    abstention_fallback: NotRequired[Annotated[dict[str, Any] | None, PrivateStateAttr]]


class AbstentionMiddleware(AgentMiddleware):  # type: ignore[type-arg]
    """Replaces an unreliable agent step or answer with an abstention and stops the run.

    Args:
        artifact: a :class:`GuardArtifact` or the path of an artifact directory.
        config: a :class:`GuardConfig` (or mapping); defaults to participation 0.8.
        monitor: a :class:`~abstain_guard.GuardMonitor` fed one decision per run (its
            ``run_id``, the message id, keys ``monitor.record_feedback``).
        fallback: with ``on_abstain="fallback"``: a chat model that makes the stopped call
            and the rest of the run, or an agent run on the messages before it.

    Raises:
        ConfigError: ``on_abstain="fallback"`` without a ``fallback``.
    """

    state_schema = AbstentionState

    def __init__(
        self,
        artifact: GuardArtifact | str | os.PathLike[str],
        config: GuardConfig | Mapping[str, Any] | None = None,
        monitor: GuardMonitor | None = None,
        fallback: BaseChatModel | Runnable[Any, Any] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(artifact, GuardArtifact):
            artifact = GuardArtifact.load(artifact)
        self.policy = AbstentionPolicy(artifact, config)  # type: ignore[arg-type]
        if self.policy.config.on_abstain == "fallback" and fallback is None:
            raise ConfigError(
                "on_abstain='fallback' needs a fallback: pass AbstentionMiddleware(..., "
                "fallback=<chat model or agent>) to do the rest of a stopped run"
            )
        self.fallback = fallback
        self.monitor = monitor
        fit_monitor(monitor, self.policy.artifact, self.policy.config)
        self._prepared: dict[int, tuple[BaseChatModel, BaseChatModel]] = {}

    @property
    def artifact(self) -> GuardArtifact:
        return self.policy.artifact

    @property
    def config(self) -> GuardConfig:
        return self.policy.config

    def prepare_model(self, model: BaseChatModel) -> BaseChatModel:
        """``artifact.scorer.prepare(model)`` (cached), with the fingerprint check."""
        cached = self._prepared.get(id(model))
        if cached is not None and cached[0] is model:
            return cached[1]
        prepared = self.artifact.scorer.prepare(model)
        if not isinstance(prepared, BaseChatModel):
            prepared = model
        prepared = with_calibrated_capture(prepared, self.policy.deployment)
        self.policy.check_models(prepared)
        self._prepared[id(model)] = (model, prepared)
        return prepared

    def check_request(self, request: ModelRequest) -> list[str]:  # type: ignore[type-arg]
        """Compare what the agent sends (system prompt, tool schemas, tool choice) with the
        deployment record; raise (``on_mismatch="raise"``) or return warnings."""
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
                f"the agent offers tools {[schema_name(t) for t in schemas]} but calibration "
                f"offered {[schema_name(t) for t in record.tools or []] or 'no tools'}; {how}"
            )
        problems += _tool_choice_problems(record, request)
        return self.policy.mismatch(problems, "agent request")

    def _prepare_request(self, request: ModelRequest) -> tuple[ModelRequest, list[str]]:  # type: ignore[type-arg]
        handed_over = _handover(request.state or {}) is not None
        if handed_over and isinstance(self.fallback, BaseChatModel):
            return request.override(model=self.fallback), []  # the fallback's call, ungated
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

    @property
    def gating(self) -> str:
        """``"steps"`` or ``"final_answer"``, as the artifact was calibrated."""
        record = self.policy.deployment
        agent = record.agent if record is not None else None
        return agent.gating if agent is not None else "final_answer"

    def _to_decide(self, state: Any) -> AIMessage | None:
        """The message to decide on: the last one when it is an AI message, with step
        gating whether or not it calls tools, else only a final answer."""
        messages = state.get("messages") if isinstance(state, Mapping) else None
        if not messages:
            return None
        last = messages[-1]
        if not isinstance(last, AIMessage):
            return None
        if last.tool_calls and self.gating != "steps":
            return None
        return last

    def _decide(
        self, state: Any, runtime: Any, last: AIMessage, continued: str | None = None
    ) -> tuple[AIMessage, Decision]:
        """The policy's decision on ``last``: with step gating on the run's running maximum
        (:mod:`abstain_guard.guarantee.agent_steps`) from the earlier calls of this turn."""
        group = self.policy.group_of(state, _run_metadata(runtime))
        notes = _request_notes(last)
        tool_steps = _tool_steps(state)
        if not last.tool_calls:
            notes += self.check_tool_steps(tool_steps)
        if self.gating != "steps":
            message, decision = self.policy.decide(last, notes, group)
        else:
            step, previous = _run_so_far(state, self.policy)
            if continued:  # outside the certificate: each later step on its own score
                previous = None
            message, decision = self.policy.decide(last, notes, group, step=step, previous=previous)
            decision = decision.replace(
                gating="steps", tool_calls=tuple(c["name"] for c in last.tool_calls)
            )
        return message, decision.replace(tool_steps=tool_steps)

    def check_tool_steps(self, tool_steps: int) -> list[str]:
        """A final answer after a count of tool results outside calibration's range
        (:func:`~abstain_guard.contract.deployment.tool_steps_problem`): a warning under step
        gating (the certificate covers a run accepted on its running maximum), else raised
        or warned as ``on_mismatch`` says (docs/guarantees.md, "What calibration must
        match")."""
        record = self.policy.deployment
        problem = None if record is None else tool_steps_problem(record, tool_steps)
        if problem is None:
            return []
        if self.gating == "steps":
            return [f"agent run: {problem}"]
        return self.policy.mismatch([problem], "agent run")

    def _observe(self, decision: Decision, message: AIMessage) -> Decision:
        """The decision with the monitor's ``run_id`` (as it is without a monitor)."""
        if self.monitor is None:
            return decision
        return decision.replace(run_id=self.monitor.observe(decision, run_id=message.id))

    def _outcome(self, state: Any, runtime: Any) -> tuple[dict[str, Any] | None, Decision | None]:
        """The state update and the decision of one model call (``(None, None)``: nothing to
        decide). A stopped step goes where ``config.on_abstain`` says; a fallback agent is
        left to the caller (the update's ``_fallback_agent``: the messages to run it on)."""
        handover = _handover(state)
        if handover is not None:  # the fallback's call: annotated and traced, not gated
            return self._fallback_call(state, handover)
        last = self._to_decide(state)
        if last is None:
            return None, None
        continued = _continued(state)
        message, decision = self._decide(state, runtime, last, continued)
        decision = decision.replace(certified=not continued, continued_by=continued or None)
        if not decision.abstained:
            if not last.tool_calls and not continued:
                decision = self._observe(decision, last)  # the run's outcome: accepted
            return {"messages": [with_decision(message, decision)]}, decision
        decision = decision.replace(action=self.config.on_abstain)
        if decision.action == "interrupt":  # resumed runs execute this again, up to interrupt()
            return self._review(last, message, decision, continued)
        if decision.action == "fallback":
            decision = decision.replace(certified=False, continued_by="fallback")
        if not continued:
            decision = self._observe(decision, last)
        if decision.action != "fallback":
            return {"messages": [with_decision(message, decision)], "jump_to": "end"}, decision
        data = decision.to_dict()
        stopped = {k: data[k] for k in _STOPPED_FIELDS if k in data}
        if isinstance(self.fallback, BaseChatModel):  # it makes this call and the rest
            update = {
                "messages": [RemoveMessage(id=str(last.id))],
                FALLBACK_KEY: {"turn": _turn_of(state), "stopped": stopped},
                "jump_to": "model",
            }
            return update, decision
        prior = [m for m in state["messages"] if m.id != last.id]
        handoff = {"_fallback_agent": prior, "_removed": str(last.id), "_stopped": stopped}
        return handoff, decision

    def _review(
        self, last: AIMessage, message: AIMessage, decision: Decision, continued: str | None
    ) -> tuple[dict[str, Any], Decision]:
        """A stopped step a human reviews (``on_abstain="interrupt"``): rejected, the run ends
        with the abstention; approved or edited, it goes on outside the certificate."""
        withheld = message.response_metadata.get("withheld_response") or {}
        response = interrupt(review_request(withheld, decision))
        kept, review = apply_review(last, response, max(1, len(last.tool_calls)))
        decision = decision.replace(review=review)
        if kept is not None:  # approved or edited: the run leaves the certificate
            decision = decision.replace(certified=False, continued_by=review)
        if not continued:
            decision = self._observe(decision, last)
        if kept is None:  # rejected: the run ends with the abstention
            return {"messages": [with_decision(message, decision)], "jump_to": "end"}, decision
        kept = with_decision(kept, decision.replace(action=review))
        return {"messages": [kept]}, decision

    def _continuation(
        self, stopped: Mapping[str, Any], message: AIMessage, tool_steps: int
    ) -> Decision:
        """The decision recorded on a message the fallback made after the guard stopped the
        turn: not scored (the fallback is not the calibrated model) and not gated, outside
        the certificate, with the stopping decision's step, scores and τ under ``stopped``."""
        return Decision(
            abstained=False,
            score=None,
            threshold=stopped.get("threshold"),
            scorer=self.artifact.scorer.name,
            reason="made by the fallback after the guard stopped the run: not gated",
            action="fallback",
            certified=False,
            continued_by="fallback",
            gating=self.gating,
            tool_calls=tuple(c["name"] for c in message.tool_calls),
            tool_steps=tool_steps,
            stopped=dict(stopped),
        )

    def _fallback_call(
        self, state: Any, handover: Mapping[str, Any]
    ) -> tuple[dict[str, Any] | None, Decision | None]:
        """The update and decision for a fallback chat model's call in the turn handed over
        to it: the message annotated (``certified: false``, ``continued_by: "fallback"``);
        its final answer ends the hand-over."""
        last = (state.get("messages") or [None])[-1]
        if not isinstance(last, AIMessage):
            return None, None
        decision = self._continuation(handover.get("stopped") or {}, last, _tool_steps(state))
        update: dict[str, Any] = {"messages": [with_decision(last, decision)]}
        if not last.tool_calls:
            update[FALLBACK_KEY] = None
        return update, decision

    def _fallback_update(self, update: dict[str, Any], new: Sequence[Any]) -> dict[str, Any]:
        """The fallback agent's new messages replace the stopped call and end the run; each
        of its AI messages is annotated as the fallback's (``certified: false``)."""
        prior = list(update["_fallback_agent"])
        marked: list[Any] = []
        for message in new:
            if isinstance(message, AIMessage):
                steps = _tool_steps({"messages": [*prior, *marked]})
                message = with_decision(
                    message, self._continuation(update["_stopped"], message, steps)
                )
            marked.append(message)
        return {"messages": [RemoveMessage(id=update["_removed"]), *marked], "jump_to": "end"}

    @hook_config(can_jump_to=["end", "model"])
    def after_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Decide on the model call (step gating: every call; else the final answer); on an
        abstention the run is stopped before any of the call's tool calls run and goes where
        ``config.on_abstain`` says (:mod:`abstain_guard.guard.abstain_actions`)."""
        update, decision = self._outcome(state, runtime)
        if decision is not None:
            record_decision(decision)
        if update is not None and "_fallback_agent" in update:
            prior = update["_fallback_agent"]
            agent: Any = self.fallback  # an agent (not a chat model: see _outcome)
            out = agent.invoke({"messages": prior})
            return self._fallback_update(update, list(out["messages"])[len(prior) :])
        return update

    @hook_config(can_jump_to=["end", "model"])
    async def aafter_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Async :meth:`after_model`."""
        update, decision = self._outcome(state, runtime)
        if decision is not None:
            await arecord_decision(decision)
        if update is not None and "_fallback_agent" in update:
            prior = update["_fallback_agent"]
            agent: Any = self.fallback  # an agent (not a chat model: see _outcome)
            out = await agent.ainvoke({"messages": prior})
            return self._fallback_update(update, list(out["messages"])[len(prior) :])
        return update


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


def _turn_of(state: Any) -> str | None:
    """The id of the message that opened the run's turn: the user's last message (else the
    first message). LangGraph's message reducer gives every message an id."""
    messages = list(state.get("messages") or [])
    for message in reversed(messages):
        if isinstance(message, HumanMessage):
            return None if message.id is None else str(message.id)
    return None if not messages or messages[0].id is None else str(messages[0].id)


def _handover(state: Any) -> Mapping[str, Any] | None:
    """The fallback's hand-over of this turn (:class:`AbstentionState`), or None: the guard
    decides. Anything but the hand-over this middleware wrote for the turn's question (a
    stale one from an earlier turn, a flag from elsewhere) is ignored."""
    value = state.get(FALLBACK_KEY) if isinstance(state, Mapping) else None
    if not isinstance(value, Mapping):
        return None
    turn = _turn_of(state)
    return value if turn is not None and value.get("turn") == turn else None


def _continued(state: Any) -> str | None:
    """Who continued this run after the guard stopped it (``"approved"``/``"edited"``: a
    human; ``"fallback"``), or None: the run is still the certified one."""
    if _handover(state) is not None:
        return "fallback"
    for m in _this_turn(state):
        decision = decision_of(m) if isinstance(m, AIMessage) else None
        if decision is not None and decision.action in CONTINUED:
            return str(decision.action)
    return None


def _tool_choice_problems(record: Any, request: Any) -> list[str]:
    """The model call's ``tool_choice`` against the one calibration's runs had at the same
    position of a run (``AgentRecord.call_tool_choices``; ``None`` and ``"auto"`` are one)."""
    agent = record.agent
    if agent is None or not agent.call_tool_choices:
        return []
    position = sum(
        1 for m in _this_turn({"messages": request.messages}) if isinstance(m, AIMessage)
    )
    seen = agent.call_tool_choices.get(str(position))
    if seen is None:
        return []
    asked = recorded_tool_choice(request.tool_choice)
    if free_choice(asked) in {free_choice(c) for c in seen}:
        return []
    return [
        f"model call {position + 1} of the run has tool_choice={asked or 'auto'!r}, but "
        f"calibration's runs had {sorted(str(c or 'auto') for c in seen)} there; run the "
        "agent as calibrated (the same middleware forcing or freeing tool calls)"
    ]


def _this_turn(state: Any) -> list[Any]:
    """The run's messages since the user's last message (the question)."""
    messages = list(state.get("messages") or [])
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], HumanMessage):
            return messages[i + 1 :]
    return messages


def _run_so_far(state: Any, policy: AbstentionPolicy) -> tuple[int, float | None]:
    """The last message's step (0-based model call of this turn) and the running maximum of
    the earlier calls' step scores (their recorded decisions; a call without one, e.g. made
    before the guard was added, is scored now)."""
    earlier = [m for m in _this_turn(state) if isinstance(m, AIMessage)][:-1]
    previous: float | None = None
    for m in earlier:
        decision = decision_of(m)
        score = decision.step_score if decision is not None else None
        previous = running_statistic(
            previous, float(score) if score is not None else policy.score(m)
        )
    return len(earlier), previous


def _tool_steps(state: Any) -> int:
    """Tool results in the run's messages since the user's last message."""
    count = 0
    for message in reversed(state.get("messages") or []):
        if isinstance(message, HumanMessage):
            break
        count += isinstance(message, ToolMessage)
    return count


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
