"""Exact per-token geometry capture inside a transformers forward pass.

One :class:`CaptureSession` follows a sequence of forward calls over a (left-padded) batch:
either one KV-cached generation (a prefill block, then one position per step) or one
teacher-forced replay (a single block). For the *rows of interest* of each block (the
positions T whose forward pass predicts a generated token) it computes, per layer l:

* the attention parts ``a(T, s) = 1{s=T} e^{l-1}[T] + sum_h A^h[T, s] u^h_s`` with cached
  ``u^h_s = W_O^h v^h_s`` (``[B, S, H, D]`` per layer, written once per position), probabilities
  for the newest rows only computed from the real query/key tensors (the fused sdpa kernel
  still produces the layer output); Gemma-3's attention-output RMS norm is applied to the
  parts with its scalar frozen at the value of the real forward;
* ``C_Attn^l[T, :]`` and ``C_MLP^l[s, s]`` (normalised L1 proximity), hence ω_dir, ω_prop;
* θ_dir, θ_prop and, with reference means, φ^in/φ^out (dir and prop);
* optionally the states e~^l[T], e^l[T].

Attention probabilities come from the attention function of :mod:`.attention` (exactly
``sdpa`` outside an active session); the torch math mirrors :mod:`.geometry` (see
:mod:`.geometry_torch`). Hooks are registered for the duration of one session only (see
:meth:`CaptureSession.attach`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .architectures import ArchitectureSpec
from .attention import ACTIVE_SESSION, row_probabilities
from .geometry_torch import mlp_proximity, torch_angles, torch_proximity
from .types import ReferenceMeans


@dataclass
class StepFeatures:
    """Features of the rows of one block; arrays ``[B, R, 2L-1]`` (float64)."""

    omega: np.ndarray
    theta: np.ndarray
    phi_in: np.ndarray | None
    phi_out: np.ndarray | None
    post_attn: np.ndarray | None  # [B, R, L, D]
    post_mlp: np.ndarray | None


class CaptureSession:
    """Capture state for one generation or replay over a batch of ``batch_size`` sequences.

    Parameters
    ----------
    spec: the model's :class:`ArchitectureSpec`.
    batch_size, max_len: batch size and the longest padded sequence the session will see.
    reference: means for Φ, or None.
    keep_states: also return e~^l[T], e^l[T] per row.
    cache_values: keep ``u^h_s`` across forward calls (KV-cached generation); replay uses a
        single block and needs no cache.
    max_chunk_elems: bound on the ``[rows, sources, D]`` parts tensor materialised at once.
    """

    def __init__(
        self,
        spec: ArchitectureSpec,
        *,
        batch_size: int,
        max_len: int,
        reference: ReferenceMeans | None = None,
        keep_states: bool = False,
        cache_values: bool = True,
        max_chunk_elems: int = 1 << 24,
    ) -> None:
        self.spec = spec
        self.max_len = max_len
        self.keep_states = keep_states
        self.cache_values = cache_values
        self.max_chunk_elems = max_chunk_elems
        self.num_layers = spec.num_layers
        self._attn_ids = {id(ls.attn): ls.index for ls in spec.layers}
        self.device = spec.layers[0].wo_heads.device
        # W_O grouped by KV head: [H_kv, Dh, n_rep * D], so u = v @ W needs no head repeat
        self._wo_kv = [
            ls.wo_heads.reshape(ls.num_kv_heads, ls.num_heads // ls.num_kv_heads, ls.head_dim, -1)
            .permute(0, 2, 1, 3)
            .reshape(ls.num_kv_heads, ls.head_dim, -1)
            .contiguous()
            for ls in spec.layers
        ]
        self._ref: dict[str, torch.Tensor] | None = None
        if reference is not None:
            self._ref = {
                k: torch.as_tensor(v, dtype=torch.float32, device=self.device)
                for k, v in reference.to_arrays().items()
            }
        self._u_all: torch.Tensor | None = None  # [L, B, max_len, H, D] (generation)
        self._fast_ready = False
        self.fast = False
        self._cmlp = torch.zeros(
            (self.num_layers, batch_size, max_len), dtype=torch.float32, device=self.device
        )
        self.pos = 0
        self.steps: list[StepFeatures] = []
        self._rows: slice | None = None  # explicit rows for the next block (replay)
        self._handles: list[Any] = []
        self._reset_step()

    # -- bookkeeping --------------------------------------------------------------------

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is an attention module of this session's model."""
        return id(module) in self._attn_ids

    def set_rows(self, rows: slice) -> None:
        """Rows of interest of the next block (default: its last position)."""
        self._rows = rows

    def _reset_step(self) -> None:
        L = self.num_layers
        self._e_in: list[torch.Tensor | None] = [None] * L
        self._probs: list[torch.Tensor | None] = [None] * L
        self._u_src: list[torch.Tensor | None] = [None] * L
        self._src0 = [0] * L
        self._attn_out: list[torch.Tensor | None] = [None] * L
        self._et_full: torch.Tensor | None = None
        self._et_rows: torch.Tensor | None = None
        self._dir: dict[str, list[torch.Tensor]] = {"omega": [], "theta": [], "pin": [], "pout": []}
        self._prop: dict[str, list[torch.Tensor]] = {
            "omega": [],
            "theta": [],
            "pin": [],
            "pout": [],
        }
        self._st_attn: list[torch.Tensor] = []
        self._st_mlp: list[torch.Tensor] = []

    @contextmanager
    def attach(self) -> Iterator[CaptureSession]:
        """Install the hooks and activate the session in this context; always undone."""
        token = ACTIVE_SESSION.set(self)
        try:
            for ls in self.spec.layers:
                i = ls.index
                self._handles.append(
                    ls.layer.register_forward_pre_hook(self._make_layer_pre(i), with_kwargs=True)
                )
                self._handles.append(
                    ls.mlp_input_module.register_forward_pre_hook(self._make_mlp_in(i))
                )
                if ls.attn_out_norm is not None:
                    self._handles.append(
                        ls.attn_out_norm.register_forward_pre_hook(self._make_attn_out(i))
                    )
                self._handles.append(ls.layer.register_forward_hook(self._make_layer_post(i)))
            yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            ACTIVE_SESSION.reset(token)

    # -- hooks ----------------------------------------------------------------------------

    def _active(self) -> bool:
        return ACTIVE_SESSION.get() is self

    def _make_layer_pre(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self._active():
                return
            hs = args[0] if args else kwargs["hidden_states"]
            if i == 0:
                self._start_block(int(hs.shape[1]))
                if self.fast:
                    self._e0 = hs[:, -1]
            if not self.fast:
                self._e_in[i] = hs

        return hook

    def _make_attn_out(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._active():
                if self.fast:
                    self._o_rows[i] = args[0][:, -1]
                else:
                    self._attn_out[i] = args[0]

        return hook

    def _make_mlp_in(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._active():
                if self.fast:
                    self._et_rows_l[i] = args[0][:, -1]
                else:
                    self._on_post_attention(i, args[0])

        return hook

    def _make_layer_post(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._active():
                out = output[0] if isinstance(output, tuple) else output
                if self.fast:
                    self._eo_rows_l[i] = out[:, -1]
                    if i == self.num_layers - 1:
                        self._finish_fast()
                else:
                    self._on_layer_output(i, out)

        return hook

    # -- per block --------------------------------------------------------------------------

    def _start_block(self, q_len: int) -> None:
        self._reset_step()
        self.q_len = q_len
        self.p0 = self.pos
        if self.p0 + q_len > self.max_len:
            raise RuntimeError(
                f"capture session sized for {self.max_len} positions received position "
                f"{self.p0 + q_len}"
            )
        rows = self._rows if self._rows is not None else slice(q_len - 1, q_len)
        self._rows = None
        self.rows = rows
        self.n_rows = rows.stop - rows.start
        self.fast = q_len == 1 and self.n_rows == 1 and self.cache_values and self._fast_ready
        if self.fast:
            self._p_all[..., : self.p0 + 1].zero_()

    def on_attention(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | None,
    ) -> None:
        """Cache ``u`` for the new positions and the probabilities of the rows of interest."""
        i = self._attn_ids[id(module)]
        q_len = query.shape[2]
        s_k = key.shape[2]
        p_end = self.p0 + q_len
        src0 = p_end - s_k
        v_new = value[:, :, s_k - q_len :]  # [B, H_kv, Q, Dh]
        if self.fast:  # deferred: all layers of a decode step are handled together
            self._fast_attn[i] = (query, key, v_new, mask, scaling)
            return
        n_heads = query.shape[1]
        hidden = self.spec.hidden_size
        u_kv = torch.matmul(v_new, self._wo_kv[i])  # [B, H_kv, Q, n_rep * D]
        if self.cache_values:
            if self._u_all is None:
                self._allocate(query.shape[0], n_heads, hidden, u_kv.dtype)
            assert self._u_all is not None
            dest = self._u_all[i, :, self.p0 : p_end]  # [B, Q, H, D]
            dest.view(dest.shape[0], q_len, v_new.shape[1], -1).copy_(u_kv.transpose(1, 2))
            u_src = self._u_all[i, :, src0:p_end]
        else:
            if src0 != self.p0:
                raise RuntimeError("replay capture expects one block without a KV cache")
            u_src = u_kv.transpose(1, 2).reshape(query.shape[0], q_len, n_heads, hidden)
        probs = row_probabilities(query, key, mask, scaling, self.rows, q_len)
        probs = torch.nan_to_num(probs, nan=0.0)  # fully masked (padding) rows
        self._probs[i] = probs
        self._u_src[i] = u_src
        self._src0[i] = src0

    def _fast_attention(self) -> None:
        """Decode step: ``u`` of the new position and the probability rows, all layers."""
        assert self._u_all is not None
        recs = self._fast_attn
        L = self.num_layers
        t = self.p0
        b = recs[0][0].shape[0]
        hkv = recs[0][2].shape[1]
        v = torch.stack([rec[2][:, :, 0] for rec in recs])  # [L, B, H_kv, Dh]
        u = torch.matmul(v.unsqueeze(-2), self._wo_kv_all.unsqueeze(1))  # [L,B,H_kv,1,nD]
        self._u_all[:, :, t].view(L, b, hkv, -1).copy_(u.squeeze(-2))
        same = all(
            rec[1].shape == recs[0][1].shape and rec[3] is recs[0][3] and rec[4] == recs[0][4]
            for rec in recs
        )
        if same:
            q = torch.stack([rec[0] for rec in recs])  # [L, B, H, 1, Dh]
            k = torch.stack([rec[1] for rec in recs])  # [L, B, H_kv, S_k, Dh]
            probs = row_probabilities(q, k, recs[0][3], recs[0][4], self.rows, 1)  # [L,B,H,1,S_k]
            s_k = k.shape[-2]
            self._p_all[:, :, :, t + 1 - s_k : t + 1] = probs[:, :, :, 0]
        else:
            for i, (q1, k1, _, m1, sc1) in enumerate(recs):
                s_k = k1.shape[-2]
                probs = row_probabilities(q1, k1, m1, sc1, self.rows, 1)  # [B, H, 1, S_k]
                self._p_all[i, :, :, t + 1 - s_k : t + 1] = probs[:, :, 0]

    def _allocate(self, batch: int, heads: int, hidden: int, dtype: torch.dtype) -> None:
        """Buffers of a generation session: the ``u`` cache and the decode-step rows."""
        L, dev = self.num_layers, self.device
        self._u_all = torch.zeros((L, batch, self.max_len, heads, hidden), dtype=dtype, device=dev)
        self._p_all = torch.zeros((L, batch, heads, self.max_len), dtype=torch.float32, device=dev)
        self._e0 = torch.zeros((batch, hidden), device=dev)
        self._et_rows_l: list[torch.Tensor] = [self._e0] * L
        self._eo_rows_l: list[torch.Tensor] = [self._e0] * L
        self._o_rows: list[torch.Tensor] = [self._e0] * L
        norms = [ls.attn_out_norm for ls in self.spec.layers]
        self._norm_w: torch.Tensor | None = None
        if all(n is not None for n in norms):
            self._norm_w = torch.stack(
                [torch.as_tensor(n.weight).float() for n in norms]  # type: ignore[union-attr]
            ).to(dev)  # [L, D]
            self._norm_eps = torch.tensor(
                [float(getattr(n, "eps", 1e-6)) for n in norms],
                dtype=torch.float32,
                device=dev,
            )
        elif any(n is not None for n in norms):
            raise RuntimeError("mixed attention-output norms are not supported")
        self._wo_kv_all = torch.stack(self._wo_kv)  # [L, H_kv, Dh, n_rep * D]
        self._fast_attn: list[Any] = [None] * L
        self._fast_ready = True

    def _finish_fast(self) -> None:
        """One decode step, all layers at once: rows ``[L, B, D]``, sources ``[0, T]``."""
        assert self._u_all is not None
        self._fast_attention()
        t = self.p0
        s_len = t + 1
        et = torch.stack(self._et_rows_l).float()  # [L, B, D]
        eo = torch.stack(self._eo_rows_l).float()
        e_in = torch.cat([self._e0.unsqueeze(0).float(), eo[:-1]], dim=0)  # e^{l-1}[T]
        cm_new = torch.nan_to_num(mlp_proximity(et, eo), nan=0.0)  # [L, B]
        self._cmlp[:, :, t] = cm_new
        u = self._u_all[:, :, :s_len]
        parts = torch.einsum("lbhs,lbshd->lbsd", self._p_all[..., :s_len].to(u.dtype), u).float()
        if self._norm_w is not None:
            rms = torch.rsqrt(
                torch.stack(self._o_rows).float().pow(2).mean(-1, keepdim=True)
                + self._norm_eps[:, None, None]
            )
            parts = parts * (rms * (1.0 + self._norm_w[:, None, :])).unsqueeze(2)
        parts[:, :, t] += e_in
        c_attn = torch_proximity(et, parts)  # [L, B, S]
        prop = (self._cmlp[:-1, :, :t] * c_attn[1:, :, :t]).sum(-1)  # [L-1, B]
        L = self.num_layers
        feats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            "omega": (cm_new, prop),
            "theta": (torch_angles(et, eo), torch_angles(eo[:-1], et[1:])),
        }
        if self._ref is not None:
            r = self._ref
            for name, suffix in (("pin", "in"), ("pout", "out")):
                feats[name] = (
                    torch_angles(r["post_mlp_" + suffix][:, None, :], eo),
                    torch_angles(r["post_attn_" + suffix][1:, None, :], et[1:]),
                )

        def inter(pair: tuple[torch.Tensor, torch.Tensor]) -> np.ndarray:
            d, p = pair
            out = torch.empty((d.shape[1], 1, 2 * L - 1), dtype=torch.float64)
            out[:, 0, 0::2] = d.t().double().cpu()
            out[:, 0, 1::2] = p.t().double().cpu()
            return out.numpy()

        has_ref = self._ref is not None
        self.steps.append(
            StepFeatures(
                omega=inter(feats["omega"]),
                theta=inter(feats["theta"]),
                phi_in=inter(feats["pin"]) if has_ref else None,
                phi_out=inter(feats["pout"]) if has_ref else None,
                post_attn=et.transpose(0, 1).unsqueeze(1).cpu().numpy().copy()
                if self.keep_states
                else None,
                post_mlp=eo.transpose(0, 1).unsqueeze(1).cpu().numpy().copy()
                if self.keep_states
                else None,
            )
        )
        self.pos += 1
        self._reset_step()

    def _on_post_attention(self, i: int, post_attn: torch.Tensor) -> None:
        rows = self.rows
        self._et_full = post_attn
        et_rows = post_attn[:, rows].float()  # [B, R, D]
        e_in = self._e_in[i]
        probs = self._probs[i]
        u_src = self._u_src[i]
        if e_in is None or probs is None or u_src is None:
            raise RuntimeError(f"geometry capture lost track of layer {i}; was a hook skipped?")
        ein_rows = e_in[:, rows].float()
        src0 = self._src0[i]
        s_k = probs.shape[-1]
        factor: torch.Tensor | None = None
        norm = self.spec.layers[i].attn_out_norm
        if norm is not None:
            o = self._attn_out[i]
            assert o is not None
            o_rows = o[:, rows].float()
            eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
            weight = torch.as_tensor(norm.weight).float()
            factor = torch.rsqrt(o_rows.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)
        # self position of each row in source coordinates
        t_idx = torch.arange(self.n_rows, device=et_rows.device) + (self.p0 + rows.start - src0)
        c_attn = self._attention_proximity(probs, u_src, et_rows, ein_rows, t_idx, factor)
        self._et_rows = et_rows
        if i > 0:
            cm_prev = self._cmlp[i - 1, :, src0 : src0 + s_k]  # [B, S_k]
            total = torch.matmul(c_attn, cm_prev.unsqueeze(-1)).squeeze(-1)  # [B, R]
            self_term = c_attn[:, torch.arange(self.n_rows), t_idx] * cm_prev[:, t_idx]
            self._prop["omega"].append(total - self_term)
            prev_out = ein_rows
            self._prop["theta"].append(torch_angles(prev_out, et_rows))
            if self._ref is not None:
                self._prop["pin"].append(torch_angles(self._ref["post_attn_in"][i], et_rows))
                self._prop["pout"].append(torch_angles(self._ref["post_attn_out"][i], et_rows))
        if self.keep_states:
            self._st_attn.append(et_rows)

    def _attention_proximity(
        self,
        probs: torch.Tensor,
        u_src: torch.Tensor,
        z: torch.Tensor,
        e_self: torch.Tensor,
        t_idx: torch.Tensor,
        factor: torch.Tensor | None,
    ) -> torch.Tensor:
        """``C_Attn[T_r, s]`` for the rows: ``[B, R, S_k]``, chunked over rows."""
        b, _, r, s_k = probs.shape
        d = u_src.shape[-1]
        chunk = max(1, self.max_chunk_elems // max(1, b * s_k * d))
        u32 = u_src.float()  # [B, S_k, H, D]
        out = []
        for start in range(0, r, chunk):
            stop = min(r, start + chunk)
            p = probs[:, :, start:stop].permute(0, 3, 2, 1)  # [B, S_k, r, H]
            parts = torch.matmul(p, u32).permute(0, 2, 1, 3)  # [B, r, S_k, D]
            if factor is not None:
                parts = parts * factor[:, start:stop, None, :]
            ar = torch.arange(stop - start, device=parts.device)
            parts[:, ar, t_idx[start:stop]] += e_self[:, start:stop]
            out.append(torch_proximity(z[:, start:stop], parts))
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    def _on_layer_output(self, i: int, out: torch.Tensor) -> None:
        et_full = self._et_full
        et_rows = self._et_rows
        if et_full is None or et_rows is None:
            raise RuntimeError(f"geometry capture lost track of layer {i}; was a hook skipped?")
        rows = self.rows
        cm = torch.nan_to_num(mlp_proximity(et_full.float(), out.float()), nan=0.0)  # [B, Q]
        self._cmlp[i, :, self.p0 : self.p0 + self.q_len] = cm
        eo_rows = out[:, rows].float()
        self._dir["omega"].append(cm[:, rows])
        self._dir["theta"].append(torch_angles(et_rows, eo_rows))
        if self._ref is not None:
            self._dir["pin"].append(torch_angles(self._ref["post_mlp_in"][i], eo_rows))
            self._dir["pout"].append(torch_angles(self._ref["post_mlp_out"][i], eo_rows))
        if self.keep_states:
            self._st_mlp.append(eo_rows)
        if i == self.num_layers - 1:
            self._finish_block()

    def _finish_block(self) -> None:
        def inter(key: str) -> np.ndarray:
            d = torch.stack(self._dir[key], dim=-1)  # [B, R, L]
            p = torch.stack(self._prop[key], dim=-1)  # [B, R, L-1]
            out = torch.empty((*d.shape[:-1], 2 * d.shape[-1] - 1), dtype=torch.float64)
            out[..., 0::2] = d.double().cpu()
            out[..., 1::2] = p.double().cpu()
            return out.numpy()

        has_ref = self._ref is not None
        self.steps.append(
            StepFeatures(
                omega=inter("omega"),
                theta=inter("theta"),
                phi_in=inter("pin") if has_ref else None,
                phi_out=inter("pout") if has_ref else None,
                post_attn=(
                    torch.stack(self._st_attn, 2).cpu().numpy() if self.keep_states else None
                ),
                post_mlp=(torch.stack(self._st_mlp, 2).cpu().numpy() if self.keep_states else None),
            )
        )
        self.pos += self.q_len
        self._reset_step()


__all__ = ["CaptureSession", "StepFeatures"]
