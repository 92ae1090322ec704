"""Running a user's agent on calibration questions, exactly as it will be deployed: one run
of ``factory(model)`` per question, cached as soon as it ends (namespace :data:`AGENT_NS`),
its final answer and model calls recorded as the middleware will see them (docs/agents.md,
'Calibrate the agent as deployed').
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, cast
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from tqdm.auto import tqdm

from abstain_guard.contract.deployment import tools_sha256
from abstain_guard.contract.prompts import history_messages
from abstain_guard.contract.tool_choice import recorded_tool_choice
from abstain_guard.errors import CalibrationError, ConfigError

from ..questions.datasets import QAItem
from ..run.store import RunStore, content_key
from .answer_rows import LIKELIHOOD_METADATA, AnswerRow, AnswerRows

#: Run-store namespace of cached agent runs.
AGENT_NS = "agent_runs"

#: Why a run ended (``AgentRun.reason``).
FINAL_ANSWER = "final_answer"

#: What a cached run records (part of its key): every model call's scorer metadata.
RUN_RECORD = "steps-v1"

#: How a cached run's tool calls were read (part of its key): every call's arguments
#: validated against its tool's JSON Schema in the model's reply parsing
#: (``abstain_guard.adapters.tools.schema.tool_args_error``), so a call whose arguments do
#: not validate is an invalid call, never executed. Change it whenever the check changes
#: what a call is.
TOOL_CALL_CHECK = "tool-args-jsonschema-v1"


def load_agent_factory(spec: str) -> Callable[..., Any]:
    """The function ``"package.module:factory"`` names (imported, not called; the working
    directory is importable, so ``examples.country_agent:build_agent`` works from the root).

    Raises:
        ConfigError: the spec is not ``module:function``, the module cannot be imported, or
            it has no such callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"agent={spec!r} is not 'package.module:factory'; name the function that takes "
            "the chat model and returns the agent (e.g. 'my_app.agents:build_agent')."
        )
    if os.getcwd() not in sys.path:  # as uvicorn does: modules of the working directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"agent={spec!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?"
        ) from exc
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ConfigError(f"agent={spec!r}: {module_name!r} has no attribute {attr!r}.")
    if not callable(factory):
        raise ConfigError(f"agent={spec!r} is not callable ({type(factory).__name__}).")
    return factory  # type: ignore[no-any-return]


