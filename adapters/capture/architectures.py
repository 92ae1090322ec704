"""Where the residual-stream quantities live in each supported transformers family: the hooks'
modules, the per-head output projections ``W_O^h`` ``[H, Dh, D]`` and the attention-output
norm of the families that have one (docs/method.md, "Where each quantity is captured" and
"Supported families").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from abstain_guard.errors import UnsupportedArchitectureError

from .source_parts import heads_by_query

#: model_type -> human-readable family, the architectures geometry capture supports.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama (SmolLM2, Llama 2/3)",
    "qwen2": "Qwen2 / Qwen2.5",
    "mistral": "Mistral",
    "gemma3_text": "Gemma-3 (text)",
    "gpt2": "GPT-2",
    "qwen3": "Qwen3 (dense)",
    "qwen3_moe": "Qwen3-MoE",
    "smollm3": "SmolLM3",
    "gemma2": "Gemma-2",
    "phi3": "Phi-3 / Phi-3.5 / Phi-4-mini",
    "olmo2": "OLMo-2",
    "granite": "Granite 3 (dense)",
    "gpt_oss": "gpt-oss",
}

#: Families whose attention output is RMS-normalised before it joins the residual stream,
#: and the offset of that norm's weight (Gemma: ``1 + w``; OLMo-2: ``w``).
ATTENTION_OUTPUT_NORM: dict[str, float] = {"gemma3_text": 1.0, "gemma2": 1.0, "olmo2": 0.0}
#: Families whose MLP block starts with ``pre_feedforward_layernorm`` (sandwich norms).
_PRE_FEEDFORWARD = ("gemma3_text", "gemma2")


@dataclass
class LayerSpec:
    """Handles and weights for one decoder layer."""

    index: int
    layer: nn.Module
    attn: nn.Module
    mlp_input_module: nn.Module
    attn_out_norm: nn.Module | None
    wo_heads: torch.Tensor  # [H, Dh, D], residual multiplier included
    num_heads: int
    num_kv_heads: int
    head_dim: int
    #: offset of the attention-output norm's weight (``offset + w``; unused without a norm)
    attn_out_norm_offset: float = 1.0

    @property
    def device(self) -> torch.device:
        """Where this layer's weights (and so its capture tensors) live."""
        return self.wo_heads.device


#: Largest share of a model's weight bytes that its float32 ``W_O`` copies may take for
#: capture to keep them (:attr:`ArchitectureSpec.keeps_wo`); they are always kept up to
#: ``WO_KEEP_MIN_BYTES``, and always on these device types (on the CPU regrouping per use is
#: a transposed copy per layer and token).
WO_KEEP_SHARE = 0.2
WO_KEEP_MIN_BYTES = 256 << 20
WO_KEEP_DEVICE_TYPES = ("cpu",)


