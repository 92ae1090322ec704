"""Find and replace chat models inside a runnable tree (duck-typed, no torch).

LangChain composes runnables as pydantic models whose fields hold other runnables:
``RunnableSequence`` (first / middle / last), ``RunnableParallel`` (steps__),
``RunnableBinding`` (bound; also ``with_config``/``bind``/``with_retry`` results),
``RunnableWithFallbacks`` (runnable, fallbacks), ``RunnableBranch`` (branches of
tuples, default), ``RunnableAssign`` (mapper), and so on. These helpers walk those fields
generically, so they also handle composites they have never heard of; opaque runnables
such as ``RunnableLambda`` are left alone. A chat model is not searched further.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.runnables import Runnable
from pydantic import BaseModel

__all__ = ["find_chat_models", "map_chat_models", "with_calibrated_capture"]


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
    """A copy of ``runnable`` in which every chat model ``m`` is replaced by ``fn(m)``.

    ``runnable`` may itself be a chat model (then ``fn(runnable)`` is returned). Parts
    of the tree that contain no chat model are shared, not copied; the input is never
    modified.

    Args:
        runnable: any LangChain runnable (or chat model).
        fn: called once per chat model found; returns its replacement.
    """
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
    """``runnable`` with every local model in it capturing under the attention-parts rule its
    artifact was calibrated with (``deployment.decoding["decode_path"]["parts"]`` of the
    artifact's :class:`~.deployment.DeploymentRecord`; a path recorded without one: the legacy
    rule). Unchanged without a record or a recorded decode path (an API model, a hand-built
    artifact) and for models without the rule (API and vLLM models). The rule picks between
    exact strategies whose float32 results differ in the last bits, so the guard deploys the
    one it was calibrated on."""
    decoding = getattr(deployment, "decoding", None)
    path = decoding.get("decode_path") if isinstance(decoding, Mapping) else None
    if not isinstance(path, Mapping):
        return runnable
    parts = path.get("parts")

    def adopt(model: BaseChatModel) -> Any:
        adopt_rule = getattr(model, "with_capture_parts", None)
        return model if adopt_rule is None else adopt_rule(parts)

    return map_chat_models(runnable, adopt)
