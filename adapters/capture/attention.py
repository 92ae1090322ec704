"""The capturing attention function registered with transformers, and its probabilities.

Outside an active session in the calling context it is exactly the model's own attention
(:func:`native_attention`); inside one the session also receives the real query/key/value
tensors, mask, scaling, soft-cap and sinks (docs/method.md, "Where each quantity is
captured"). The implementation is chosen per calling context (:func:`attention_implementation`;
docs/architecture.md, "Concurrent callers"). This module is the one home of the active-session
state (:data:`ACTIVE_SESSION`) and knows a session only by :class:`AttentionObserver`.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask


class AttentionObserver(Protocol):
    """What the attention function needs of a capture session
    (:class:`~abstain_guard.adapters.capture.CaptureSession` is one)."""

    @property
    def needs_attention(self) -> bool:
        """Whether the session reads attention tensors (full capture) or only states."""
        ...

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is an attention module this session captures."""
        ...

    def on_attention(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | torch.Tensor | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Receive the real query/key/value tensors, mask, scaling, logit soft-cap and sink
        logits of one layer call."""
        ...

    def attach(self) -> AbstractContextManager[Any]:
        """Install the session's hooks and activate it in this context (undone on exit)."""
        ...


#: Name under which the capturing attention function is registered in transformers (with
#: sdpa's boolean mask), and the name for models whose own attention is eager (additive mask).
ATTENTION_NAME = "abstain_guard_geometry"
ATTENTION_NAME_EAGER = "abstain_guard_geometry_eager"

#: The session capturing in the calling context (a context variable, so threads and tasks
#: that share a model never see each other's session).
ACTIVE_SESSION: contextvars.ContextVar[AttentionObserver | None] = contextvars.ContextVar(
    "abstain_guard_capture_session", default=None
)


#: Attention implementation chosen in the calling context, by ``id`` of a model's config
#: objects (see :func:`attention_implementation`).
_CHOSEN: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "abstain_guard_attention_implementation", default=None
)


def _chosen_getter(base: property) -> property:
    """``PretrainedConfig._attn_implementation`` that first asks :data:`_CHOSEN`."""

    def fget(self: PretrainedConfig) -> Any:
        chosen = _CHOSEN.get()
        if chosen:
            name = chosen.get(id(self))
            if name is not None:
                return name
        return base.fget(self) if base.fget is not None else None

    fget.__wrapped__ = base.fget  # type: ignore[attr-defined]
    return property(fget, base.fset, base.fdel, base.__doc__)


def _install_chosen_getter() -> None:
    """Let the calling context choose a config's attention implementation (idempotent).
    transformers' attention modules and mask builders read ``config._attn_implementation``
    at every forward; its getter now returns the implementation chosen in the calling
    context for that config object, and the config's own value everywhere else (so nothing
    changes for code that never calls :func:`attention_implementation`)."""
    base = PretrainedConfig.__dict__["_attn_implementation"]
    if getattr(base.fget, "__wrapped__", None) is None:
        PretrainedConfig._attn_implementation = _chosen_getter(base)  # type: ignore[method-assign,assignment]


def _configs(config: Any) -> list[Any]:
    """``config`` and its sub-configs (recursively): every config an attention module of
    the model may hold."""
    found = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            found.extend(_configs(sub))
    return found


@contextmanager
def attention_implementation(hf_model: Any, name: str) -> Iterator[None]:
    """Run ``hf_model``'s forwards in this context (thread or task) with the attention
    registered as ``name``; forwards of the same model in other threads keep theirs.

    Raises RuntimeError for a config class that defines its own ``_attn_implementation``
    property (the choice could not reach it)."""
    _install_chosen_getter()
    configs = _configs(hf_model.config)
    for c in configs:
        prop = getattr(type(c), "_attn_implementation", None)
        if not isinstance(prop, property) or getattr(prop.fget, "__wrapped__", None) is None:
            raise RuntimeError(
                f"{type(c).__name__} defines its own _attn_implementation; the engine cannot "
                "choose its attention per thread"
            )
    token = _CHOSEN.set({**(_CHOSEN.get() or {}), **{id(c): name for c in configs}})
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def _eager_function(module: nn.Module) -> Any:
    """The ``eager_attention_forward`` of ``module``'s own modeling module."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(
            f"{type(module).__name__} needs eager attention but its module has no "
            "eager_attention_forward"
        )
    return fn


def native_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The model's own attention output: its modeling module's eager attention where sdpa
    cannot compute it (logit soft-capping, attention sinks) or where the mask is additive
    (a model loaded with ``eager``), else sdpa."""
    eager = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        eager = True
    if not eager:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is None and query.shape[2] > 1:
        raise RuntimeError(
            f"eager attention of {type(module).__name__} over {query.shape[2]} new positions "
            "got no mask; capture_mode registers the eager mask for such models"
        )
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        lowest = torch.finfo(query.dtype).min
        attention_mask = torch.where(attention_mask, 0.0, lowest).to(query.dtype)
    return _eager_function(module)(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]


def _geometry_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The model's own attention, plus explicit probabilities for the rows of interest when
    a session is active."""
    session = ACTIVE_SESSION.get()
    out, _ = native_attention(module, query, key, value, attention_mask, **kwargs)
    if session is not None and session.owns(module):
        session.on_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            kwargs.get("scaling"),
            softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux"),
        )
    return out, None


_REGISTERED = False


def register_attention(eager: bool = False) -> str:
    """Register the capturing attention function under :data:`ATTENTION_NAME` (sdpa mask)
    and :data:`ATTENTION_NAME_EAGER` (eager mask), idempotent; returns the name for a model
    whose own attention is eager (``eager``) or not."""
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTENTION_NAME, _geometry_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        AttentionInterface.register(ATTENTION_NAME_EAGER, _geometry_attention)
        AttentionMaskInterface.register(ATTENTION_NAME_EAGER, eager_mask)
        _REGISTERED = True
    return ATTENTION_NAME_EAGER if eager else ATTENTION_NAME


@contextmanager
def capture_mode(hf_model: Any, session: AttentionObserver | None) -> Iterator[None]:
    """Switch the attention implementation and attach hooks for one call (undone after).

    With ``session=None`` nothing changes (the model runs its own attention); a session that
    reads no attention tensors (fast capture) only attaches its hooks.
    """
    if session is None:
        yield
        return
    if not session.needs_attention:
        with session.attach():
            yield
        return
    name = register_attention(eager=hf_model.config._attn_implementation == "eager")
    with attention_implementation(hf_model, name), session.attach():
        yield
