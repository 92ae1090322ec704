"""Where the residual-stream quantities live in each supported transformers family.

For every decoder layer l we need (DESIGN.md, "Where hooks go"):

* the layer input e^{l-1} and output e^l (forward pre-hook / forward hook on the layer);
* e~^l, the input of the module that starts the MLP block (``post_attention_layernorm``
  for Llama/Qwen2/Mistral, ``pre_feedforward_layernorm`` for Gemma-3, ``ln_2`` for GPT-2);
* the per-head output projections ``W_O^h`` as ``[H, Dh, D]`` (so ``u = v_h @ W_O^h``);
  the output bias b_O goes into the total, not into any part, so capture never reads it;
* Gemma-3 only: the RMS norm applied to the attention output (frozen in the decomposition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from abstain_guard.errors import UnsupportedArchitectureError

#: model_type -> human-readable family, the architectures geometry capture supports.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama (SmolLM2, Llama 2/3)",
    "qwen2": "Qwen2 / Qwen2.5",
    "mistral": "Mistral",
    "gemma3_text": "Gemma-3 (text)",
    "gpt2": "GPT-2",
}


@dataclass
class LayerSpec:
    """Handles and weights for one decoder layer."""

    index: int
    layer: nn.Module
    attn: nn.Module
    mlp_input_module: nn.Module
    attn_out_norm: nn.Module | None
    wo_heads: torch.Tensor  # [H, Dh, D]
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class ArchitectureSpec:
    """All layers of a supported model plus model-wide facts."""

    model_type: str
    layers: list[LayerSpec]
    hidden_size: int
    context_length: int

    @property
    def num_layers(self) -> int:
        """L."""
        return len(self.layers)


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
        blocks = model.model.layers
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        for i, layer in enumerate(blocks):
            o_proj = layer.self_attn.o_proj
            w = o_proj.weight.detach()  # Linear: [D, H*Dh], y = x W^T + b
            gemma = model_type == "gemma3_text"
            layers.append(
                LayerSpec(
                    index=i,
                    layer=layer,
                    attn=layer.self_attn,
                    mlp_input_module=(
                        layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
                    ),
                    attn_out_norm=layer.post_attention_layernorm if gemma else None,
                    wo_heads=w.t().reshape(heads, head_dim, hidden),
                    num_heads=heads,
                    num_kv_heads=kv_heads,
                    head_dim=head_dim,
                )
            )
        ctx = int(getattr(config, "max_position_embeddings", 0) or 0)
    for spec in layers:
        if getattr(spec.attn, "layer_idx", spec.index) != spec.index:
            raise UnsupportedArchitectureError(
                f"layer {spec.index} has attention layer_idx={spec.attn.layer_idx}; "
                "geometry capture needs layer_idx to match the layer order"
            )
    return ArchitectureSpec(
        model_type=model_type, layers=layers, hidden_size=hidden, context_length=ctx
    )


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ArchitectureSpec",
    "LayerSpec",
    "build_spec",
    "check_supported",
]
