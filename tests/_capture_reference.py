"""An eager float64 reference of geometry capture, written independently of
adapters/capture/session.py: the full attention matrix and every Omega, Theta, Phi feature per
token, for tiny random-weight models of each family."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from tiny_models import tiny_chat_model, tiny_hf_model

PROMPT = "Tell me the capital of Portugal, please."


def _prox_full(z: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """z [T, D], parts [T, S, D] -> [T, S] (Ferrando et al. normalised L1 proximity)."""
    zn = np.abs(z).sum(-1)[:, None]
    num = np.maximum(0.0, zn - np.abs(z[:, None, :] - parts).sum(-1))
    den = num.sum(-1, keepdims=True)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _angle(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    cos = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))
    return np.arccos(np.clip(cos, -1.0, 1.0))


def _modules(model: Any, family: str, i: int) -> dict[str, Any]:
    if family == "gpt2":
        blk = model.transformer.h[i]
        return {"layer": blk, "mlp_in": blk.ln_2, "attn": blk.attn}
    layer = model.model.layers[i]
    sandwich = family in ("gemma3_text", "gemma2")
    mlp_in = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
    return {
        "layer": layer,
        "mlp_in": layer.mlp if family == "olmo2" else mlp_in,
        "attn": layer.self_attn,
        "out_norm": layer.post_attention_layernorm if sandwich or family == "olmo2" else None,
        "norm_offset": 0.0 if family == "olmo2" else 1.0,
    }


def _values(family: str, cfg: Any, attn: Any, xh: torch.Tensor) -> torch.Tensor:
    """Value vectors ``[T, H_kv·Dh]`` (float64) from the attention module's input ``xh``."""
    if family == "gpt2":
        d = cfg.n_embd
        return xh @ attn.c_attn.weight.double()[:, 2 * d :] + attn.c_attn.bias.double()[2 * d :]
    if family == "phi3":
        width = cfg.num_key_value_heads * attn.head_dim
        return xh @ attn.qkv_proj.weight.double()[-width:].T  # [q | k | v] rows
    v = xh @ attn.v_proj.weight.double().T
    return v if attn.v_proj.bias is None else v + attn.v_proj.bias.double()