class OfferRecorder(BaseCallbackHandler):
    """Records what each chat-model call of a run was offered: the system message text, the
    tool schemas and ``tool_choice`` (from the call's invocation parameters: what was bound
    to the model, hence what it saw)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[BaseMessage]],
        *,
        run_id: UUID,
        invocation_params: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        params = invocation_params or {}
        for conversation in messages:
            first = conversation[0] if conversation else None
            system = str(first.text) if isinstance(first, SystemMessage) else None
            tools = params.get("tools") or None
            self.calls.append(
                {
                    "system_prompt": system,
                    "tools": json.loads(json.dumps(tools, default=str)) if tools else None,
                    "tool_choice": recorded_tool_choice(params.get("tool_choice")),
                }
            )


@dataclass
class AgentRun:
    """One agent run on one question.

    Attributes:
        final: the final answer (an AI message without parsed tool calls: the message
            :class:`~abstain_guard.guard.middleware.AbstentionMiddleware` gates live, which may
            carry malformed calls in ``invalid_tool_calls``), or None.
        reason: :data:`FINAL_ANSWER`, ``"step_limit"``, ``"no_final_answer"`` (the run
            ended on a message that is not a final answer) or ``"error: <Type>: ..."``.
        messages: the run's messages after the input (AI messages with their tool calls,
            tool results), as JSON (role, content, tool calls, tool name, status).
        offered: what each model call was offered (:class:`OfferRecorder`).
    """

    final: AIMessage | None
    reason: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    offered: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tool_calls(self) -> int:
        """Tool calls the model made in this run (parsed ones)."""
        return sum(len(m.get("tool_calls") or []) for m in self.messages if m["role"] == "ai")

    @property
    def invalid_tool_calls(self) -> int:
        """Malformed tool calls the model wrote in this run."""
        return sum(
            len(m.get("invalid_tool_calls") or []) for m in self.messages if m["role"] == "ai"
        )

    @property
    def tool_errors(self) -> int:
        """Tool results with ``status="error"`` (a tool that raised, handled by the agent)."""
        return sum(1 for m in self.messages if m["role"] == "tool" and m.get("status") == "error")

    @property
    def model_calls(self) -> int:
        """Model calls in this run."""
        return sum(1 for m in self.messages if m["role"] == "ai")


#: What a model call's message keeps for the scorers (the final answer's row keeps the same).
STEP_METADATA = (*LIKELIHOOD_METADATA, "geometry")

#: The step decision fields a guarded run's messages keep (``evaluate --live`` compares them).
DECISION_FIELDS = ("step", "step_score", "run_statistic", "abstained", "threshold")


def _message_json(m: BaseMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.type, "content": m.text if m.content else ""}
    if isinstance(m, AIMessage):
        out["tool_calls"] = [
            {"name": c["name"], "args": c["args"], "id": c.get("id")} for c in m.tool_calls
        ]
        out["invalid_tool_calls"] = [
            {"name": c.get("name"), "args": c.get("args"), "error": c.get("error")}
            for c in m.invalid_tool_calls
        ]
        meta = m.response_metadata or {}
        withheld = meta.get("withheld_response")
        if isinstance(withheld, Mapping):  # a step the guard stopped: what the model wrote
            out["tool_calls"] = [
                {"name": c["name"], "args": c["args"], "id": c.get("id")}
                for c in withheld.get("tool_calls") or []
            ]
            meta = withheld.get("response_metadata") or {}
        out["metadata"] = {k: meta[k] for k in STEP_METADATA if meta.get(k) is not None}
        decision = (m.response_metadata or {}).get("abstention")
        if isinstance(decision, Mapping):
            out["decision"] = {k: decision.get(k) for k in DECISION_FIELDS}
    if isinstance(m, ToolMessage):
        out.update(name=m.name, tool_call_id=m.tool_call_id, status=m.status)
    return out


def agent_inputs(item: QAItem) -> list[BaseMessage]:
    """The input messages of one calibration question: its earlier turns (a conversation
    row), then the question as the user's message (multiple-choice options included)."""
    return [*history_messages(item.history), HumanMessage(content=item.prompt_text())]


def run_agent(agent: Any, inputs: Sequence[BaseMessage], step_limit: int) -> AgentRun:
    """Run ``agent`` on ``inputs`` with LangGraph's ``recursion_limit=step_limit``; never
    raises for what happens inside the run (it becomes the run's ``reason``, and the run keeps
    the messages it made before it failed: the steps a step guard would have decided on)."""
    recorder = OfferRecorder()
    config = {"recursion_limit": step_limit, "callbacks": [recorder]}
    state: Mapping[str, Any] = {}
    try:  # streamed state by state, so that a failed run keeps the steps it made
        for values in agent.stream({"messages": list(inputs)}, config=config, stream_mode="values"):
            state = values
    except Exception as exc:  # the run failed: record why, go on with the next question
        name = type(exc).__name__
        reason = "step_limit" if name == "GraphRecursionError" else f"error: {name}: {exc}"
        made = list(state.get("messages", []))[len(inputs) :]
        return AgentRun(None, reason[:500], [_message_json(m) for m in made], recorder.calls)
    messages = list(state.get("messages", []))[len(inputs) :]
    as_json = [_message_json(m) for m in messages]
    last = messages[-1] if messages else None
    if isinstance(last, AIMessage) and not last.tool_calls:
        # what the middleware gates live: an AI message without (parsed) tool calls, even one
        # whose only content was a malformed call (it reaches the user as it is)
        return AgentRun(last, FINAL_ANSWER, as_json, recorder.calls)
    return AgentRun(None, "no_final_answer", as_json, recorder.calls)


def iter_runs(
    agent: Any, items: Sequence[QAItem], step_limit: int, concurrency: int = 1
) -> Iterator[tuple[QAItem, AgentRun]]:
    """``(item, run)`` for each of ``items``, as each run ends, with up to ``concurrency``
    runs in flight (threads): a local model's scheduler decodes the runs' steps together and
    gives each bitwise what it gets alone (:mod:`abstain_guard.adapters.engine.scheduler`),
    a served model gets concurrent requests. Runs are yielded in this thread, so the caller
    stores them without locks; with ``concurrency`` 1 they run in this thread, in order."""
    if concurrency <= 1 or len(items) <= 1:
        for it in items:
            yield it, run_agent(agent, agent_inputs(it), step_limit)
        return
    with ThreadPoolExecutor(max_workers=min(concurrency, len(items))) as pool:
        futures = {pool.submit(run_agent, agent, agent_inputs(it), step_limit): it for it in items}
        for future in as_completed(futures):
            yield futures[future], future.result()


