"""Find and replace chat models inside a runnable tree (duck-typed, no torch): the helpers
walk every pydantic field of LangChain's composites (sequences, parallels, bindings,
fallbacks, branches, ...), so they handle ones they have never heard of; opaque runnables
such as ``RunnableLambda`` are left alone, and a chat model is not searched further.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.runnables import Runnable
from pydantic import BaseModel


def _children(runnable: Any) -> list[tuple[str, Any]]:
    """``(field name, value)`` pairs of a pydantic runnable's fields."""
    if not isinstance(runnable, BaseModel):
        return []
    return [(name, getattr(runnable, name, None)) for name in type(runnable).model_fields]


def _map_value(value: Any, fn: Callable[[BaseChatModel], Any], seen: set[int]) -> Any:
    """Map ``fn`` over every chat model inside ``value`` (a runnable or a container)."""
    if isinstance(value, BaseChatModel):
        return fn(value)
    if isinstance(value, Runnable):
        return _map_runnable(value, fn, seen)
    if isinstance(value, (list, tuple)):
        mapped = [_map_value(v, fn, seen) for v in value]
        if all(a is b for a, b in zip(mapped, value, strict=True)):
            return value
        return type(value)(mapped) if isinstance(value, tuple) else mapped
    if isinstance(value, Mapping):
        mapped_d = {k: _map_value(v, fn, seen) for k, v in value.items()}
        if all(mapped_d[k] is value[k] for k in value):
            return value
        return type(value)(mapped_d) if isinstance(value, dict) else mapped_d
    return value


def _map_runnable(runnable: Runnable, fn: Callable[[BaseChatModel], Any], seen: set[int]) -> Any:
    if id(runnable) in seen:  # guard against cycles
        return runnable
    seen = seen | {id(runnable)}
    updates: dict[str, Any] = {}
    for name, value in _children(runnable):
        new = _map_value(value, fn, seen)
        if new is not value:
            updates[name] = new
    if not updates:
        return runnable
    assert isinstance(runnable, BaseModel)
    return runnable.model_copy(update=updates)


def map_chat_models(runnable: Any, fn: Callable[[BaseChatModel], Any]) -> Any:
    """A copy of ``runnable`` (or ``fn`` of it, for a chat model) in which every chat model
    ``m`` is replaced by ``fn(m)``; parts without one are shared, the input never modified."""
    return _map_value(runnable, fn, set())


def find_chat_models(runnable: Any) -> list[BaseChatModel]:
    """Every chat model inside ``runnable``, in field order (a sequence's last step last)."""
    found: list[BaseChatModel] = []

    def visit(m: BaseChatModel) -> BaseChatModel:
        if not any(m is f for f in found):
            found.append(m)
        return m

    map_chat_models(runnable, visit)
    return found


def with_calibrated_capture(runnable: Any, deployment: Any) -> Any:
    """``runnable`` with every local model in it capturing under the attention-parts rule
    its artifact was calibrated with (``decoding["decode_path"]["parts"]``; the exact
    strategies differ in the last bits); unchanged without a recorded decode path and for
    models without the rule."""
    decoding = getattr(deployment, "decoding", None)
    path = decoding.get("decode_path") if isinstance(decoding, Mapping) else None
    if not isinstance(path, Mapping):
        return runnable
    parts = path.get("parts")

    def adopt(model: BaseChatModel) -> Any:
        adopt_rule = getattr(model, "with_capture_parts", None)
        return model if adopt_rule is None else adopt_rule(parts)

    return map_chat_models(runnable, adopt)
