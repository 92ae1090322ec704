"""Geometry capture of a decode step, computed once per row for all layers at the end of the
step instead of layer by layer in hooks: :class:`DecodeStepCapture` keeps references to the
step's batched tensors, then :func:`decode_features` computes each row's features from its own
slices (docs/architecture.md, "Concurrent callers"). Rows whose session keeps no ``u``, or
whose layers live on several devices, keep the per-layer hooks
(:meth:`.session.CaptureSession.defers_decode`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from .architectures import ArchitectureSpec
from .features import StepFeatures, block_features
from .geometry_torch import mlp_proximity, row_probabilities
from .hook_routes import Hook, routed
from .source_parts import Rows, cached_numerators, proximity_from_numerators


class DecodeSession(Protocol):
    """What a decode step needs of a capture session
    (:class:`~abstain_guard.adapters.capture.CaptureSession` is one; this module does not
    import it: the session imports this module)."""

    @property
    def needs_attention(self) -> bool:
        """Whether the session captures the attention parts (full capture)."""
        ...

    def decode_step(self, inputs: DecodeInputs) -> None:
        """Capture the step from one row's tensors."""
        ...


@dataclass
class DecodeInputs:
    """One row's tensors of one decode step, layers stacked on the leading axis.

    ``layer_in, post_attn, post_mlp [L, 1, D]`` (as the model computed them, any dtype),
    ``query [L, H, 1, Dh]``, ``value [L, H_kv, 1, Dh]`` (the new position's),
    ``keys``: per layer ``[1, H_kv, S_l, Dh]`` (the row's cache after the step),
    ``attn_out [L, 1, D]`` (before the attention-output norm) or None; ``scaling``,
    ``softcap``: per layer; ``sinks [L, H]`` or None.
    """

    layer_in: torch.Tensor
    post_attn: torch.Tensor
    post_mlp: torch.Tensor
    query: torch.Tensor | None
    value: torch.Tensor | None
    keys: list[torch.Tensor] | None
    attn_out: torch.Tensor | None
    scaling: list[Any]
    softcap: list[Any]
    sinks: torch.Tensor | None


def _same(values: list[Any]) -> Any:
    """The common value of per-layer scalars (None when all are None), else a ``[L', 1, 1, 1]``
    tensor; a tensor-valued scaling is kept per layer."""
    first = values[0]
    if all(v is first or (not torch.is_tensor(v) and v == first) for v in values):
        return first
    return torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in values]).view(-1, 1, 1, 1)


def layer_probabilities(inputs: DecodeInputs, layers: list[int]) -> torch.Tensor:
    """Attention probabilities of T for ``layers`` (which share one key length), ``[L', H, 1,
    S]`` float32, padding rows' NaN as 0 (:func:`.geometry_torch.row_probabilities`)."""
    assert inputs.query is not None and inputs.keys is not None
    idx = torch.tensor(layers, device=inputs.query.device)
    query = inputs.query.index_select(0, idx)
    keys = torch.cat([inputs.keys[i] for i in layers])  # [L', H_kv, S, Dh]
    scaling = _same([inputs.scaling[i] for i in layers])
    softcap = _same([inputs.softcap[i] for i in layers])
    sinks = None if inputs.sinks is None else inputs.sinks.index_select(0, idx)
    probs = row_probabilities(query, keys, None, scaling, slice(0, 1), 1, softcap, sinks)
    return torch.nan_to_num(probs, nan=0.0)


def norm_factors(
    attn_out: torch.Tensor, scale: torch.Tensor, eps: torch.Tensor | float
) -> torch.Tensor:
    """Gemma-2/3, OLMo-2: the frozen attention-output norm factor
    ``rsqrt(mean(o²) + eps) · (offset + w)`` of each row: ``attn_out [..., D]``, ``scale``
    ``[..., D]`` (``offset + w``), ``eps`` broadcast -> ``[..., D]``."""
    o = attn_out.float()
    return torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * scale


def norm_eps(norm: nn.Module) -> float:
    """The epsilon of an RMS norm module (``eps`` or ``variance_epsilon``)."""
    return float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))


