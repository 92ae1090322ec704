"""Exact per-token geometry capture inside a transformers forward pass.

One :class:`CaptureSession` follows one KV-cached generation (a prefill block, then one
position per step) or one teacher-forced replay (a single block) over a left-padded batch,
and computes for the rows of interest of each block Ω (``capture="full"``), Θ, Φ and the
states (:mod:`.features`), accumulated in float32 on each layer's device. The quantities, the
strategies and their memory: docs/method.md, "Generation and replay".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from abstain_guard.errors import InvalidInputError

from .architectures import ArchitectureSpec
from .attention import ACTIVE_SESSION
from .decode_step import DecodeInputs, KeptParts, decode_features, norm_eps, norm_factors
from .features import CAPTURE_MODES, StepFeatures, block_features
from .geometry_torch import mlp_proximity, row_probabilities
from .hook_routes import Hook, install_routes, routed
from .parts_rule import PartsRule
from .source_parts import (
    Rows,
    cached_numerators,
    dense_numerators,
    head_max_abs,
    new_parts,
    proximity_from_numerators,
    sparse_numerators,
)
from .types import ReferenceMeans

#: Strategies for the attention parts (all exact): "auto" ("cached" for a generation whose
#: ``u`` fits the memory budget; otherwise sparse for blocks of at most
#: :data:`SPARSE_MAX_ROWS` rows over more than :data:`DENSE_MAX_SOURCES` sources, dense
#: else), "cached" (keep ``u^h_s`` of every position: ``L·S·H·D`` floats; generation only),
#: "sparse", "dense" (both keep nothing per source but bounds).
STRATEGIES = ("auto", "cached", "sparse", "dense")
#: Strategy of sessions that are not given one (tests force each strategy through it).
DEFAULT_STRATEGY = "auto"
#: Memory "auto" may spend per session on kept ``u`` (L·B·positions·H·D float32; ~640
#: positions of the default model); longer generations use the bound-based strategies.
CACHE_BUDGET_BYTES = 384 << 20
SPARSE_MAX_ROWS = 4
#: "auto" keeps the dense strategy for decode steps of sessions over the budget up to this
#: many source positions (sparse beyond; docs/method.md has the measurements).
DENSE_MAX_SOURCES = 192


def default_parts() -> PartsRule:
    """The rule of sessions not given one (the module's settings, read now)."""
    return PartsRule(CACHE_BUDGET_BYTES, DENSE_MAX_SOURCES)


class CaptureSession:
    """Capture state for one generation or replay over a batch of ``batch_size`` sequences.

    Parameters
    ----------
    spec: the model's :class:`ArchitectureSpec`.
    batch_size, max_len: batch size and the longest padded sequence the session will see.
    reference: means for Φ, or None.
    keep_states: also return e~^l[T], e^l[T] per row.
    cache_values: keep ``C_MLP`` and the max-norms across forward calls (KV-cached
        generation); replay uses a single block and needs neither.
    capture: "full" (Ω, Θ, Φ) or "fast" (Θ, Φ, ω_dir; no per-source decomposition).
    parts: the rule by which "auto" picks the attention-parts strategy (None:
        :func:`default_parts`).
    strategy: how full capture computes the attention proximities (:data:`STRATEGIES`;
        None: :data:`DEFAULT_STRATEGY`); all are exact, "auto" is the fastest.
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
        capture: str = "full",
        parts: PartsRule | None = None,
        strategy: str | None = None,
    ) -> None:
        strategy = DEFAULT_STRATEGY if strategy is None else strategy
        if capture not in CAPTURE_MODES:
            raise InvalidInputError(f"capture must be one of {CAPTURE_MODES}, got {capture!r}")
        if strategy not in STRATEGIES:
            raise InvalidInputError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        install_routes(spec.capture_modules())  # no-op for a model from wrap_model
        self.spec = spec
        self.max_len = max_len
        self.batch_size = batch_size
        self.keep_states = keep_states
        self.cache_values = cache_values
        self.capture = capture
        self.strategy = strategy
        #: "auto"'s rule (a prefix of this session is computed under its budget)
        self.parts = parts if parts is not None else default_parts()
        self.num_layers = spec.num_layers
        self._attn_ids = {id(ls.attn): ls.index for ls in spec.layers}
        #: where the rows' states are gathered and the features assembled (the first layer's
        #: device); every per-layer tensor stays on its own layer's device
        self.device = spec.layers[0].device
        self._devices = [ls.device for ls in spec.layers]
        #: layers stacked on a leading axis (:attr:`ArchitectureSpec.stackable`): C_MLP and
        #: kept u are views of one tensor each, and decode steps are captured for all layers
        #: at once (:meth:`decode_step`)
        self._stacked = spec.stackable
        self._ref: dict[str, torch.Tensor] | None = None
        if reference is not None:
            self._ref = {
                k: torch.as_tensor(v, dtype=torch.float32, device=self.device)
                for k, v in reference.to_arrays().items()
            }
        self._new_cmlp()
        #: max-norms ‖u^h_s‖_∞ per layer, [B, max_len, H] (generation without kept u)
        self._unorm: list[torch.Tensor | None] = [None] * self.num_layers
        #: kept u^h_s of every position per layer, [B, H, max_len, D] (strategy "cached")
        self._u: list[torch.Tensor | None] = [None] * self.num_layers
        self._u_all: torch.Tensor | None = None  # [L, B, H, max_len, D] when stacked
        self._norms_stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cached = self._keeps_u()
        self.pos = 0
        self.steps: list[StepFeatures] = []
        self._rows: slice | None = None  # explicit rows for the next block (replay)
        #: the hooks :meth:`attach` registers (the engine calls them on the row's slice of
        #: later shared decode steps)
        self.hooks: list[Hook] = []
        self._reset_step()

    def _new_cmlp(self) -> None:
        """Zeroed ``C_MLP^l[s, s]`` of every position, per layer ``[B, max_len]`` (full
        capture; views of one ``[L, B, max_len]`` tensor when stacked)."""
        full = self.capture == "full"
        dims = (self.batch_size, self.max_len)
        self._cmlp_all: torch.Tensor | None = None
        if full and self._stacked:
            self._cmlp_all = torch.zeros(
                (self.num_layers, *dims), dtype=torch.float32, device=self.device
            )
            self._cmlp = list(self._cmlp_all)
        else:
            self._cmlp = [
                torch.zeros(dims, dtype=torch.float32, device=dev)
                for dev in (self._devices if full else [])
            ]

    def _keeps_u(self) -> bool:
        """Whether full capture keeps ``u`` of every position: strategy "cached", or "auto"
        when ``L·B·max_len·H·D`` float32 fit the rule's budget and the model keeps ``W_O``
        (KV-cached generation only)."""
        layer = self.spec.layers[0]
        need = 4 * self.num_layers * self.batch_size * self.max_len * layer.num_heads
        need *= self.spec.hidden_size
        fits = need <= self.parts.cache_budget_bytes and self.spec.keeps_wo
        chosen = self.strategy == "cached" or (self.strategy == "auto" and fits)
        return self.capture == "full" and self.cache_values and chosen

    @property
    def needs_attention(self) -> bool:
        """Whether the session reads the attention tensors (full capture only)."""
        return self.capture == "full"

    # -- bookkeeping --------------------------------------------------------------------

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is an attention module this session reads."""
        return self.needs_attention and id(module) in self._attn_ids

    def set_rows(self, rows: slice) -> None:
        """Rows of interest of the next block (default: its last position)."""
        self._rows = rows

    def _reset_step(self) -> None:
        L = self.num_layers
        self._e_in: list[torch.Tensor | None] = [None] * L
        self._probs: list[torch.Tensor | None] = [None] * L
        self._values: list[torch.Tensor | None] = [None] * L
        self._norms: list[torch.Tensor | None] = [None] * L
        self._src0 = [0] * L
        self._attn_out: list[torch.Tensor | None] = [None] * L
        self._et_full: torch.Tensor | None = None
        self._et_rows: list[torch.Tensor] = []
        self._eo_rows: list[torch.Tensor] = []
        self._prop: list[torch.Tensor] = []

    @contextmanager
    def attach(self) -> Iterator[CaptureSession]:
        """Route the hooks to forwards of this context and activate the session here;
        always undone (:mod:`.hook_routes`)."""
        token = ACTIVE_SESSION.set(self)
        hooks: list[Hook] = []
        for ls in self.spec.layers:
            i = ls.index
            hooks.append((ls.layer, "pre", self._make_layer_pre(i), True))
            hooks.append((ls.mlp_input_module, "pre", self._make_mlp_in(i), False))
            if ls.attn_out_norm is not None and self.needs_attention:
                hooks.append((ls.attn_out_norm, "pre", self._make_attn_out(i), False))
            hooks.append((ls.layer, "post", self._make_layer_post(i), False))
        self.hooks = hooks
        try:
            with routed(hooks):
                yield self
        finally:
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
            if self.needs_attention:
                self._e_in[i] = hs

        return hook

    def _make_attn_out(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._active():
                self._attn_out[i] = args[0]

        return hook

    def _make_mlp_in(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not self._active():
                return
            post_attn = args[0]
            # a copy: a view of the rows would keep the whole block's states alive until the
            # block ends (2 x L x positions x D floats on a long prompt)
            self._et_rows.append(
                post_attn[:, self.rows].to(device=self.device, dtype=torch.float32, copy=True)
            )
            if self.needs_attention:
                self._et_full = post_attn
                self._on_post_attention(i)

        return hook

    def _make_layer_post(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self._active():
                return
            out = output[0] if isinstance(output, tuple) else output
            self._eo_rows.append(
                out[:, self.rows].to(device=self.device, dtype=torch.float32, copy=True)
            )
            if self.needs_attention:
                et_full = self._et_full
                if et_full is None:
                    raise RuntimeError(f"geometry capture lost track of layer {i}")
                cm = torch.nan_to_num(mlp_proximity(et_full.float(), out.float()), nan=0.0)
                self._cmlp[i][:, self.p0 : self.p0 + self.q_len] = cm  # [B, Q]
            if i == self.num_layers - 1:
                self._finish_block()

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
        self.sparse = self.strategy == "sparse" or (
            self.strategy == "auto"
            and self.n_rows <= SPARSE_MAX_ROWS
            and self.p0 + q_len > self.parts.dense_max_sources
        )

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
        """Keep the values and the probabilities of the rows of interest for this layer
        (and, in generation, the max-norms of the new positions' ``u``); ``softcap`` and
        ``sinks`` as in :func:`.geometry_torch.row_probabilities`."""
        i = self._attn_ids[id(module)]
        q_len = query.shape[2]
        s_k = key.shape[2]
        p_end = self.p0 + q_len
        src0 = p_end - s_k
        hidden = self.spec.hidden_size
        if self.cached:
            u = self._u[i]
            if u is None:
                u = self._u[i] = self._new_u(i, query.shape[1], value.device)
            u[:, :, self.p0 : p_end] = new_parts(
                value[:, :, s_k - q_len :], self.spec.wo_kv(i), hidden
            )
        elif self.cache_values:
            unorm = self._unorm[i]
            if unorm is None:
                shape = (self.batch_size, self.max_len, query.shape[1])
                unorm = self._unorm[i] = torch.zeros(
                    shape, dtype=torch.float32, device=value.device
                )
            new = value[:, :, s_k - q_len :]
            unorm[:, self.p0 : p_end] = head_max_abs(new, self.spec.wo_kv(i), hidden)
            self._norms[i] = unorm[:, src0:p_end]
        else:
            if src0 != self.p0:
                raise RuntimeError("replay capture expects one block without a KV cache")
            if self.sparse:
                self._norms[i] = head_max_abs(value, self.spec.wo_kv(i), hidden)
        probs = row_probabilities(query, key, mask, scaling, self.rows, q_len, softcap, sinks)
        self._probs[i] = torch.nan_to_num(probs, nan=0.0)  # fully masked (padding) rows
        self._values[i] = value
        self._src0[i] = src0

    def _new_u(self, i: int, heads: int, device: torch.device) -> torch.Tensor:
        """Zeroed kept parts of layer ``i``, ``[B, H, max_len, D]`` (a view of one tensor for
        all layers when stacked)."""
        dims = (self.batch_size, heads, self.max_len, self.spec.hidden_size)
        if not self._stacked:
            return torch.zeros(dims, dtype=torch.float32, device=device)
        if self._u_all is None:
            self._u_all = torch.zeros(
                (self.num_layers, *dims), dtype=torch.float32, device=self.device
            )
            self._u = list(self._u_all)
        return self._u_all[i]

    # -- the prefix path (:mod:`..engine.prefix`) --------------------------------------------------

    def prefix_parts(
        self,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """After one block over a prefix (batch 1, full capture): ``(cmlp [L, k],
        unorm [L, k, H], u [L, H, k, D] or None)`` of its ``k`` positions."""
        k = self.pos
        cmlp = torch.stack([c[0, :k].to(self.device) for c in self._cmlp])
        if self.cached:
            u = torch.stack([x[0, :, :k].to(self.device) for x in self._u if x is not None])
            return cmlp, u.abs().amax(-1).transpose(1, 2).contiguous(), u
        unorm = torch.stack([x[0, :k].to(self.device) for x in self._unorm if x is not None])
        return cmlp, unorm, None

    def load_prefix(self, state: Any) -> None:
        """Start this (batch-1, fresh) session after a prefix: its positions' capture state
        from ``state`` (:class:`..engine.prefix.PrefixState`); parts kept only if ``state`` kept
        them."""
        k = len(state.ids)
        if self.pos != 0 or self.batch_size != 1:
            raise RuntimeError("a prefix loads into a fresh session of one sequence")
        if self.needs_attention:
            if not state.full:
                raise RuntimeError("full capture needs a prefix computed under full capture")
            self.cached = self.cached and state.u is not None
            heads = self.spec.layers[0].num_heads
            for i, dev in enumerate(self._devices):
                self._cmlp[i][0, :k] = state.cmlp[i].to(dev)
                if self.cached:
                    kept = self._u[i]
                    u = kept if kept is not None else self._new_u(i, heads, dev)
                    u[0, :, :k] = state.u[i].to(dev)
                    self._u[i] = u
                else:
                    unorm = torch.zeros((1, self.max_len, heads), dtype=torch.float32, device=dev)
                    unorm[0, :k] = state.unorm[i].to(dev)
                    self._unorm[i] = unorm
        self.pos = k

    # -- decode steps, all layers at once ----------------------------------------------------

    def defers_decode(self) -> bool:
        """Whether a decode step of this session is captured at its end for all layers at once
        (:mod:`.decode_step`): fast capture, or full capture that keeps ``u`` (strategy
        "cached") on stackable layers; otherwise the per-layer hooks run."""
        if self.batch_size != 1 or self._rows is not None:
            return False
        if self.capture == "fast":
            return True
        return self.cached and self._stacked

    def decode_step(self, inputs: DecodeInputs) -> None:
        """Capture the decode step that adds position :attr:`pos` from the step's tensors
        (one row, layers stacked), exactly what the per-layer hooks compute."""
        if self.pos + 1 > self.max_len:
            raise RuntimeError(
                f"capture session sized for {self.max_len} positions received position "
                f"{self.pos + 1}"
            )
        kept = None
        if self.needs_attention:
            if self._u_all is None:
                self._new_u(0, self.spec.layers[0].num_heads, self.device)
            if self.spec.layers[0].attn_out_norm is not None and self._norms_stacked is None:
                self._norms_stacked = self._stacked_norm()
            assert self._u_all is not None and self._cmlp_all is not None
            wo_kv = self.spec.stacked_wo_by_kv_head()
            kept = KeptParts(self._u_all, self._cmlp_all, wo_kv, self._norms_stacked)
        self.steps.append(decode_features(inputs, self.pos, kept, self._ref, self.keep_states))
        self.pos += 1

    def _stacked_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention-output norms' ``(offset + w [L, 1, D], eps [L, 1, 1])``."""
        scales, eps = [], []
        for layer in self.spec.layers:
            norm = layer.attn_out_norm
            assert norm is not None
            eps.append(norm_eps(norm))
            scales.append(layer.attn_out_norm_offset + torch.as_tensor(norm.weight).float())
        eps_t = torch.tensor(eps, dtype=torch.float32, device=self.device).view(-1, 1, 1)
        return torch.stack(scales).unsqueeze(1), eps_t

    def _on_post_attention(self, i: int) -> None:
        """``C_Attn^l`` of the rows, hence ω_prop^{l-1} (with ``C_MLP^{l-1}``)."""
        rows = self.rows
        post_attn, e_in = self._et_full, self._e_in[i]
        probs, values = self._probs[i], self._values[i]
        if post_attn is None or e_in is None or probs is None or values is None:
            raise RuntimeError(f"geometry capture lost track of layer {i}; was a hook skipped?")
        self._probs[i] = self._values[i] = self._e_in[i] = None  # nothing kept per layer
        z = post_attn[:, rows].float()  # [B, R, D]
        # the layer's input as its pre-hook saw it: with a device_map split, before
        # accelerate moved it to this layer's device
        e_self = e_in[:, rows].to(device=z.device, dtype=torch.float32)
        src0 = self._src0[i]
        s_k = probs.shape[-1]
        factor = self._norm_factor(i)
        norms, self._norms[i] = self._norms[i], None
        if i == 0:  # C_Attn^1 enters no feature (ω_prop^l uses C_Attn^{l+1})
            return
        # own position of each row in source coordinates
        t_idx = torch.arange(self.n_rows, device=z.device) + (self.p0 + rows.start - src0)
        at = Rows(z, e_self, t_idx, factor)
        kept = self._u[i]
        if kept is not None:
            num = cached_numerators(probs, kept[:, :, src0 : src0 + s_k], at)  # u [B, H, S_k, D]
        elif self.sparse and norms is not None:
            # kept and shared by the model's sessions, or built by sparse_numerators if needed
            w_flat = self.spec.wo_by_query_head(i) if self.spec.keeps_wo else None
            num = sparse_numerators(probs, values, norms, self.spec.wo_kv(i), at, w_flat)
        else:
            num = dense_numerators(probs, values, self.spec.wo_kv(i), at)
        c_attn = proximity_from_numerators(num)  # [B, R, S_k]
        cm_prev = self._cmlp[i - 1][:, src0 : src0 + s_k].to(z.device)  # [B, S_k]
        total = torch.matmul(c_attn, cm_prev.unsqueeze(-1)).squeeze(-1)  # [B, R]
        ar = torch.arange(self.n_rows, device=z.device)
        self._prop.append((total - c_attn[:, ar, t_idx] * cm_prev[:, t_idx]).to(self.device))

    def _norm_factor(self, i: int) -> torch.Tensor | None:
        """Gemma-2/3, OLMo-2: the attention-output norm's frozen per-row factor
        ``rsqrt(mean(o²) + eps) · (offset + w)``, ``[B, R, D]``."""
        layer = self.spec.layers[i]
        norm = layer.attn_out_norm
        if norm is None:
            return None
        o = self._attn_out[i]
        if o is None:
            raise RuntimeError(f"geometry capture lost the attention output of layer {i}")
        self._attn_out[i] = None
        scale = layer.attn_out_norm_offset + torch.as_tensor(norm.weight).float()
        return norm_factors(o[:, self.rows], scale, norm_eps(norm))

    def _finish_block(self) -> None:
        et = torch.stack(self._et_rows)  # [L, B, R, D]
        prop = None
        if self.needs_attention:
            prop = torch.stack(self._prop) if self._prop else et.new_zeros((0, *et.shape[1:3]))
        self.steps.append(
            block_features(
                et,
                torch.stack(self._eo_rows),
                prop,
                self._ref,
                self.keep_states,
            )
        )
        self.pos += self.q_len
        self._reset_step()
