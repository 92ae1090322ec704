"""The capturing attention function registered with transformers, and its probabilities.

Attention probabilities are obtained through a function registered with transformers'
``AttentionInterface`` (with the matching ``AttentionMaskInterface`` entry). Outside an
active :class:`~abstain_guard.adapters.capture.CaptureSession` in the calling context it is
exactly ``sdpa``; inside one, the fused sdpa kernel still produces the layer output and the
session also receives the real query/key/value tensors (after RoPE and q/k norms) with the
real mask and scaling, from which :func:`row_probabilities` computes explicit
probabilities for the rows of interest only.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

if TYPE_CHECKING:  # capture.py imports this module at run time
    from .capture import CaptureSession

#: Name under which the capturing attention function is registered in transformers.
ATTENTION_NAME = "abstain_guard_geometry"

#: The session capturing in the calling context (a context variable, so threads and tasks
#: that share a model never see each other's session).
ACTIVE_SESSION: contextvars.ContextVar[CaptureSession | None] = contextvars.ContextVar(
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
def capture_mode(hf_model: Any, session: CaptureSession | None) -> Iterator[None]:
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


def row_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | torch.Tensor | None,
    rows: slice,
    q_len: int,
) -> torch.Tensor:
    """Attention probabilities of the query rows ``rows``, ``[..., H, R, S_k]`` (float32).

    ``query [..., H, Q, Dh]``, ``key [..., H_kv, S_k, Dh]``; leading dims broadcast. ``mask``
    is the model's mask (bool or additive); without one, the block of ``q_len`` new
    positions is masked causally. A fully masked row (padding) comes out as NaN.
    """
    *lead, h, _, dh = query.shape
    hkv, s_k = key.shape[-3], key.shape[-2]
    n_rep = h // hkv
    r = rows.stop - rows.start
    q_rows = query[..., rows, :].float()
    scores = torch.matmul(
        q_rows.reshape(*lead, hkv, n_rep * r, dh), key.float().transpose(-1, -2)
    ).view(*lead, h, r, s_k)
    scores = scores * (scaling if scaling is not None else dh**-0.5)
    if mask is not None:
        m = mask[..., rows, :]
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.float()
    elif q_len > 1:
        q_pos = torch.arange(rows.start, rows.stop, device=scores.device)
        k_pos = torch.arange(s_k, device=scores.device) - (s_k - q_len)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1)


__all__ = [
    "ACTIVE_SESSION",
    "ATTENTION_NAME",
    "capture_mode",
    "register_attention",
    "row_probabilities",
]
