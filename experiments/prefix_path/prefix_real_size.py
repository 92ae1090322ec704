"""The prefix path at real size: a long shared prefix, side by side with one pass.

A random-weight model of a published shape (``tests/real_shapes.py``; needs only torch,
transformers and numpy) runs, per prefix length P and capture mode, the prompt pass and first
token of P shared tokens + ``--suffix`` tokens of its own through the library's engine
(:class:`~abstain_guard.adapters.engine.batching.BatchEngine`):

* ``one_pass_s`` / ``prefix_s``: medians over ``--repeats`` interleaved repeats (the prefix
  already in the store), ``prefix_miss_s`` (the first request: the prefix computed), and
  ``prefix_over_one_pass``;
* ``stored_equals_fresh``: a stored prefix gives bitwise the fresh prefix's logits and
  features (``torch.equal``), on this device;
* ``max_abs_logit_diff`` / ``max_abs_feature_diff``: the first token's logits and Ω, Θ on the
  two paths (why the prefix path is a decode path of its own);
* the kernel facts of the device.

Run: ``python experiments/prefix_path/prefix_real_size.py --out-dir $OUT`` (GPU: Qwen3-8B shape,
bfloat16); ``python experiments/prefix_path/prefix_real_size.py --smoke`` on the CPU (tiny width,
seconds).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import real_shapes as rs


def measure(args: argparse.Namespace, device: str) -> dict[str, Any]:
    mods = rs.import_engine()
    prefix_mod = importlib.import_module("abstain_guard.adapters.engine.prefix")
    overrides = rs.SMOKE if args.smoke else None
    dtype = torch.float32 if args.smoke else rs.DTYPES[args.dtype]
    hf = rs.build_model(
        args.shape, args.layers, dtype, device, vocab=args.vocab, overrides=overrides
    )
    loaded = rs.wrap(hf)
    store = prefix_mod.prefix_store(loaded)
    vocab = int(hf.config.vocab_size)
    out: dict[str, Any] = {
        "bench": "prefix_real_size",
        "shape": args.shape,
        "layers": args.layers,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "kernel_facts": mods["kernels"].kernel_facts(device),
        "suffix_tokens": args.suffix,
        "repeats": args.repeats,
        "smoke": bool(args.smoke),
        "points": [],
    }
    rs.prefix_first(loaded, rs.random_prompt(16, vocab, seed=99), None, "none")  # warm-up
    for n_prefix in args.prefixes:
        shared = rs.random_prompt(n_prefix, vocab, seed=n_prefix)
        prompts = [shared + rs.random_prompt(args.suffix, vocab, seed=7 + q) for q in range(3)]
        for mode in args.modes:
            store.clear()
            miss_s, fresh_logits, fresh_feats = rs.prefix_first(loaded, prompts[0], n_prefix, mode)
            _, stored_logits, stored_feats = rs.prefix_first(loaded, prompts[0], n_prefix, mode)
            same = torch.equal(fresh_logits, stored_logits) and all(
                (fresh_feats[k] == stored_feats[k]).all() for k in fresh_feats
            )
            one, pre, dlog, dfeat = [], [], 0.0, 0.0
            for _ in range(args.repeats):
                for prompt in prompts:
                    a_s, la, fa = rs.prefix_first(loaded, prompt, None, mode)
                    b_s, lb, fb = rs.prefix_first(loaded, prompt, n_prefix, mode)
                    one.append(a_s)
                    pre.append(b_s)
                    dlog = max(dlog, float((la.float() - lb.float()).abs().max()))
                    for k in fa:
                        dfeat = max(dfeat, float(abs(fa[k] - fb[k]).max()))
            point = {
                "prefix_tokens": n_prefix,
                "capture": mode,
                "one_pass_s": round(statistics.median(one), 4),
                "prefix_s": round(statistics.median(pre), 4),
                "prefix_miss_s": round(miss_s, 4),
                "prefix_over_one_pass": round(statistics.median(pre) / statistics.median(one), 3),
                "stored_equals_fresh": bool(same),
                "max_abs_logit_diff": dlog,
                "max_abs_feature_diff": dfeat if fresh_feats else None,
            }
            out["points"].append(point)
            print(json.dumps(point), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(rs.SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's depth")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(rs.DTYPES))
    parser.add_argument("--vocab", type=int, default=32768, help="smaller vocabulary, less memory")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--suffix", type=int, default=48)
    parser.add_argument("--modes", nargs="+", default=["full", "fast", "none"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny width on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.prefixes, args.suffix, args.repeats = 2, [24], 6, 1
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    result = measure(args, device)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / "prefix_real_size.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
