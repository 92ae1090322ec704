"""What the library's thread choices rest on (adapters/engine/threads.py), measured on this machine.

For the embedded model (plain transformers forwards, no capture, greedy):

* ``decode_ms``: one decode step (one new token per row, 40-token prompts) for 1, 4 and 8
  rows on 1 and on every CPU's worth of threads; the median over ``--repeats`` interleaved
  repeats, with the min-max spread;
* ``prefill_ms``: one prompt pass of 256 tokens on 1 thread and on all CPUs;
* ``rows_independent``: whether every linear layer gives each row bitwise the same numbers
  for every batch of ``k..8`` rows (``k`` = 1..4), per thread count;
* ``prefill_same_across_threads``: whether a prompt pass gives bitwise the same logits on 1
  thread and on all CPUs.

Run: ``flock /tmp/heavy.lock .venv/bin/python experiments/threads/decode_path.py``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from transformers import DynamicCache

from abstain_guard.adapters import load_default_model
from abstain_guard.adapters.engine.threads import model_independent_rows, process_cpus


def decode_step_s(hf: Any, rows: int, threads: int, steps: int = 16, prompt: int = 40) -> float:
    """Mean seconds of one decode step of ``rows`` rows on ``threads`` threads."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(100, 1000, (rows, prompt), generator=gen)
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        out = hf(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(steps):
            out = hf(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - start) / steps


def prefill_s(hf: Any, threads: int, tokens: int = 256) -> float:
    """Seconds of one prompt pass of ``tokens`` tokens on ``threads`` threads."""
    torch.set_num_threads(threads)
    ids = torch.randint(100, 1000, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        start = time.perf_counter()
        hf(input_ids=ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - start


def summary(values: list[float]) -> dict[str, float]:
    """Median and min-max of ``values`` in milliseconds."""
    ms = [v * 1000 for v in values]
    return {
        "median": round(statistics.median(ms), 1),
        "min": round(min(ms), 1),
        "max": round(max(ms), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    hf = load_default_model().hf_model
    cpus = process_cpus()
    threads = sorted({1, cpus})
    decode: dict[str, list[float]] = {}
    prefill: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved: every setting once per repeat
        for rows in (1, 4, 8):
            for t in threads:
                decode.setdefault(f"rows{rows}_threads{t}", []).append(decode_step_s(hf, rows, t))
        for t in threads:
            prefill.setdefault(f"threads{t}", []).append(prefill_s(hf, t))
    independent: dict[str, dict[str, bool]] = {}
    for t in threads:
        torch.set_num_threads(t)
        independent[f"threads{t}"] = {
            f"from{k}": model_independent_rows(hf, k, 8) >= 8 for k in (1, 2, 3, 4)
        }
    ids = torch.randint(100, 1000, (1, 200), generator=torch.Generator().manual_seed(2))
    logits = []
    for t in threads:
        torch.set_num_threads(t)
        with torch.inference_mode():
            logits.append(hf(input_ids=ids, use_cache=False).logits)
    result: dict[str, Any] = {
        "cpus": cpus,
        "repeats": args.repeats,
        "decode_ms": {k: summary(v) for k, v in decode.items()},
        "prefill_ms": {k: summary(v) for k, v in prefill.items()},
        "rows_independent": independent,
        "prefill_same_across_threads": all(torch.equal(logits[0], x) for x in logits[1:]),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