@dataclass(frozen=True)
class KeptParts:
    """What full capture keeps across a session's decode steps, layers stacked: the parts
    ``u [L, 1, H, max_len, D]`` and proximities ``cmlp [L, 1, max_len]`` (both updated in
    place by :func:`decode_features`), ``W_O`` by KV head ``wo_kv [L, H_kv, Dh, n_rep·D]``
    and the attention-output norm ``(scale [L, 1, D], eps [L, 1, 1])`` or None."""

    u: torch.Tensor
    cmlp: torch.Tensor
    wo_kv: torch.Tensor
    norm: tuple[torch.Tensor, torch.Tensor] | None


class DecodeStepCapture:
    """Collects the batched tensors of one decode step and hands each row's slices to its
    session (:meth:`.session.CaptureSession.decode_step`) when the forward is done.

    ``sessions``: per row of the batch, the session to capture for, or None (a dummy row, a
    row without capture, or a row whose session keeps its per-layer hooks).
    """

    def __init__(self, spec: ArchitectureSpec, sessions: Sequence[DecodeSession | None]) -> None:
        self.spec = spec
        self.sessions = sessions
        self.full = any(s is not None and s.needs_attention for s in sessions)
        self._attn_ids = {id(ls.attn): ls.index for ls in spec.layers}
        n = spec.num_layers
        self.layer_in: list[torch.Tensor | None] = [None] * n
        self.post_attn: list[torch.Tensor | None] = [None] * n
        self.post_mlp: list[torch.Tensor | None] = [None] * n
        self.attn_out: list[torch.Tensor | None] = [None] * n
        self.query: list[torch.Tensor | None] = [None] * n
        self.value: list[torch.Tensor | None] = [None] * n
        self.keys: list[list[torch.Tensor | None] | None] = [None] * n
        self.scaling: list[Any] = [None] * n
        self.softcap: list[Any] = [None] * n
        self.sinks: list[Any] = [None] * n

    # -- collection -------------------------------------------------------------------------

    def on_attention(
        self,
        module: nn.Module,
        query: torch.Tensor,
        value: torch.Tensor,
        keys: list[torch.Tensor | None],
        kwargs: dict[str, Any],
    ) -> None:
        """Keep a layer's batched query ``[B, H, 1, Dh]`` and new values ``[B, H_kv, 1,
        Dh]``, each row's full keys (None for rows without a cache) and the attention
        call's scaling, soft-cap and sinks."""
        i = self._attn_ids.get(id(module))
        if i is None or not self.full:
            return
        self.query[i], self.value[i], self.keys[i] = query, value, keys
        self.scaling[i] = kwargs.get("scaling")
        self.softcap[i] = kwargs.get("softcap")
        self.sinks[i] = kwargs.get("s_aux")

    @contextmanager
    def installed(self) -> Iterator[DecodeStepCapture]:
        """Route one reference-keeping hook per module to the forward in this context."""

        def keep(store: list[torch.Tensor | None], i: int, post: bool = False) -> Any:
            if post:

                def hook_post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
                    store[i] = output[0] if isinstance(output, tuple) else output

                return hook_post

            def hook_pre(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
                store[i] = args[0] if args else kwargs["hidden_states"]

            return hook_pre

        hooks: list[Hook] = []
        for ls in self.spec.layers:
            i = ls.index
            hooks.append((ls.layer, "pre", keep(self.layer_in, i), True))
            hooks.append((ls.mlp_input_module, "pre", keep(self.post_attn, i), True))
            if ls.attn_out_norm is not None and self.full:
                hooks.append((ls.attn_out_norm, "pre", keep(self.attn_out, i), True))
            hooks.append((ls.layer, "post", keep(self.post_mlp, i, post=True), True))
        with routed(hooks):
            yield self

    # -- per row ----------------------------------------------------------------------------

    @staticmethod
    def _stack(tensors: list[torch.Tensor | None], what: str) -> torch.Tensor:
        if any(t is None for t in tensors):
            raise RuntimeError(f"decode-step capture lost a layer's {what}; was a hook skipped?")
        return torch.stack(tensors)  # type: ignore[arg-type]

    def finish(self) -> None:
        """Compute and append each captured row's features of this step."""
        layer_in = self._stack(self.layer_in, "input")  # [L, B, 1, D]
        post_attn = self._stack(self.post_attn, "post-attention state")
        post_mlp = self._stack(self.post_mlp, "output")
        full = self.full
        query = self._stack(self.query, "query") if full else None  # [L, B, H, 1, Dh]
        value = self._stack(self.value, "values") if full else None
        attn_out = None
        if full and self.spec.layers[0].attn_out_norm is not None:
            attn_out = self._stack(self.attn_out, "attention output")
        sinks = None
        if full and self.sinks[0] is not None:
            sinks = torch.stack([torch.as_tensor(s).float() for s in self.sinks])  # [L, H]
        for r, session in enumerate(self.sessions):
            if session is None:
                continue
            keys = None
            if full and session.needs_attention:
                keys = []
                for i, kl in enumerate(self.keys):
                    k = None if kl is None else kl[r]
                    if k is None:
                        raise RuntimeError(f"decode-step capture has no keys of layer {i}")
                    keys.append(k)
            session.decode_step(
                DecodeInputs(
                    layer_in=layer_in[:, r],
                    post_attn=post_attn[:, r],
                    post_mlp=post_mlp[:, r],
                    query=None if query is None else query[:, r],
                    value=None if value is None else value[:, r],
                    keys=keys,
                    attn_out=None if attn_out is None else attn_out[:, r],
                    scaling=self.scaling,
                    softcap=self.softcap,
                    sinks=sinks,
                )
            )


def decode_features(
    inputs: DecodeInputs,
    pos: int,
    kept: KeptParts | None,
    reference: dict[str, torch.Tensor] | None,
    keep_states: bool,
) -> StepFeatures:
    """One row's features of the decode step that adds position ``pos``; full capture
    (``kept``) also writes the new position into the kept parts and proximities."""
    et = inputs.post_attn.to(torch.float32)  # [L, 1, D]
    eo = inputs.post_mlp.to(torch.float32)
    prop = None
    if kept is not None:
        if inputs.value is None:
            raise RuntimeError("full decode-step capture needs the new values")
        u, cmlp = kept.u, kept.cmlp
        n_layers, hidden = et.shape[0], et.shape[-1]
        v = inputs.value.float()  # [L, H_kv, 1, Dh]
        new = torch.matmul(v, kept.wo_kv).view(n_layers, v.shape[1], 1, -1, hidden)
        u[:, 0, :, pos : pos + 1] = new.permute(0, 1, 3, 2, 4).reshape(n_layers, -1, 1, hidden)
        cmlp[:, 0, pos : pos + 1] = torch.nan_to_num(mlp_proximity(et, eo), nan=0.0)
        factor = (
            None
            if kept.norm is None or inputs.attn_out is None
            else norm_factors(inputs.attn_out, *kept.norm)
        )
        prop = et.new_empty((n_layers - 1, 1, 1))
        assert inputs.keys is not None
        groups: dict[int, list[int]] = {}
        for i in range(1, n_layers):  # C_Attn^1 enters no feature
            groups.setdefault(int(inputs.keys[i].shape[2]), []).append(i)
        for s_k, layers in groups.items():
            src0 = pos + 1 - s_k
            idx = torch.tensor(layers, device=et.device)
            probs = layer_probabilities(inputs, layers)  # [L', H, 1, S]
            z = et.index_select(0, idx)  # [L', 1, D]
            e_self = inputs.layer_in.index_select(0, idx).to(torch.float32)
            t_idx = torch.tensor([pos - src0], device=et.device)
            f = None if factor is None else factor.index_select(0, idx)
            if layers[-1] - layers[0] + 1 == len(layers):  # a run of layers: a view
                parts = u[layers[0] : layers[-1] + 1, 0, :, src0 : src0 + s_k]
            else:
                parts = torch.stack([u[i, 0, :, src0 : src0 + s_k] for i in layers])
            num = cached_numerators(probs, parts, Rows(z, e_self, t_idx, f))  # [L', 1, S]
            c_attn = proximity_from_numerators(num)
            cm_prev = cmlp[idx - 1, 0, src0 : src0 + s_k]  # [L', S]
            total = torch.matmul(c_attn, cm_prev.unsqueeze(-1)).squeeze(-1)  # [L', 1]
            own = c_attn[:, :, pos - src0] * cm_prev[:, pos - src0, None]
            prop[idx - 1] = (total - own).unsqueeze(-1)
    return block_features(et.unsqueeze(1), eo.unsqueeze(1), prop, reference, keep_states)
