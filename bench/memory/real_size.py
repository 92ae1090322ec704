"""Capture at real model sizes on the CPU: cost, memory and exactness.

Random-weight models with the published shapes (``tests/real_shapes.py``: Qwen3-1.7B,
Llama-3.2-3B, ...), at real width and full or reduced depth (``--layers``), float32 or
bfloat16. For each prompt length, interleaved repeats of

* plain:  transformers alone, greedy with a KV cache (the model's sdpa, torch's default
  threads: both cores here), timed by phase;
* engine: the library's engine without capture (every forward on one BLAS thread, a lone
  decode row padded to 4 rows: what makes a row's numbers independent of the machine);
* full:   the engine with full capture (Ω, Θ; the strategy ``auto`` chooses);
* fast:   the engine with fast capture (Θ, ω_dir);
* full_regroup: full capture on a model that keeps no float32 copy of ``W_O`` and regroups
  a layer's per use (what half-precision 8B / 70B models do on a GPU;
  ``ArchitectureSpec.keeps_wo``; on the CPU they keep it).

All four must produce the same tokens (float32). Every ratio is taken per repeat and
reported as median and min-max; ``prefill`` is the prompt pass with the first token,
``decode`` one later token. ``extra_peak_mb``: peak resident memory during a run above the
level at its start, minus plain's (sampled every ms); ``kept_mb``: what full capture keeps
across forward calls (C_MLP, max-norms or kept u), read from its session.

At reduced depth, ``auto``'s memory budget for kept ``u`` is scaled by layers / real layers,
so that it chooses the full-depth model's strategy.

``--exactness``: Ω, Θ, Φ of KV-cached generation (each strategy) against the float64
reference of the same weights instead of timings.

Prints one JSON line. Run (one point per call):
``flock /tmp/heavy.lock .venv/bin/python bench/memory/real_size.py --shape qwen3-1.7b --layers 2
--prompts 256,2048 [--dtype bfloat16] [--repeats 3] [--exactness]``; at 8,192 tokens
``--prompts 8192 --repeats 2 --variants plain,full,fast``. Results: ``bench/memory/real_size.jsonl``
(one line per point).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import real_shapes as rs
from _measure import PeakRSS, spread

from abstain_guard.adapters.engine.kernels import kernel_facts

VARIANTS = ("plain", "engine", "full", "fast", "full_regroup")


def regrouping(hf: Any) -> Any:
    """A second ``LoadedModel`` of ``hf`` whose capture keeps no float32 ``W_O`` and
    regroups a layer's per use (what a half-precision 8B or 70B model does)."""
    arch = rs.import_engine()["loading"].build_spec.__module__
    module = sys.modules[arch]
    saved = module.WO_KEEP_SHARE, module.WO_KEEP_MIN_BYTES, module.WO_KEEP_DEVICE_TYPES
    module.WO_KEEP_SHARE, module.WO_KEEP_MIN_BYTES, module.WO_KEEP_DEVICE_TYPES = 0.0, 0, ()
    try:
        loaded = rs.wrap(hf)
        assert not loaded.spec.keeps_wo  # decided now, kept for the spec's life
    finally:
        module.WO_KEEP_SHARE, module.WO_KEEP_MIN_BYTES, module.WO_KEEP_DEVICE_TYPES = saved
    return loaded


def run_variant(name: str, hf: Any, loaded: Any, prompt: list[int], new: int) -> rs.EngineRun:
    """One generation of ``new`` tokens by variant ``name`` (``loaded``: the variants' own
    ``LoadedModel`` of ``hf`` by name)."""
    if name == "plain":
        return rs.plain_generate(hf, prompt, new)
    capture = {"engine": None, "full": "full", "fast": "fast", "full_regroup": "full"}[name]
    return rs.engine_generate(loaded[name], prompt, new, capture)