def run_rows(
    agent: Any, items: Sequence[QAItem], step_limit: int, concurrency: int = 1
) -> Iterator[tuple[QAItem, AnswerRow]]:
    """``(item, run_row(...))`` for each of ``items`` (:func:`iter_runs`)."""
    for it, run in iter_runs(agent, items, step_limit, concurrency):
        yield it, run_row(run)


def run_row(run: AgentRun) -> AnswerRow:
    """The cached row of one run: the final answer like a generated answer's row (text,
    finish reason, the scorers' metadata incl. geometry) plus the run's record, whose AI
    messages keep the same metadata for every model call (:func:`step_messages`)."""
    meta = run.final.response_metadata if run.final is not None else {}
    return {
        "text": str(run.final.text) if run.final is not None else "",
        "finish_reason": meta.get("finish_reason"),
        "metadata": {k: meta[k] for k in STEP_METADATA if meta.get(k) is not None},
        "agent": {
            "reason": run.reason,
            "messages": run.messages,
            "offered": run.offered,
            "tool_calls": run.tool_calls,
            "invalid_tool_calls": run.invalid_tool_calls,
            "tool_errors": run.tool_errors,
            "model_calls": run.model_calls,
        },
    }


def run_key(item: QAItem, key_parts: Sequence[Any], step_limit: int) -> str:
    """The cache key of ``item``'s agent run: what a run records (:data:`RUN_RECORD`), how
    its tool calls were read (:data:`TOOL_CALL_CHECK`), ``key_parts`` (model fingerprint,
    agent factory, what the model carries), the step limit and the run's input messages."""
    return content_key(
        "agent",
        RUN_RECORD,
        TOOL_CALL_CHECK,
        *key_parts,
        step_limit,
        [_message_json(m) for m in agent_inputs(item)],
    )


def run_agents(
    agent: Any,
    items: Sequence[QAItem],
    store: RunStore,
    *,
    key_parts: Sequence[Any],
    step_limit: int,
    progress: bool = True,
    desc: str = "agent runs",
    executor: Any = None,
    factory: str | None = None,
    scorer: Any = None,
    concurrency: int = 1,
) -> AnswerRows:
    """One cached run per question: ``{item.id: row}`` (:func:`run_row`, plus ``"key"``).

    A run already in ``store`` under the same key (:func:`run_key`: model fingerprint, agent
    factory, step limit, what the model carries, how tool calls are read) is not run again;
    every new run is stored as soon as it ends. With ``executor`` (a
    :class:`~.executors.RayExecutor`) the runs go to its replicas, which build the agent
    themselves from ``factory`` around their model (prepared by ``scorer`` when given);
    ``agent`` is then not run here. Locally, up to ``concurrency`` runs are in flight at
    once (:func:`run_rows`).
    """
    keys = {it.id: run_key(it, key_parts, step_limit) for it in items}
    done = store.get_many(AGENT_NS, list(keys.values()))
    bar = tqdm(total=len(items), desc=desc, disable=not progress, unit="q")
    bar.update(sum(1 for it in items if keys[it.id] in done))

    def keep(it: QAItem, row: AnswerRow) -> None:
        store.put_many(AGENT_NS, {keys[it.id]: row})
        done[keys[it.id]] = row
        bar.update(1)

    todo = [it for it in items if keys[it.id] not in done]
    if executor is not None and todo:
        if factory is None:
            raise CalibrationError("agent runs on Ray need the factory's 'module:function'")
        executor.run_agents(
            todo, factory=factory, scorer=scorer, step_limit=step_limit, on_done=keep
        )
    if executor is None:
        for it, row in run_rows(agent, todo, step_limit, concurrency):
            keep(it, row)
    bar.close()
    return {it.id: cast(AnswerRow, {**done[keys[it.id]], "key": keys[it.id]}) for it in items}


