"""The capturing attention function registered with transformers, and its probabilities.

Attention probabilities are obtained through a function registered with transformers'
``AttentionInterface`` (with the matching ``AttentionMaskInterface`` entry). Outside an
active session in the calling context it is exactly ``sdpa``; inside one, the fused sdpa
kernel still produces the layer output and the session also receives the real
query/key/value tensors (after RoPE and q/k norms) with the real mask and scaling, from which
it computes explicit probabilities for the rows of interest only
(:func:`~abstain_guard.adapters.geometry_torch.row_probabilities`).

This module is the one home of the active-session state (:data:`ACTIVE_SESSION`); it knows
a session only by the :class:`AttentionObserver` protocol, so imports run one way:
``capture`` and ``batching`` import this module, never the reverse.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


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
    ) -> None:
        """Receive the real query/key/value tensors, mask and scaling of one layer call."""
        ...

    def attach(self) -> AbstractContextManager[Any]:
        """Install the session's hooks and activate it in this context (undone on exit)."""
        ...


#: Name under which the capturing attention function is registered in transformers.
ATTENTION_NAME = "abstain_guard_geometry"

#: The session capturing in the calling context (a context variable, so threads and tasks
#: that share a model never see each other's session).
ACTIVE_SESSION: contextvars.ContextVar[AttentionObserver | None] = contextvars.ContextVar(
    "abstain_guard_capture_session", default=None
)


def _geometry_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa, plus explicit probabilities for the rows of interest when a session is active."""
    session = ACTIVE_SESSION.get()
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if session is not None and session.owns(module):
        session.on_attention(module, query, key, value, attention_mask, kwargs.get("scaling"))
    return out, None


_REGISTERED = False


def register_attention() -> str:
    """Register the capturing attention function and its mask function (idempotent)."""
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTENTION_NAME, _geometry_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _REGISTERED = True
    return ATTENTION_NAME


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
    cfg = hf_model.config
    previous = cfg._attn_implementation
    cfg._attn_implementation = register_attention()
    try:
        with session.attach():
            yield
    finally:
        cfg._attn_implementation = previous


__all__ = [
    "ACTIVE_SESSION",
    "ATTENTION_NAME",
    "AttentionObserver",
    "capture_mode",
    "register_attention",
]