def measure_point(
    hf: Any,
    loaded: Any,
    n_prompt: int,
    new: int,
    repeats: int,
    check_tokens: bool,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """Interleaved repeats of ``variants`` (``plain`` and at least one engine variant) at
    ``n_prompt`` tokens; per-repeat ratios of the pairs measured."""
    prompt = rs.random_prompt(n_prompt, int(hf.config.vocab_size), seed=n_prompt)
    runs: dict[str, list[rs.EngineRun]] = {v: [] for v in variants}
    mem: dict[str, list[float]] = {v: [] for v in variants}
    first = next(v for v in ("engine", "full", "fast", "full_regroup") if v in variants)
    ref = run_variant(first, hf, loaded, prompt, new).token_ids  # warm-up, path probe
    if "full_regroup" in variants:
        run_variant("full_regroup", hf, loaded, prompt, new)  # warm-up
    for rep in range(repeats):
        for v in variants:
            gc.collect()
            with PeakRSS() as peak:
                run = run_variant(v, hf, loaded, prompt, new)
            if check_tokens and run.token_ids != ref:
                raise RuntimeError(f"{v} produced other tokens: {run.token_ids} vs {ref}")
            runs[v].append(run)
            mem[v].append(peak.extra_mb)
            print(
                f"  rep {rep} {v:6s} prefill {run.prefill_s:8.2f} s decode "
                f"{run.decode_s / max(1, new - 1):7.3f} s/token {run.strategy}",
                file=sys.stderr,
                flush=True,
            )

    def total(r: rs.EngineRun) -> float:
        return r.prefill_s + r.decode_s

    def per_token(r: rs.EngineRun) -> float:
        return r.decode_s / max(1, new - 1)

    out: dict[str, Any] = {"prompt": n_prompt, "new_tokens": new, "repeats": repeats}
    out["seconds"] = {
        v: {
            "prefill": spread([r.prefill_s for r in rs_]),
            "decode_per_token": spread([per_token(r) for r in rs_]),
            "total": spread([total(r) for r in rs_]),
        }
        for v, rs_ in runs.items()
    }
    ratios: dict[str, Any] = {}
    for num, den in (
        ("full", "plain"),
        ("fast", "plain"),
        ("engine", "plain"),
        ("full", "engine"),
        ("fast", "engine"),
        ("full_regroup", "full"),
    ):
        if num not in runs or den not in runs:
            continue
        for phase, fn in (
            ("total", total),
            ("prefill", lambda r: r.prefill_s),
            ("decode", per_token),
        ):
            vals = [fn(a) / fn(b) for a, b in zip(runs[num], runs[den], strict=True)]
            ratios[f"{num}_over_{den}_{phase}"] = spread(vals, 3)
    out["ratios"] = ratios
    out["extra_peak_mb_over_plain"] = {
        v: spread([a - b for a, b in zip(mem[v], mem["plain"], strict=True)], 1)
        for v in ("engine", "full", "fast", "full_regroup")
        if v in mem
    }
    out["peak_mb"] = {v: spread(m, 1) for v, m in mem.items()}
    if "full" in runs:
        out["kept_mb_full"] = round(runs["full"][0].kept_bytes / 2**20, 2)
        out["strategy_full"] = runs["full"][0].strategy
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-1.7b", choices=sorted(rs.SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="default: the real depth")
    parser.add_argument("--dtype", default="float32", choices=sorted(rs.DTYPES))
    parser.add_argument("--prompts", default="256,2048")
    parser.add_argument("--new", type=int, default=8, help="new tokens per generation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--exactness", action="store_true")
    parser.add_argument("--vocab", type=int, default=None, help="smaller vocabulary (exactness)")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma list: plain and engine variants to time (long prompts: plain,full,fast)",
    )
    args = parser.parse_args()
    variants = tuple(v for v in args.variants.split(",") if v)
    if "plain" not in variants or not set(variants) <= set(VARIANTS) or len(variants) < 2:
        parser.error(f"--variants must hold plain and one of {VARIANTS[1:]}, got {variants}")
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    hf = rs.build_model(args.shape, args.layers, rs.DTYPES[args.dtype], vocab=args.vocab)
    cfg = hf.config
    result: dict[str, Any] = {
        "shape": args.shape,
        "layers": int(cfg.num_hidden_layers),
        "real_layers": rs.SHAPES[args.shape]["num_hidden_layers"],
        "vocab": int(cfg.vocab_size),
        "dtype": args.dtype,
        "params_m": round(sum(p.numel() for p in hf.parameters()) / 1e6, 1),
        "build_s": round(time.perf_counter() - t0, 1),
    }
    print(f"{args.shape} L={cfg.num_hidden_layers} {args.dtype}", file=sys.stderr, flush=True)
    if args.exactness:
        n_prompt = int(args.prompts.split(",")[0])
        prompt = rs.random_prompt(n_prompt, int(cfg.vocab_size))
        strategies = ("auto", "cached", "sparse", "dense")
        result["exactness"] = rs.exactness(hf, prompt, args.new, strategies)
    else:
        if result["layers"] < result["real_layers"]:
            # auto's budget for kept u is per model: scale it with the depth so that a
            # reduced-depth model chooses the strategy the full-depth one chooses
            cap = rs.import_engine()["capture"]
            cap.CACHE_BUDGET_BYTES = (
                cap.CACHE_BUDGET_BYTES * result["layers"] // result["real_layers"]
            )
        base = rs.wrap(hf)
        loaded = {"engine": base, "full": base, "fast": base}
        if "full_regroup" in variants:
            loaded["full_regroup"] = regrouping(hf)
        result["keeps_wo"] = bool(base.spec.keeps_wo)
        result["variants"] = list(variants)
        points = []
        for n in (int(p) for p in args.prompts.split(",")):
            print(f" prompt {n}", file=sys.stderr, flush=True)
            points.append(
                measure_point(
                    hf, loaded, n, args.new, args.repeats, args.dtype == "float32", variants
                )
            )
        result["points"] = points
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["kernel_facts"] = kernel_facts("cpu")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