def step_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The AI messages of a cached run in order: one per model call (its ``tool_calls``,
    ``metadata`` for the scorers, and ``decision`` when a guard decided on it)."""
    messages = (row.get("agent") or {}).get("messages") or []
    return [m for m in messages if m.get("role") == "ai"]


def has_final_answer(row: Mapping[str, Any]) -> bool:
    """Whether a cached run ended with a final answer (one that can be judged and scored)."""
    return bool((row.get("agent") or {}).get("reason") == FINAL_ANSWER)


def offered_once(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The system prompt, tool schemas and ``tool_choice`` every run offered: the final
    answers' (``final_tool_choice``, one or None) and each model call's by its position in
    the run (``call_tool_choices``: ``{"0": [...], "1": [...]}``, the choices seen there).

    Raises:
        CalibrationError: model calls were offered different system prompts or tools (a
            guarantee needs one fixed setting to compare deployments with).
    """
    systems, tools, finals = {}, {}, set()
    by_position: dict[int, set[str | None]] = {}
    for row in rows:
        agent = row.get("agent") or {}
        calls = agent.get("offered") or []
        for i, call in enumerate(calls):
            systems[json.dumps(call.get("system_prompt"))] = call.get("system_prompt")
            tools[tools_sha256(call.get("tools"))] = call.get("tools")
            by_position.setdefault(i, set()).add(call.get("tool_choice"))
        if has_final_answer(row) and calls:
            finals.add(calls[-1].get("tool_choice"))
    if len(systems) > 1:
        raise CalibrationError(
            f"the agent's model calls carried {len(systems)} different system prompts "
            f"({sorted(str(s)[:60] for s in systems.values())}); the guard compares a deployed "
            "agent with one calibrated prompt, so give the agent a fixed system prompt"
        )
    if len(tools) > 1:
        raise CalibrationError(
            f"the agent's model calls were offered {len(tools)} different tool lists; the "
            "guard compares a deployed agent with one calibrated list, so offer the same "
            "tools on every call (use tool_choice to force or forbid calls)"
        )
    return {
        "system_prompt": next(iter(systems.values()), None),
        "tools": next(iter(tools.values()), None),
        "final_tool_choice": next(iter(finals)) if len(finals) == 1 else None,
        "call_tool_choices": {
            str(i): sorted(by_position[i], key=lambda c: (c is not None, str(c)))
            for i in sorted(by_position)
        },
    }


def runs_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the calibration runs looked like (``AgentRecord.runs``): run count, final
    answers, runs without one per reason, tool calls per run (mean, max, histogram), the
    histogram of tool steps (tool results) before each final answer, tool errors, malformed
    calls and model calls."""
    agents = [row.get("agent") or {} for row in rows]
    reasons: dict[str, int] = {}
    for a in agents:
        reason = str(a.get("reason"))
        if reason != FINAL_ANSWER:
            key = reason.split(":")[0] + (":" + reason.split(":")[1] if ":" in reason else "")
            reasons[key] = reasons.get(key, 0) + 1
    calls = [int(a.get("tool_calls", 0)) for a in agents]
    histogram = _histogram(calls)
    steps = _histogram(
        [
            sum(1 for m in a.get("messages") or [] if m.get("role") == "tool")
            for a in agents
            if a.get("reason") == FINAL_ANSWER
        ]
    )
    n = len(agents)
    return {
        "n": n,
        "final_answers": sum(1 for a in agents if a.get("reason") == FINAL_ANSWER),
        "without_final_answer": reasons,
        "tool_calls": {
            "mean": (sum(calls) / n) if n else 0.0,
            "max": max(calls, default=0),
            "runs_with_a_call": sum(1 for c in calls if c > 0),
            "histogram": histogram,
        },
        "tool_steps_before_final_answer": steps,
        "invalid_tool_calls": sum(int(a.get("invalid_tool_calls", 0)) for a in agents),
        "tool_errors": sum(int(a.get("tool_errors", 0)) for a in agents),
        "model_calls": sum(int(a.get("model_calls", 0)) for a in agents),
    }


def _histogram(values: Sequence[int]) -> dict[str, int]:
    """``{str(value): count}`` in increasing value order."""
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return {str(v): counts[v] for v in sorted(counts)}
