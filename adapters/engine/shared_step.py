"""One decode forward shared by several rows, each computed as if it ran alone.

A shared step runs one forward over its rows (one new token each, padded with dummy rows).
Attention runs per row on that row's own unpadded cache (:func:`rows_attention`, registered
without a mask function, so transformers builds no batch mask: each row attends to all of
its own cached positions), and each row's capture hooks see only that row's slice
(:class:`HookMux`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..capture.attention import ACTIVE_SESSION, native_attention, register_attention
from ..capture.decode_step import DecodeStepCapture
from ..capture.hook_routes import Hook, routed
from ..capture.session import CaptureSession

#: Attention implementation of shared decode steps (:func:`rows_attention`).
ROWS_ATTENTION = "abstain_guard_rows"


class RowsCache:
    """The one cache object a shared forward takes, backed by each row's own cache.

    ``update`` appends each row's new key/value to that row's cache and keeps the row's full
    (unpadded) keys/values for :func:`rows_attention`; dummy rows have no cache.
    """

    def __init__(self, caches: list[Any | None]) -> None:
        self.caches = caches
        self.current: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the rows' new states; return the batch's new states unchanged."""
        self.current[layer_idx] = [
            None if c is None else c.update(key[r : r + 1], value[r : r + 1], layer_idx)
            for r, c in enumerate(self.caches)
        ]
        return key, value


@dataclass
class SharedStep:
    """What :func:`rows_attention` reads of the step running in this context: the rows'
    cache, per row the session whose per-layer hooks capture it (None: no capture, or
    captured by ``capture`` at the end of the step)."""

    cache: RowsCache
    sessions: list[CaptureSession | None]
    capture: DecodeStepCapture | None = None


_STEP: contextvars.ContextVar[SharedStep | None] = contextvars.ContextVar(
    "abstain_guard_decode_step", default=None
)


@contextmanager
def running(step: SharedStep) -> Iterator[None]:
    """Make ``step`` the shared step of forwards in this context."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def rows_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a shared decode step, one row at a time on the row's own cache (with the
    row's capture session active, if any); dummy rows get zeros."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError(f"{ROWS_ATTENTION} attention used outside a shared decode step")
    rows = step.cache.current[int(module.layer_idx)]  # type: ignore[arg-type]
    geometry = ALL_ATTENTION_FUNCTIONS[register_attention()]
    q_len, heads, dim = query.shape[2], query.shape[1], query.shape[3]
    outs = []
    for r, kv in enumerate(rows):
        if kv is None:
            outs.append(query.new_zeros((1, q_len, heads, dim)))
            continue
        session = step.sessions[r]
        fn = geometry if session is not None else native_attention  # eager where sdpa can't
        token = ACTIVE_SESSION.set(session)
        try:
            out, _ = fn(module, query[r : r + 1], kv[0], kv[1], None, **kwargs)
        finally:
            ACTIVE_SESSION.reset(token)
        outs.append(out)
    if step.capture is not None:
        keys = [None if kv is None else kv[0] for kv in rows]
        step.capture.on_attention(module, query, value, keys, kwargs)
    return torch.cat(outs, dim=0), None


_REGISTERED = False


def register_rows_attention() -> str:
    """Register :func:`rows_attention` (no mask function, on purpose; idempotent)."""
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ROWS_ATTENTION, rows_attention)
        _REGISTERED = True
    return ROWS_ATTENTION


def _split_rows(x: Any, batch: int) -> list[Any]:
    """``x`` per row: ``batch`` items, item ``r`` with row ``r`` of every batch-major tensor
    in ``x`` (a ``[1, ...]`` view; tuples, lists and dicts recursed; anything else shared).
    One pass over ``x`` for all rows (a decode step calls this per module and hook kind)."""
    if isinstance(x, torch.Tensor):
        if x.dim() > 0 and x.shape[0] == batch:
            return list(x.split(1))
        return [x] * batch
    if isinstance(x, tuple | list):
        parts = [_split_rows(v, batch) for v in x]
        kind = tuple if isinstance(x, tuple) else list
        return [kind(p[r] for p in parts) for r in range(batch)]
    if isinstance(x, dict):
        keys = list(x)
        values = [_split_rows(x[k], batch) for k in keys]
        return [dict(zip(keys, (v[r] for v in values), strict=True)) for r in range(batch)]
    return [x] * batch


class HookMux:
    """Calls each row's capture hooks (those its session registered for its prompt pass,
    :attr:`.capture.session.CaptureSession.hooks`) on that row's slice of a shared forward,
    with the row's session active (so a session sees exactly what it sees alone)."""

    def __init__(
        self, hooks: list[list[Hook]], sessions: list[CaptureSession | None], batch: int
    ) -> None:
        self.batch = batch
        self._table: dict[tuple[int, str], list[tuple[int, Hook]]] = {}
        self._modules: dict[tuple[int, str], nn.Module] = {}
        for r, row_hooks in enumerate(hooks):
            for h in row_hooks:
                key = (id(h[0]), h[1])
                self._table.setdefault(key, []).append((r, h))
                self._modules[key] = h[0]
        self.sessions = sessions

    def _call(self, key: tuple[int, str], module: nn.Module, args: tuple[Any, ...]) -> None:
        """``args``: ``(args, kwargs)`` of a pre-hook or ``(args, kwargs, output)`` of a
        forward hook; kwargs are split per row only when a hook takes them."""
        hooks = self._table[key]
        positional = _split_rows(args[0], self.batch)
        output = _split_rows(args[2], self.batch) if len(args) > 2 else None
        kwargs = _split_rows(args[1], self.batch) if any(h[3] for _, h in hooks) else None
        for r, (_, _, fn, with_kwargs) in hooks:
            sliced: tuple[Any, ...] = (positional[r],)
            if with_kwargs and kwargs is not None:
                sliced += (kwargs[r],)
            if output is not None:
                sliced += (output[r],)
            token = ACTIVE_SESSION.set(self.sessions[r])
            try:
                fn(module, *sliced)
            finally:
                ACTIVE_SESSION.reset(token)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Route one dispatching hook per (module, kind) to the forward in this context."""
        hooks: list[Hook] = [  # called with (args, kwargs) or (args, kwargs, output)
            (module, key[1], lambda m, *call, key=key: self._call(key, m, call), True)
            for key, module in self._modules.items()
        ]
        with routed(hooks):
            yield
