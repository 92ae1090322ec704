"""Capture on a GPU, in one call: an 8B shape in bfloat16, batch 1 / 8 / 32, 2k / 8k prompts.
Needs only torch, transformers and numpy (``tests/real_shapes.py`` imports the
capture engine's leaf modules without LangChain).

Per (prompt length, batch), interleaved repeats of

* plain:  transformers alone, the batch in one forward per step (greedy, KV cache, sdpa);
* full:   the library's engine with full capture (each prompt's pass alone, then decode
  steps as the engine takes them on a GPU: each row alone);
* fast:   the same with fast capture;
* full_shared, fast_shared: capture with the batch's rows in one forward per decode step
  (the path the engine takes on the CPU; on a GPU a row's numbers then depend on the batch);
* engine: the engine without capture (``--variants``).

Reported: prompt-pass seconds, decode tokens per second (all rows), end-to-end tokens per
second, the peak GPU memory above the model's (``torch.cuda.max_memory_allocated``), and
ratios to plain. And an exactness check (bfloat16 first, float32 last): a Qwen3-1.7B shape
at full depth, Ω, Θ, Φ of KV-cached generation against the float64 reference of the same
weights. Results on an NVIDIA H200: ``experiments/gpu_capture/gpu_h200.json`` (docs/method.md).

A time guard stops starting configurations after ``--budget-s`` seconds; every result is
written to ``$OUT/gpu.json`` (or ``--out-dir``) as soon as it is measured; failures (out of
memory included) are recorded and the run goes on. The last thing printed is a table.

Run: ``python experiments/gpu_capture/gpu.py --out-dir $OUT``; on the CPU:
``python experiments/gpu_capture/gpu.py --smoke`` (tiny widths: a check that the script runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import real_shapes as rs


def _sync(device: str) -> Any:
    return torch.cuda.synchronize if device == "cuda" else None


def _mem_reset(device: str) -> int:
    if device != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return int(torch.cuda.memory_allocated())


def _mem_peak(device: str, base: int) -> float:
    if device != "cuda":
        return 0.0
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


def run_variant(
    name: str, hf: Any, loaded: Any, prompts: list[list[int]], new: int, device: str
) -> rs.EngineRun:
    """One generation of ``new`` tokens for every prompt by variant ``name``."""
    sync = _sync(device)
    if name == "plain":
        return rs.plain_generate(hf, prompts, new, sync=sync)
    capture = {"full": "full", "fast": "fast", "engine": None}[name.split("_")[0]]
    shared = True if name.endswith("_shared") else None
    return rs.engine_generate(loaded, prompts, new, capture, sync=sync, shared_steps=shared)


def speed_config(
    hf: Any,
    loaded: Any,
    n_prompt: int,
    batch: int,
    new: int,
    repeats: int,
    variants: tuple[str, ...],
    device: str,
    deadline: float,
) -> dict[str, Any]:
    """Interleaved repeats of ``variants`` for ``batch`` prompts of ``n_prompt`` tokens."""
    vocab = int(hf.config.vocab_size)
    prompts = [rs.random_prompt(n_prompt, vocab, seed=1000 * batch + r) for r in range(batch)]
    rows: dict[str, dict[str, list[float]]] = {
        v: {"prefill_s": [], "decode_tok_s": [], "e2e_tok_s": [], "peak_gb": []} for v in variants
    }
    errors: dict[str, str] = {}
    done = 0
    for _ in range(repeats):
        if done and time.monotonic() > deadline:
            break
        for v in variants:
            if v in errors:
                continue
            base = _mem_reset(device)
            try:
                run = run_variant(v, hf, loaded, prompts, new, device)
            except Exception as exc:  # out of memory included: recorded, the run goes on
                errors[v] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"    {v}: {errors[v]}", flush=True)
                continue
            r = rows[v]
            r["prefill_s"].append(run.prefill_s)
            r["decode_tok_s"].append(batch * (new - 1) / run.decode_s)
            r["e2e_tok_s"].append(batch * new / (run.prefill_s + run.decode_s))
            r["peak_gb"].append(_mem_peak(device, base))
            print(
                f"    {v:12s} prefill {run.prefill_s:7.3f} s  decode "
                f"{r['decode_tok_s'][-1]:8.1f} tok/s  peak +{r['peak_gb'][-1]:.2f} GiB",
                flush=True,
            )
        done += 1
    out: dict[str, Any] = {"prompt": n_prompt, "batch": batch, "new_tokens": new, "repeats": done}
    for v, r in rows.items():
        if r["prefill_s"]:
            out[v] = {k: round(statistics.median(x), 4) for k, x in r.items()}
            out[v]["spread"] = {
                k: [round(min(x), 4), round(max(x), 4)] for k, x in r.items() if len(x) > 1
            }
    for v in variants:
        if v != "plain" and v in out and "plain" in out:
            out[v]["decode_tok_s_over_plain"] = round(
                out[v]["decode_tok_s"] / out["plain"]["decode_tok_s"], 3
            )
            out[v]["e2e_tok_s_over_plain"] = round(
                out[v]["e2e_tok_s"] / out["plain"]["e2e_tok_s"], 3
            )
    if errors:
        out["errors"] = errors
    return out


def table(result: dict[str, Any]) -> str:
    """The measured configurations as a Markdown table."""
    lines = [
        "| shape | prompt | batch | variant | prefill s | decode tok/s | e2e tok/s | "
        "peak +GiB | decode vs plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["configs"]:
        if c.get("kind") != "speed":
            continue
        for v in ("plain", "engine", "full", "fast", "full_shared", "fast_shared"):
            m = c.get(v)
            if m is None:
                err = c.get("errors", {}).get(v)
                if err:
                    lines.append(
                        f"| {c['shape']} | {c['prompt']} | {c['batch']} | {v} | {err[:60]} |"
                    )
                continue
            lines.append(
                f"| {c['shape']} | {c['prompt']} | {c['batch']} | {v} | {m['prefill_s']:.3f} | "
                f"{m['decode_tok_s']:.1f} | {m['e2e_tok_s']:.1f} | {m['peak_gb']:.2f} | "
                f"{m.get('decode_tok_s_over_plain', 1.0):.3f} |"
            )
    for c in result["configs"]:
        if c.get("kind") == "exactness" and "exactness" in c:
            e = c["exactness"]
            lines.append(
                f"exactness {c['shape']} L={c['layers']} {c['dtype']}: max |Δ| "
                f"{e['max_abs_err']} over {e['new_tokens']} tokens "
                f"({e['positions']} positions), parts {e['parts_err']}"
            )
        elif c.get("kind") == "exactness":
            lines.append(f"exactness {c['shape']} {c['dtype']}: {c.get('error')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=os.environ.get("OUT"))
    parser.add_argument("--smoke", action="store_true", help="tiny widths on the CPU")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(rs.SHAPES))
    parser.add_argument("--exact-shape", default="qwen3-1.7b", choices=sorted(rs.SHAPES))
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", default="2048,8192")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--variants", default="plain,full,fast,full_shared")
    parser.add_argument("--exact-dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    torch.set_grad_enabled(False)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    overrides = dict(rs.SMOKE) if args.smoke else None
    prompts = (24, 40) if args.smoke else tuple(int(x) for x in args.prompts.split(","))
    batches = (1, 2) if args.smoke else tuple(int(x) for x in args.batches.split(","))
    layers = 2 if args.smoke else None
    kernels = rs.import_engine()["kernels"]
    import transformers

    result: dict[str, Any] = {
        "command": "python experiments/gpu_capture/gpu.py" + (" --smoke" if args.smoke else ""),
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kernel_facts": kernels.kernel_facts(device),
        "smoke": args.smoke,
        "configs": [],
    }
    out_path = Path(args.out_dir) / "gpu.json" if args.out_dir else None

    def save() -> None:
        result["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if out_path is not None:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(result, indent=1))

    print(
        f"{result['device_name']} torch {torch.__version__} transformers "
        f"{transformers.__version__}",
        flush=True,
    )
    save()

    def exact(dtype: str) -> None:
        """Ω, Θ, Φ of a smaller shape at full depth against float64 (``dtype`` weights)."""
        cfg: dict[str, Any] = {"kind": "exactness", "shape": args.exact_shape, "dtype": dtype}
        try:
            hf = rs.build_model(
                args.exact_shape, layers, rs.DTYPES[dtype], device, seed=1, overrides=overrides
            )
            cfg["layers"] = int(hf.config.num_hidden_layers)
            prompt = rs.random_prompt(32, int(hf.config.vocab_size), seed=5)
            cfg["exactness"] = rs.exactness(hf, prompt, 8, ("auto", "sparse", "dense"))
            print(f"  exactness {dtype}: {cfg['exactness']['max_abs_err']}", flush=True)
            del hf
        except Exception as exc:
            cfg["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        result["configs"].append(cfg)
        save()

    if "bfloat16" in args.exact_dtypes.split(","):
        exact("bfloat16")
    # -- speed: the 8B shape in bfloat16 -------------------------------------------------
    try:
        t0 = time.monotonic()
        hf = rs.build_model(args.shape, layers, torch.bfloat16, device, overrides=overrides)
        loaded = rs.wrap(hf)
        model_gb = _mem_peak(device, 0)
        result["speed_model"] = {
            "shape": args.shape,
            "layers": int(hf.config.num_hidden_layers),
            "dtype": "bfloat16",
            "params_b": round(sum(p.numel() for p in hf.parameters()) / 1e9, 3),
            "model_gb": model_gb,
            "build_s": round(time.monotonic() - t0, 1),
        }
        print(f"built {result['speed_model']}", flush=True)
        variants = tuple(args.variants.split(","))
        warm = rs.random_prompt(64 if not args.smoke else 8, int(hf.config.vocab_size))
        for v in variants:  # kernels, allocator, attention registration
            run_variant(v, hf, loaded, [warm], 4, device)
        # batch 1 first at both lengths, then 8, then 32: what is cut by the time guard is
        # the largest batch
        for batch in batches:
            for n_prompt in prompts:
                if time.monotonic() > deadline:
                    result.setdefault("skipped", []).append(f"{n_prompt}x{batch}")
                    continue
                new = args.new if batch == 1 else max(4, args.new // (2 if batch < 32 else 4))
                repeats = args.repeats if batch == 1 else max(1, args.repeats - 1)
                print(f"  prompt {n_prompt} batch {batch}", flush=True)
                cfg: dict[str, Any] = {"kind": "speed", "shape": args.shape}
                try:
                    cfg.update(
                        speed_config(
                            hf, loaded, n_prompt, batch, new, repeats, variants, device, deadline
                        )
                    )
                except Exception as exc:
                    cfg["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    traceback.print_exc()
                result["configs"].append(cfg)
                save()
        del hf, loaded
    except Exception as exc:
        result["speed_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        traceback.print_exc()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if "float32" not in args.exact_dtypes.split(","):
        pass
    elif time.monotonic() < deadline + 45:
        exact("float32")
    else:
        result.setdefault("skipped", []).append("exactness float32")
    save()
    print(table(result), flush=True)


if __name__ == "__main__":
    main()
