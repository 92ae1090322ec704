"""Record abstention decisions where people look for them: tags and ``abstention`` metadata
on the guard's run in every LangChain tracer attached to it (how they reach LangSmith) and
on the LangSmith run tree, a custom callback event ``"abstention"``, a log record on the
``abstain_guard`` logger (WARNING when scoring failed) and, with ``opentelemetry-api``,
``abstain_guard.*`` attributes and an event on the current span. Without a run manager (the
middleware's hooks) the run in context is annotated.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from typing import Any
from uuid import UUID

from langchain_core.callbacks.base import BaseCallbackManager
from langchain_core.callbacks.manager import adispatch_custom_event, dispatch_custom_event
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import var_child_runnable_config
from langchain_core.tracers.base import BaseTracer

from abstain_guard.guarantee.decision import Decision

logger = logging.getLogger("abstain_guard")

EVENT_NAME = "abstention"
#: Prefix of the OpenTelemetry span attributes (``abstain_guard.abstained``, ...).
OTEL_PREFIX = "abstain_guard."

#: Decision fields that become span attributes as they are (when not None).
_OTEL_FIELDS = (
    "abstained",
    "score",
    "threshold",
    "scorer",
    "mode",
    "target",
    "reason",
    "error",
    "tool_steps",
    "step",
    "step_score",
    "run_statistic",
    "action",
    "review",
    "certified",
    "continued_by",
)


def _annotate_runs(run_manager: Any, run_id: UUID | None, decision: Decision) -> None:
    tags = ["abstained" if decision.abstained else "answered", "abstain_guard"]
    metadata = {EVENT_NAME: decision.to_dict()}
    event = {
        "name": EVENT_NAME,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "kwargs": decision.to_dict(),
    }
    updated: list[Any] = []
    if run_manager is not None and run_id is not None:
        for handler in getattr(run_manager, "handlers", None) or []:
            if not isinstance(handler, BaseTracer):
                continue
            run = handler.run_map.get(str(run_id))
            if run is None or any(run is u for u in updated):
                continue
            run.tags = [*(run.tags or []), *(t for t in tags if t not in (run.tags or []))]
            run.extra = run.extra or {}
            run.extra.setdefault("metadata", {}).update(metadata)
            run.events = [*(run.events or []), event]
            updated.append(run)
    try:
        from langsmith.run_helpers import get_current_run_tree
    except ImportError:  # pragma: no cover - langsmith ships with langchain-core
        return
    tree = get_current_run_tree()
    if tree is None or any(tree is u for u in updated):
        return
    try:
        if run_id is not None and getattr(tree, "id", None) == run_id:
            tree.add_tags(tags)
            tree.add_metadata(metadata)
        tree.add_event(event)
    except Exception:  # pragma: no cover - never let tracing break a decision
        logger.debug("Could not annotate the LangSmith run tree", exc_info=True)


def _log(decision: Decision) -> None:
    failed = decision.error is not None
    level = logging.WARNING if failed else logging.INFO
    logger.log(
        level,
        "abstain_guard %s: score=%s threshold=%s scorer=%s mode=%s target=%s%s",
        "abstained" if decision.abstained else "answered",
        decision.score,
        decision.threshold,
        decision.scorer,
        decision.mode,
        decision.target,
        f" error={decision.error}" if failed else "",
        extra={EVENT_NAME: decision.to_dict()},
    )


def _otel_value(value: Any) -> Any:
    """``value`` as an OpenTelemetry attribute value (bool, int, float, str or a
    tuple of one of them), or None when it is not one."""
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and value:
        kinds = {type(v) for v in value}
        if len(kinds) == 1 and kinds <= {bool, int, float, str}:
            return tuple(value)
        if kinds <= {int, float}:
            return tuple(float(v) for v in value)
    return None


def otel_attributes(decision: Decision) -> dict[str, Any]:
    """The decision as flat OpenTelemetry attributes: ``abstain_guard.<field>`` for the
    fields of :data:`_OTEL_FIELDS` that are set, ``abstain_guard.guarantee`` (the guarantee
    as JSON) and ``abstain_guard.guarantee.<key>`` for its scalar or list-of-scalar entries."""
    attrs: dict[str, Any] = {}
    for name in _OTEL_FIELDS:
        value = _otel_value(getattr(decision, name))
        if value is not None:
            attrs[OTEL_PREFIX + name] = value
    if decision.guarantee is not None:
        guarantee = decision.guarantee.to_dict()
        attrs[OTEL_PREFIX + "guarantee"] = json.dumps(guarantee, default=str)
        for key, item in guarantee.items():
            value = _otel_value(item)
            if value is not None:
                attrs[f"{OTEL_PREFIX}guarantee.{key}"] = value
    return attrs


def _record_otel(decision: Decision) -> None:
    """Attributes and an ``abstention`` event on the current OpenTelemetry span (nothing
    when opentelemetry-api is not installed or no span is recording)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return
    span = trace.get_current_span()
    if not span.is_recording():
        return
    try:
        attrs = otel_attributes(decision)
        span.set_attributes(attrs)
        span.add_event(EVENT_NAME, attributes=attrs)
    except Exception:  # pragma: no cover - never let tracing break a decision
        logger.debug("Could not record the decision on the OpenTelemetry span", exc_info=True)


def _context_run(run_manager: Any) -> tuple[Any, UUID | None]:
    """``run_manager`` and its run id; without one, the callback manager of the run in
    context (a LangGraph node, a runnable) and that run's id."""
    if run_manager is not None:
        return run_manager, getattr(run_manager, "run_id", None)
    callbacks = (var_child_runnable_config.get() or {}).get("callbacks")
    if isinstance(callbacks, BaseCallbackManager):
        return callbacks, callbacks.parent_run_id
    return None, None


def record_decision(
    decision: Decision,
    *,
    run_manager: Any = None,
    config: RunnableConfig | None = None,
) -> None:
    """Record one decision (module docstring); ``config``: the child config of the guard's
    run, which custom events are dispatched with (default: the config in context)."""
    manager, run_id = _context_run(run_manager)
    _annotate_runs(manager, run_id, decision)
    try:
        dispatch_custom_event(EVENT_NAME, decision.to_dict(), config=config)
    except RuntimeError:  # no parent run (called outside any runnable): nothing to notify
        logger.debug("abstention event not dispatched: no parent run")
    _record_otel(decision)
    _log(decision)


async def arecord_decision(
    decision: Decision,
    *,
    run_manager: Any = None,
    config: RunnableConfig | None = None,
) -> None:
    """Async twin of :func:`record_decision` (uses ``adispatch_custom_event``)."""
    manager, run_id = _context_run(run_manager)
    _annotate_runs(manager, run_id, decision)
    try:
        await adispatch_custom_event(EVENT_NAME, decision.to_dict(), config=config)
    except RuntimeError:
        logger.debug("abstention event not dispatched: no parent run")
    _record_otel(decision)
    _log(decision)
