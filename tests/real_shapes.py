"""Real-size model shapes with random weights, the capture engine driven without LangChain,
and a float64 reference of Ω, Θ, Φ for any depth and width.

Shared by ``tests/integration/adapters/test_real_shapes.py`` and the real-size runs
(``bench/memory/real_size.py`` on the CPU, ``experiments/gpu_capture/gpu.py`` and
``experiments/prefix_path/prefix_real_size.py`` on a GPU machine that has PyTorch and
transformers only). It imports torch, transformers, numpy
and the leaf modules of ``abstain_guard.adapters`` (capture, batching, loading), never the
packages' ``__init__`` when LangChain is missing (:func:`import_engine`).

Shapes are the published configs (hidden size, layers, query / key-value heads, head size,
MLP width, vocabulary), with the weights drawn at random: speed and memory do not depend on
the weights' values (except the sparse strategy's corrections, which depend on how many
coordinates of a part exceed the post-attention state; see docs/method.md).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf

ROOT = Path(__file__).resolve().parents[1]

#: Published shapes (config.json of each model on the Hugging Face hub, as documented by
#: the transformers config classes): hidden D, layers L, query heads H, KV heads H_kv, head
#: size D_h, MLP width I, vocabulary V, tied embeddings.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": {
        "family": "qwen3",
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": {
        "family": "llama",
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        "family": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    "llama-3.1-8b": {
        "family": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "llama-3.1-70b": {
        "family": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
}

#: A tiny width of any shape, for a check on the CPU in seconds (``--smoke``).
SMOKE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def import_engine() -> dict[str, Any]:
    """The capture engine's leaf modules, importable on a machine without LangChain.

    ``abstain_guard/__init__`` and ``adapters/__init__`` import LangChain; where it is
    missing, both packages are registered as bare namespace packages over the repository's
    folders (also where the project is not installed) so that only the leaf modules (and
    their torch / transformers / numpy imports) load. Returns the modules ``batching``,
    ``capture``, ``loading``, ``kernels`` and ``types`` by name."""
    if "abstain_guard" not in sys.modules:
        try:
            importlib.import_module("langchain_core")
            installed = importlib.util.find_spec("abstain_guard") is not None
        except ImportError:
            installed = False
        if not installed:
            for name, folder in (
                ("abstain_guard", "abstain_guard"),
                ("abstain_guard.adapters", "adapters"),
            ):
                pkg = types.ModuleType(name)
                pkg.__path__ = [str(ROOT / folder)]
                sys.modules[name] = pkg
    homes = {
        "batching": "engine.batching",
        "capture": "capture.session",
        "loading": "model.loading",
        "kernels": "engine.kernels",
        "types": "capture.types",
    }
    return {n: importlib.import_module(f"abstain_guard.adapters.{m}") for n, m in homes.items()}


def shape_config(
    shape: str,
    layers: int | None = None,
    vocab: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """The transformers config of ``shape`` (:data:`SHAPES`), optionally with fewer
    ``layers`` (real width, reduced depth), a smaller ``vocab`` (the geometry does not
    read the vocabulary; a smaller one only saves memory) or other ``overrides`` (smoke
    runs: a tiny width)."""
    spec = {**SHAPES[shape], **(overrides or {})}
    family = spec.pop("family")
    if layers is not None:
        spec["num_hidden_layers"] = layers
    if vocab is not None:
        spec["vocab_size"] = vocab
    common = {"max_position_embeddings": 40960, "pad_token_id": 0, "bos_token_id": 1}
    common["eos_token_id"] = None  # generations run to their token budget
    if family == "qwen3":
        return tf.Qwen3Config(**spec, **common)
    if family == "llama":
        return tf.LlamaConfig(**spec, **common)
    raise ValueError(f"unknown family {family!r}")


def _init_(model: Any, seed: int) -> None:
    """Unit-gain random weights, in place: every matrix ``N(0, 1 / fan_in)`` (query and key
    projections ``N(0, 3 / fan_in)`` so that attention rows are far from uniform), norm
    scales ``1 + N(0, 0.1²)``, embeddings ``N(0, 1)``. Drawn on the model's device."""
    gen_device = next(model.parameters()).device
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.empty(p.shape, dtype=torch.float32, device=gen_device)
            noise.normal_(generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed" in name or p.dim() == 1:
                p.copy_(noise)
            else:
                gain = 3.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(noise * (gain / p.shape[1]) ** 0.5)
            del noise


def build_model(
    shape: str,
    layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    vocab: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """A random-weight causal LM of ``shape`` (sdpa attention, eval mode) on ``device``."""
    cfg = shape_config(shape, layers, vocab, overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    _init_(model, seed)
    model.generation_config.eos_token_id = None
    return model.eval()


@dataclass
class StubTokenizer:
    """What the engine asks of a tokenizer when no stop strings are given."""

    eos_token_id: int | None = None
    pad_token_id: int = 0

    def decode(self, ids: list[int], **_: Any) -> str:
        return " ".join(str(i) for i in ids)


def wrap(hf: Any) -> Any:
    """The engine's ``LoadedModel`` around ``hf`` (no tokenizer needed)."""
    return import_engine()["loading"].wrap_model(hf, StubTokenizer())


@dataclass
class EngineRun:
    """One generation through the library's engine: tokens, per-token features
    (``omega``, ``theta``, ``phi_in``, ``phi_out`` as ``[N, ...]`` arrays, or None without
    capture), seconds of the prompt pass (with the first token) and of the decode steps,
    and what the capture session kept."""

    token_ids: list[int]
    features: dict[str, np.ndarray | None]
    prefill_s: float
    decode_s: float
    strategy: str
    kept_bytes: int


def _session_bytes(session: Any) -> int:
    """Bytes the session keeps across forward calls (C_MLP, max-norms, kept u)."""
    total = 0
    for name in ("_cmlp_all", "_u_all"):
        t = getattr(session, name, None)
        total += 0 if t is None else t.numel() * t.element_size()
    if getattr(session, "_cmlp_all", None) is None:
        total += sum(t.numel() * t.element_size() for t in session._cmlp)
    if getattr(session, "_u_all", None) is None:
        total += sum(t.numel() * t.element_size() for t in session._u if t is not None)
    total += sum(t.numel() * t.element_size() for t in session._unorm if t is not None)
    return total


def strategy_name(session: Any, n_sources: int) -> str:
    """What ``auto`` chose for the decode steps: ``cached`` (kept u), ``sparse`` or
    ``dense`` (the per-layer hooks), ``fast`` or ``none``."""
    if session is None:
        return "none"
    if session.capture == "fast":
        return "fast"
    if session.cached:
        return "cached"
    cap = import_engine()["capture"]
    forced = cap.DEFAULT_STRATEGY
    if forced in ("sparse", "dense"):
        return str(forced)
    return "sparse" if n_sources > cap.DENSE_MAX_SOURCES else "dense"


def engine_generate(
    loaded: Any,
    prompt: list[int] | list[list[int]],
    max_new: int,
    capture: str | None,
    reference: Any = None,
    sync: Any = None,
    shared_steps: bool | None = None,
) -> EngineRun:
    """Generate ``max_new`` greedy tokens for ``prompt`` (or a list of prompts: a batch)
    with the library's engine (``capture``: "full", "fast" or None for no capture): each
    prompt's pass alone, then decode steps for all rows. ``shared_steps`` True forces the
    shared decode path (rows in one forward; the engine takes it on the CPU only), False
    each row alone, None the engine's choice. ``sync`` (e.g. ``torch.cuda.synchronize``) is
    called before each clock reading. Features and ``kept_bytes`` are the first row's."""
    mods = import_engine()
    batching = mods["batching"]
    threads = importlib.import_module("abstain_guard.adapters.engine.threads")
    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    engine = batching.BatchEngine(loaded, max_rows=len(prompts))
    if shared_steps is not None:
        engine.path = threads.DecodePath(
            "shared" if shared_steps else "alone",
            threads.DECODE_THREADS,
            1,
            max_rows=len(prompts) if shared_steps else 1,
        )
    reqs = [
        batching.GenerationRequest(
            prompt=list(p),  # type: ignore[arg-type]
            max_new=max_new,
            capture=capture is not None,
            capture_mode=capture or "full",
            reference=reference,
        )
        for p in prompts
    ]
    tick = sync or (lambda: None)
    tick()
    t0 = time.perf_counter()
    rows = [engine.start(r) for r in reqs]
    tick()
    t1 = time.perf_counter()
    while engine.active:
        engine.step()
    tick()
    t2 = time.perf_counter()
    row = rows[0]
    session = row.session
    feats: dict[str, np.ndarray | None] = {"omega": None, "theta": None}
    if session is not None and session.steps:
        steps = session.steps
        for key in ("omega", "theta", "phi_in", "phi_out"):
            vals = [getattr(s, key) for s in steps]
            feats[key] = None if vals[0] is None else np.concatenate([v[0] for v in vals], 0)
    return EngineRun(
        token_ids=list(row.ids),
        features=feats,
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        strategy=strategy_name(session, len(prompts[0]) + max_new),
        kept_bytes=0 if session is None or session.capture == "fast" else _session_bytes(session),
    )


def plain_generate(hf: Any, prompt: list[int], max_new: int, sync: Any = None) -> EngineRun:
    """Greedy decoding with transformers alone (a KV cache, the model's own sdpa, torch's
    default threads): what ``generate`` does, timed by phase. ``prompt`` may be a list of
    prompts of one length (a batch)."""
    batch = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    device = next(hf.parameters()).device
    ids = torch.tensor(batch, dtype=torch.long, device=device)
    cache = tf.DynamicCache(config=hf.config)
    out_ids: list[list[int]] = [[] for _ in batch]
    (sync or (lambda: None))()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        (sync or (lambda: None))()
        t1 = time.perf_counter()
        for _ in range(max_new - 1):
            for r, t in enumerate(tok[:, 0].tolist()):
                out_ids[r].append(int(t))
            out = hf(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for r, t in enumerate(tok[:, 0].tolist()):
            out_ids[r].append(int(t))
    (sync or (lambda: None))()
    t2 = time.perf_counter()
    return EngineRun(out_ids[0], {}, t1 - t0, t2 - t1, "plain", 0)


# -- float64 reference -----------------------------------------------------------------------


def _prox(z: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """Normalised L1 proximity of each part to ``z``: ``z [..., D]``, ``parts [..., P, D]``
    -> ``[..., P]`` (0 where no part moves z towards itself)."""
    num = (z.abs().sum(-1, keepdim=True) - (z.unsqueeze(-2) - parts).abs().sum(-1)).clamp(min=0)
    den = num.sum(-1, keepdim=True)
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def _angle(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    cos = (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1))
    return torch.arccos(cos.clamp(-1.0, 1.0))


def float64_reference(hf: Any, ids: list[int], rows: list[int], means: Any = None) -> dict:
    """Ω, Θ (and Φ^in, Φ^out with reference ``means``) ``[len(rows), 2L-1]`` for the rows T,
    from a float64 eager copy of ``hf`` (the same, possibly rounded, weights) with explicit
    attention matrices: ``a(T, s) = 1{s=T} e^{l-1}[T] + Σ_h A^h[T, s] W_O^h v^{kv(h)}_s``
    materialised for the rows, C_MLP for every position. Llama-like layers only (``v_proj``,
    ``o_proj``, no output bias). Also returns ``parts_err``: max |Σ_s a(T, s) − ẽ^l[T]|."""
    ref = copy.deepcopy(hf).to(torch.float64)
    ref.set_attn_implementation("eager")
    cfg = ref.config
    layers = ref.model.layers
    grabbed: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(layers):

        def pre(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
            grabbed[("e_in", i)] = args[0] if args else kwargs["hidden_states"]

        def post(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            grabbed[("e_out", i)] = out[0] if isinstance(out, tuple) else out

        def xhat(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
            grabbed[("xhat", i)] = args[0] if args else kwargs["hidden_states"]

        def et(_m: Any, args: Any, i: int = i) -> None:
            grabbed[("e_tilde", i)] = args[0]

        handles += [
            layer.register_forward_pre_hook(pre, with_kwargs=True),
            layer.register_forward_hook(post),
            layer.self_attn.register_forward_pre_hook(xhat, with_kwargs=True),
            layer.post_attention_layernorm.register_forward_pre_hook(et),
        ]
    device = next(ref.parameters()).device
    with torch.inference_mode():
        out = ref(torch.tensor([ids], device=device), output_attentions=True, use_cache=False)
        for h in handles:
            h.remove()
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        dh = cfg.head_dim
        r_idx = torch.tensor(rows, device=device)
        c_attn, c_mlp, e_tilde, e_out = [], [], [], []
        parts_err = 0.0
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            probs = out.attentions[i][0][:, r_idx]  # [H, R, S]
            v = attn.v_proj(grabbed[("xhat", i)][0]).view(len(ids), kv_heads, dh)
            w_o = attn.o_proj.weight  # [D, H * Dh]
            et_i, eo_i = grabbed[("e_tilde", i)][0], grabbed[("e_out", i)][0]
            parts = torch.zeros(
                (len(rows), len(ids), w_o.shape[0]), dtype=torch.float64, device=device
            )
            for h in range(heads):
                u = v[:, h // (heads // kv_heads)] @ w_o[:, h * dh : (h + 1) * dh].T  # [S, D]
                parts += probs[h][:, :, None] * u[None]
            parts[torch.arange(len(rows), device=device), r_idx] += grabbed[("e_in", i)][0][r_idx]
            z = et_i[r_idx]
            parts_err = max(parts_err, float((parts.sum(1) - z).abs().max()))
            c_attn.append(_prox(z, parts))  # [R, S]
            c_mlp.append(_prox(eo_i, torch.stack([et_i, eo_i - et_i], 1))[:, 1])  # [S]
            e_tilde.append(et_i)
            e_out.append(eo_i)
    n_layers = len(layers)
    rr = torch.arange(len(rows), device=device)
    omega = torch.zeros((len(rows), 2 * n_layers - 1), dtype=torch.float64, device=device)
    theta = torch.zeros_like(omega)
    phi = {"in": torch.zeros_like(omega), "out": torch.zeros_like(omega)}
    mask = (torch.arange(len(ids), device=device)[None, :] < r_idx[:, None]).double()  # s < T
    for li in range(n_layers):
        omega[:, 2 * li] = c_mlp[li][r_idx]
        theta[:, 2 * li] = _angle(e_tilde[li][r_idx], e_out[li][r_idx])
        if li + 1 < n_layers:
            omega[:, 2 * li + 1] = (c_attn[li + 1] * (c_mlp[li][None, :] * mask)).sum(-1)
            theta[:, 2 * li + 1] = _angle(e_out[li][r_idx], e_tilde[li + 1][r_idx])
        if means is not None:
            for side in ("in", "out"):
                eta = torch.as_tensor(getattr(means, f"post_mlp_{side}")[li], device=device)
                phi[side][:, 2 * li] = _angle(eta[None], e_out[li][r_idx])
                if li + 1 < n_layers:
                    eta_t = torch.as_tensor(
                        getattr(means, f"post_attn_{side}")[li + 1], device=device
                    )
                    phi[side][:, 2 * li + 1] = _angle(eta_t[None], e_tilde[li + 1][r_idx])
    del ref, rr
    result = {
        "omega": omega.cpu().numpy(),
        "theta": theta.cpu().numpy(),
        "parts_err": parts_err,
        "e_tilde_mean": torch.stack([e.mean(0) for e in e_tilde]).cpu().numpy(),
        "e_out_mean": torch.stack([e.mean(0) for e in e_out]).cpu().numpy(),
    }
    if means is not None:
        result["phi_in"] = phi["in"].cpu().numpy()
        result["phi_out"] = phi["out"].cpu().numpy()
    return result


def reference_means(hf: Any, ids: list[int], seed: int = 0) -> Any:
    """Reference means for Φ: per layer, the mean float64 states of ``ids`` (in) and the
    same plus noise of their size (out)."""
    ref = float64_reference(hf, ids, [len(ids) - 1])
    gen = np.random.default_rng(seed)
    et, eo = ref["e_tilde_mean"], ref["e_out_mean"]
    rm = import_engine()["types"].ReferenceMeans
    return rm(
        post_attn_in=et,
        post_mlp_in=eo,
        post_attn_out=et + gen.normal(size=et.shape) * np.abs(et).mean(),
        post_mlp_out=eo + gen.normal(size=eo.shape) * np.abs(eo).mean(),
    )


def exactness(
    hf: Any, prompt: list[int], max_new: int, strategies: tuple[str, ...] = ("auto",)
) -> dict[str, Any]:
    """Largest |capture − float64 reference| of Ω, Θ, Φ over KV-cached generations of
    ``max_new`` tokens, one per capture strategy (``auto``, ``cached``, ``sparse``,
    ``dense``); the reference runs the same (rounded) weights in float64."""
    cap = import_engine()["capture"]
    loaded = wrap(hf)
    means = reference_means(hf, prompt)
    errs: dict[str, float] = {"omega": 0.0, "theta": 0.0, "phi": 0.0}
    per: dict[str, dict[str, float]] = {}
    ref = None
    tokens: list[int] | None = None
    try:
        for strategy in strategies:
            cap.DEFAULT_STRATEGY = strategy
            run = engine_generate(loaded, prompt, max_new, "full", reference=means)
            if tokens is None:
                tokens = run.token_ids
                rows = list(range(len(prompt) - 1, len(prompt) - 1 + len(tokens)))
                ref = float64_reference(hf, prompt + tokens[:-1], rows, means)
            assert ref is not None
            f = run.features
            e = {
                "omega": float(np.abs(f["omega"] - ref["omega"]).max()),
                "theta": float(np.abs(f["theta"] - ref["theta"]).max()),
                "phi": max(
                    float(np.abs(f["phi_in"] - ref["phi_in"]).max()),
                    float(np.abs(f["phi_out"] - ref["phi_out"]).max()),
                ),
            }
            per[strategy] = {k: float(f"{v:.3g}") for k, v in e.items()}
            for k in errs:
                errs[k] = max(errs[k], e[k])
    finally:
        cap.DEFAULT_STRATEGY = "auto"
    assert ref is not None and tokens is not None
    return {
        "max_abs_err": {k: float(f"{v:.3g}") for k, v in errs.items()},
        "per_strategy": per,
        "parts_err": float(f"{ref['parts_err']:.3g}"),
        "new_tokens": len(tokens),
        "positions": len(prompt) + len(tokens) - 1,
    }


def prefix_first(
    loaded: Any, prompt: list[int], split: int | None, mode: str
) -> tuple[float, Any, dict[str, Any]]:
    """One prompt pass + first token through the engine, the first ``split`` tokens as the
    stored prefix (None: one pass), capture ``mode`` ``full``, ``fast`` or ``none``: (seconds,
    logits ``[V]``, features ``{"omega", "theta": array}``)."""
    batching = import_engine()["batching"]
    engine = batching.BatchEngine(loaded, max_rows=1)
    request = batching.GenerationRequest(
        prompt=prompt,
        max_new=1,
        capture=mode != "none",
        capture_mode="full" if mode == "none" else mode,
        prefix=split,
    )
    device = next(loaded.hf_model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    row = engine.start(request)
    sync()
    seconds = time.perf_counter() - start
    engine.drop_all()
    feats = {}
    if row.session is not None and row.session.steps:
        step = row.session.steps[0]
        feats = {k: getattr(step, k) for k in ("omega", "theta") if getattr(step, k) is not None}
    return seconds, row.logits[0], feats


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """``n`` token ids drawn uniformly from ``[2, vocab)``."""
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(2, vocab, (n,), generator=gen)]


__all__ = [
    "DTYPES",
    "SHAPES",
    "SMOKE",
    "EngineRun",
    "build_model",
    "engine_generate",
    "exactness",
    "float64_reference",
    "import_engine",
    "plain_generate",
    "prefix_first",
    "random_prompt",
    "reference_means",
    "shape_config",
    "wrap",
]
