"""The prefix path's prompt pass against the one-pass path's, side by side (one JSON line).

For the questions of ``bench/serving/serve_load.py`` asked as the shipped guard asks them (its
system
prompt, the chat template), one engine
(:class:`~abstain_guard.adapters.engine.batching.BatchEngine`) runs each prompt pass plus the choice
of the first token, alone, on one BLAS thread:

* ``one_pass_ms`` / ``prefix_ms``: the median over questions of the median over
  ``--repeats`` interleaved repeats, per capture mode (``full``, ``none``), and
  ``prefix_over_one_pass``; the prefix is in the store (computed once before timing:
  ``prefix_miss_ms`` is that first computation);
* ``prefix_tokens`` / ``prompt_tokens``: the split (median prompt length);
* ``max_abs_logit_diff``: the largest |Δ| between the two paths' first-token logits over the
  questions (why the prefix path is a decode path of its own), and ``same_first_token``.

Run: ``flock /tmp/heavy.lock .venv/bin/python bench/speed/prefix_path.py``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from langchain_core.messages import HumanMessage, SystemMessage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from serve_load import QUESTIONS

from abstain_guard.adapters import load_default_model
from abstain_guard.adapters.engine.batching import BatchEngine, GenerationRequest
from abstain_guard.adapters.engine.kernels import kernel_facts
from abstain_guard.adapters.engine.prefix import prefix_store
from abstain_guard.contract.prompts import system_prompt_for


def _first(engine: BatchEngine, prompt: list[int], split: int | None, capture: bool) -> Any:
    """One prompt pass and first token; returns (seconds, first-token logits)."""
    request = GenerationRequest(prompt=prompt, max_new=1, capture=capture, prefix=split)
    start = time.perf_counter()
    row = engine.start(request)
    seconds = time.perf_counter() - start
    engine.drop_all()
    return seconds, row.logits[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = load_default_model()
    loaded = model._s
    engine = BatchEngine(loaded, max_rows=8)
    system = system_prompt_for("open")
    convs = [[SystemMessage(system), HumanMessage(q)] for q in QUESTIONS]
    prompts = [model.encode_chat(c)[0] for c in convs]
    splits = [model._split(c, None, p) for c, p in zip(convs, prompts, strict=True)]
    out: dict[str, Any] = {
        "bench": "prefix_path",
        "model": model.model_name,
        "kernel_facts": kernel_facts("cpu"),
        "torch_threads_per_forward": 1,
        "questions": len(QUESTIONS),
        "repeats": args.repeats,
        "prompt_tokens": statistics.median(len(p) for p in prompts),
        "prefix_tokens": sorted(set(s or 0 for s in splits)),
    }
    store = prefix_store(loaded)
    for mode, capture in (("full", True), ("none", False)):
        store.clear()
        start = time.perf_counter()
        _first(engine, prompts[0], splits[0], capture)
        out[f"prefix_miss_ms_{mode}"] = round(1e3 * (time.perf_counter() - start), 1)
        one, pre, diff, same = [], [], 0.0, True
        for prompt, split in zip(prompts, splits, strict=True):
            a_s, b_s = [], []
            for _ in range(args.repeats):
                a, la = _first(engine, prompt, None, capture)
                b, lb = _first(engine, prompt, split, capture)
                a_s.append(a)
                b_s.append(b)
            one.append(statistics.median(a_s))
            pre.append(statistics.median(b_s))
            diff = max(diff, float((la - lb).abs().max()))
            same = same and int(torch.argmax(la)) == int(torch.argmax(lb))
        out[mode] = {
            "one_pass_ms": round(1e3 * statistics.median(one), 1),
            "prefix_ms": round(1e3 * statistics.median(pre), 1),
            "prefix_over_one_pass": round(statistics.median(pre) / statistics.median(one), 3),
            "max_abs_logit_diff": diff,
            "same_first_token": same,
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