@dataclass
class ArchitectureSpec:
    """All layers of a supported model plus model-wide facts."""

    model_type: str
    layers: list[LayerSpec]
    hidden_size: int
    context_length: int
    #: bytes of the model's parameters (0: unknown; :attr:`keeps_wo` then uses the floor)
    weight_bytes: int = 0
    _wo_kv: list[torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    _wo_kv_all: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _wo_q: dict[int, torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _keeps_wo: bool | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        """L."""
        return len(self.layers)

    def capture_modules(self) -> list[nn.Module]:
        """Every module a capture hooks (layers, MLP inputs, attention-output norms)."""
        found: list[nn.Module] = []
        for ls in self.layers:
            found += [ls.layer, ls.mlp_input_module]
            if ls.attn_out_norm is not None:
                found.append(ls.attn_out_norm)
        return found

    @property
    def stackable(self) -> bool:
        """Whether every layer has the same head layout on the same device, so capture may
        stack per-layer tensors on a leading ``[L]`` axis."""
        first = self.layers[0]
        return all(
            (ls.device, ls.num_heads, ls.num_kv_heads, ls.head_dim)
            == (first.device, first.num_heads, first.num_kv_heads, first.head_dim)
            for ls in self.layers
        )

    @property
    def keeps_wo(self) -> bool:
        """Whether capture keeps ``W_O`` regrouped in float32 for the model's lifetime (two
        copies, by KV head and by query head: ``8·L·H·Dh·D`` bytes) or regroups a layer's
        ``W_O`` each time it needs it (the same float32 numbers)."""
        if self._keeps_wo is None:
            n = sum(ls.num_heads * ls.head_dim * self.hidden_size for ls in self.layers)
            limit = max(WO_KEEP_SHARE * self.weight_bytes, WO_KEEP_MIN_BYTES)
            on_kept_device = all(ls.device.type in WO_KEEP_DEVICE_TYPES for ls in self.layers)
            self._keeps_wo = on_kept_device or 8 * n <= limit
        return self._keeps_wo

    def _regrouped(self, i: int) -> torch.Tensor:
        ls = self.layers[i]
        return (
            ls.wo_heads.reshape(ls.num_kv_heads, ls.num_heads // ls.num_kv_heads, ls.head_dim, -1)
            .permute(0, 2, 1, 3)
            .reshape(ls.num_kv_heads, ls.head_dim, -1)
            .float()
        )

    def wo_by_kv_head(self) -> list[torch.Tensor]:
        """Per layer, ``W_O`` grouped by KV head, ``[H_kv, Dh, n_rep·D]`` float32, so that
        ``u = v @ W`` needs no head repeat (computed once per model and kept; views of one
        ``[L, H_kv, Dh, n_rep·D]`` tensor when :attr:`stackable`). Capture reads a layer's
        through :meth:`wo_kv`, which keeps them only where :attr:`keeps_wo`."""
        if self._wo_kv is None:
            per_layer = [self._regrouped(i) for i in range(len(self.layers))]
            if self.stackable:
                self._wo_kv_all = torch.stack(per_layer)
                self._wo_kv = list(self._wo_kv_all)
            else:
                self._wo_kv = [w.contiguous() for w in per_layer]
        return self._wo_kv

    def wo_kv(self, i: int) -> torch.Tensor:
        """Layer ``i``'s :meth:`wo_by_kv_head`, kept (:attr:`keeps_wo`) or regrouped now."""
        if self._wo_kv is not None or self.keeps_wo:
            return self.wo_by_kv_head()[i]
        return self._regrouped(i).contiguous()

    def wo_by_query_head(self, i: int) -> torch.Tensor:
        """Layer ``i``'s ``W_O`` rows in query-head order, ``[H·Dh, D]`` float32
        (:func:`.source_parts.heads_by_query` of :meth:`wo_kv`), for the sparse strategy.
        Kept once per model where :attr:`keeps_wo` (shared by every capture session), else
        built per use."""
        if i in self._wo_q:
            return self._wo_q[i]
        w = heads_by_query(self.wo_kv(i), self.layers[i].num_heads)
        if self.keeps_wo:
            self._wo_q[i] = w
        return w

    def stacked_wo_by_kv_head(self) -> torch.Tensor:
        """:meth:`wo_by_kv_head` of every layer, ``[L, H_kv, Dh, n_rep·D]`` (stackable
        models only)."""
        self.wo_by_kv_head()
        if self._wo_kv_all is None:
            raise RuntimeError("the layers of this model cannot be stacked (see stackable)")
        return self._wo_kv_all


def _unsupported(model_type: str) -> UnsupportedArchitectureError:
    names = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
    return UnsupportedArchitectureError(
        f"geometry capture does not support model_type={model_type!r}. Supported: {names}. "
        "Use one of these families or open an issue with the architecture you need."
    )


def check_supported(config: object) -> str:
    """Return the model_type of ``config`` or raise UnsupportedArchitectureError."""
    model_type = str(getattr(config, "model_type", "<unknown>"))
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise _unsupported(model_type)
    return model_type


def build_spec(model: Any) -> ArchitectureSpec:
    """Inspect a loaded causal LM and return its :class:`ArchitectureSpec`."""
    config: Any = model.config
    model_type = check_supported(config)
    layers: list[LayerSpec] = []
    if model_type == "gpt2":
        blocks = model.transformer.h
        hidden = int(config.n_embd)
        heads = int(config.n_head)
        head_dim = hidden // heads
        for i, block in enumerate(blocks):
            w = block.attn.c_proj.weight.detach()  # Conv1D: [in = H*Dh, out = D], y = x W + b
            layers.append(
                LayerSpec(
                    index=i,
                    layer=block,
                    attn=block.attn,
                    mlp_input_module=block.ln_2,
                    attn_out_norm=None,
                    wo_heads=w.reshape(heads, head_dim, hidden),
                    num_heads=heads,
                    num_kv_heads=heads,
                    head_dim=head_dim,
                )
            )
        ctx = int(config.n_positions)
    else:
        hidden = int(config.hidden_size)
        layers = [
            _decoder_layer(model_type, config, i, layer)
            for i, layer in enumerate(model.model.layers)
        ]
        ctx = int(getattr(config, "max_position_embeddings", 0) or 0)
    for spec in layers:
        if spec.wo_heads.device.type == "meta":
            raise UnsupportedArchitectureError(
                f"layer {spec.index}'s weights are offloaded (device 'meta'); geometry capture "
                "needs every layer on a device: load with a device_map that places all layers "
                "on GPUs or the CPU (no disk offload)"
            )
        if getattr(spec.attn, "layer_idx", spec.index) != spec.index:
            raise UnsupportedArchitectureError(
                f"layer {spec.index} has attention layer_idx={spec.attn.layer_idx}; "
                "geometry capture needs layer_idx to match the layer order"
            )
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return ArchitectureSpec(
        model_type=model_type,
        layers=layers,
        hidden_size=hidden,
        context_length=ctx,
        weight_bytes=weight_bytes,
    )


def _decoder_layer(model_type: str, config: Any, i: int, layer: nn.Module) -> LayerSpec:
    """The :class:`LayerSpec` of decoder layer ``i`` of a ``model.model.layers`` family."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    hidden = int(config.hidden_size)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    attn: Any = layer.self_attn
    w = attn.o_proj.weight.detach()  # Linear: [D, H*Dh], y = x W^T + b
    multiplier = (
        float(getattr(config, "residual_multiplier", 1.0)) if model_type == "granite" else 1.0
    )
    if multiplier != 1.0:
        w = w * multiplier  # a copy: e~ = e + r * o_proj(attn), so u^h = r W_O^h v^h
    mods: Any = layer
    if model_type in _PRE_FEEDFORWARD:
        mlp_in = mods.pre_feedforward_layernorm
    elif model_type == "olmo2":
        mlp_in = mods.mlp  # no pre-MLP norm: the MLP reads e~ itself
    else:
        mlp_in = mods.post_attention_layernorm
    offset = ATTENTION_OUTPUT_NORM.get(model_type)
    return LayerSpec(
        index=i,
        layer=layer,
        attn=attn,
        mlp_input_module=mlp_in,
        attn_out_norm=mods.post_attention_layernorm if offset is not None else None,
        wo_heads=w.t().reshape(heads, head_dim, hidden),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        attn_out_norm_offset=1.0 if offset is None else offset,
    )