def slow_reference(
    family: str, seed: int, ids: list[int], weights_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Full-matrix reference on an eager model with identical weights (float32; with
    ``weights_dtype``, the weights rounded to that dtype as a half-precision model holds
    them, and the whole reference forward in float64).

    Returns per layer: parts [T, T, D], e_in, e_tilde, e_out [T, D], the output bias term
    and C_Attn [T, T], C_MLP [T].
    """
    if weights_dtype is None:
        model = tiny_hf_model(family, seed, attn_implementation="eager")
    else:
        model = tiny_hf_model(family, seed, "eager", dtype=weights_dtype).to(torch.float64)
        if getattr(model.config, "_experts_implementation", None) is not None:
            model.config._experts_implementation = "eager"  # grouped_mm has no float64
    cfg = model.config
    n_layers = cfg.num_hidden_layers if family != "gpt2" else cfg.n_layer
    grabbed: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for i in range(n_layers):
        mods = _modules(model, family, i)

        def pre(mod: Any, args: Any, kwargs: Any, i: int = i) -> None:
            grabbed[("e_in", i)] = (args[0] if args else kwargs["hidden_states"]).detach()

        def post(mod: Any, args: Any, out: Any, i: int = i) -> None:
            grabbed[("e_out", i)] = (out[0] if isinstance(out, tuple) else out).detach()

        def xhat(mod: Any, args: Any, kwargs: Any, i: int = i) -> None:
            grabbed[("xhat", i)] = (args[0] if args else kwargs["hidden_states"]).detach()

        def et(mod: Any, args: Any, i: int = i) -> None:
            grabbed[("e_tilde", i)] = args[0].detach()

        def attn_out(mod: Any, args: Any, i: int = i) -> None:
            grabbed[("o", i)] = args[0].detach()

        handles.append(mods["layer"].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mods["layer"].register_forward_hook(post))
        handles.append(mods["attn"].register_forward_pre_hook(xhat, with_kwargs=True))
        handles.append(mods["mlp_in"].register_forward_pre_hook(et))
        if mods.get("out_norm") is not None:
            handles.append(mods["out_norm"].register_forward_pre_hook(attn_out))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, use_cache=False)
    for h in handles:
        h.remove()
    layers = []
    for p in model.parameters():
        p.requires_grad_(False)
    for i in range(n_layers):
        mods = _modules(model, family, i)
        attn = mods["attn"]
        A = out.attentions[i][0].double().numpy()  # [H, T, T]
        v = _values(family, cfg, attn, grabbed[("xhat", i)][0].double())
        if family == "gpt2":
            w_o = attn.c_proj.weight.double().T  # [D, H*Dh]
            b_o = attn.c_proj.bias.double()
            heads, kv_heads = cfg.n_head, cfg.n_head
        else:
            w_o = attn.o_proj.weight.double()
            b_o = None if attn.o_proj.bias is None else attn.o_proj.bias.double()
            heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        # Granite: e~ = e + r * o_proj(attention)
        r_mult = float(cfg.residual_multiplier) if family == "granite" else 1.0
        w_o = w_o * r_mult
        b_o = None if b_o is None else b_o * r_mult
        t_len = v.shape[0]
        dh = w_o.shape[1] // heads
        v = v.reshape(t_len, kv_heads, dh).numpy()
        w_o = w_o.numpy()
        parts = np.zeros((t_len, t_len, w_o.shape[0]))
        for h in range(heads):
            kv = h // (heads // kv_heads)
            u = v[:, kv, :] @ w_o[:, h * dh : (h + 1) * dh].T  # [S, D]
            parts += A[h][:, :, None] * u[None, :, :]
        bias = np.zeros(w_o.shape[0]) if b_o is None else b_o.numpy()
        e_in = grabbed[("e_in", i)][0].double().numpy()
        e_tilde = grabbed[("e_tilde", i)][0].double().numpy()
        e_out = grabbed[("e_out", i)][0].double().numpy()
        bias_term = np.broadcast_to(bias, e_in.shape).copy()
        if mods.get("out_norm") is not None:
            norm = mods["out_norm"]
            o = grabbed[("o", i)][0].double().numpy()
            eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
            factor = (mods["norm_offset"] + norm.weight.double().numpy()) / np.sqrt(
                (o**2).mean(-1, keepdims=True) + eps
            )
            parts = parts * factor[:, None, :]
            bias_term = bias_term * factor
        parts[np.arange(t_len), np.arange(t_len)] += e_in
        m = e_out - e_tilde
        c_mlp = _prox_full(e_out, np.stack([e_tilde, m], axis=1))[:, 1]
        c_attn = _prox_full(e_tilde, parts)
        layers.append(
            {
                "parts": parts,
                "bias": bias_term,
                "e_in": e_in,
                "e_tilde": e_tilde,
                "e_out": e_out,
                "c_attn": c_attn,
                "c_mlp": c_mlp,
            }
        )
    return {"layers": layers}


def reference_features(ref: dict[str, Any], rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Ω and Θ [len(rows), 2L-1] for the rows T from the full matrices."""
    layers = ref["layers"]
    n_layers = len(layers)
    omega = np.zeros((len(rows), 2 * n_layers - 1))
    theta = np.zeros_like(omega)
    for k, t in enumerate(rows):
        for li in range(n_layers):
            cur = layers[li]
            omega[k, 2 * li] = cur["c_mlp"][t]
            theta[k, 2 * li] = _angle(cur["e_tilde"][t], cur["e_out"][t])
            if li + 1 < n_layers:
                nxt = layers[li + 1]
                omega[k, 2 * li + 1] = float(cur["c_mlp"][:t] @ nxt["c_attn"][t, :t])
                theta[k, 2 * li + 1] = _angle(cur["e_out"][t], nxt["e_tilde"][t])
    return omega, theta


@functools.cache
def family_case(family: str) -> dict[str, Any]:
    """The tiny model of ``family`` (seed 3), its answer to PROMPT (14 new tokens at most)
    and the full-matrix reference of prompt + answer; built once per session (this module
    and tests/test_capture_memory.py share it)."""
    model = tiny_chat_model(family, seed=3, max_new_tokens=14)
    meta = model.invoke(PROMPT).response_metadata
    ref = slow_reference(family, 3, meta["prompt_token_ids"] + meta["token_ids"])
    return {"family": family, "model": model, "meta": meta, "ref": ref}
