"""Overhead of geometry capture during generation on the default model (SmolLM2-135M, CPU).

For prompt lengths 32, 256 and 2,048 (tokens fed to the model, chat template included) and
32 new tokens, runs side by side, interleaved (plain, engine, full, fast, then again),
``--repeats`` times each (default 5):

* plain:  ``hf_model.generate`` (greedy, sdpa, KV cache), forced to the same tokens;
* engine: ``GeometryChatModel.invoke`` without capture (``capture_geometry=False``): the
  library's own decode path (shared steps on one thread, padded to 4 rows, by default);
* full:   ``GeometryChatModel.invoke`` (greedy) with exact geometry capture (Ω, Θ), logprobs,
  entropy and the JSON metadata, i.e. the whole product path;
* fast:   the same with ``capture="fast"`` (Θ, ω_dir only; no per-source decomposition).

It checks all produce the same tokens. Every ratio is taken per repeat (that repeat's time
over that repeat's plain time) and reported as median and min-max spread; ``over_engine``
is capture over the engine without capture (the cost of capture alone, on the same decode
path). ``extra_peak_mem_mb_2048`` is the extra peak resident memory over plain at 2,048
tokens (RSS sampled every ms), ``model_rss_mb`` the resident memory the loaded model adds.
The last line printed is one JSON object::

    {"full": {"ratio_prompt32": {"median", "min", "max"}, "over_engine_prompt32": {...}, ...,
              "extra_peak_mem_mb_2048": {...}},
     "fast": {...}, "engine": {"ratio_prompt32": {...}, ...}, "plain_seconds": {...},
     "model_rss_mb": ..., "repeats": {...}}

Run: ``nice -n 5 .venv/bin/python bench/speed/capture_overhead.py [--repeats 5] [--repeats-long 3]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _measure import PeakRSS, rss_bytes, spread

from abstain_guard.adapters import GeometryChatModel, load_default_model

NEW_TOKENS = 32
PROMPT_LENGTHS = (32, 256, 2048)
TEXT = (
    "Write a very long and detailed essay about the history of the Roman Empire, from the "
    "founding of the city to the fall of Constantinople, covering its emperors, wars, "
    "economy, roads, law, religion, art, architecture, language and everyday life, and "
    "explain how each of these shaped the later history of Europe and the Mediterranean. "
)


def user_text_for(model: GeometryChatModel, n_tokens: int) -> str:
    """A user message whose chat-templated prompt has exactly ``n_tokens`` tokens."""
    tok = model.tokenizer
    base = len(model.encode_chat("x")[0]) - len(tok("x", add_special_tokens=False)["input_ids"])
    need = n_tokens - base
    reps = 1 + (4 * n_tokens) // max(1, len(tok(TEXT, add_special_tokens=False)["input_ids"]))
    ids = tok((TEXT * reps), add_special_tokens=False)["input_ids"]
    for extra in range(0, 8):
        text = tok.decode(ids[: need + extra]).strip()
        for cut in range(len(text), max(0, len(text) - 64), -1):
            n = len(model.encode_chat(text[:cut])[0])
            if n == n_tokens:
                return text[:cut]
            if n < n_tokens:
                break
    raise RuntimeError(f"could not build a prompt of exactly {n_tokens} tokens")


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """Wall time, extra peak RSS (MB) and result of ``fn()``."""
    gc.collect()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
    return dt, mem.extra_mb, out


def measure(model: GeometryChatModel, n_prompt: int, repeats: int) -> dict[str, Any]:
    """Interleaved repeats of plain, engine, full and fast at ``n_prompt`` prompt tokens.

    Returns ``{"seconds": {name: [s, ...]}, "extra_mb": {name: [MB, ...]}}``, one entry per
    repeat; the ratios are taken per repeat (capture time over the plain time of the same
    repeat), so a slow spell of the machine affects both sides of a ratio alike."""
    hf = model.hf_model
    text = user_text_for(model, n_prompt)
    prompt_ids = model.encode_chat(text)[0]
    assert len(prompt_ids) == n_prompt
    ids = torch.tensor([prompt_ids])
    ref = model.invoke(text).response_metadata["token_ids"]  # warm-up; fixes the tokens
    n_new = len(ref)

    def plain() -> list[int]:
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            pad_token_id=model.tokenizer.pad_token_id,
        )
        return [int(t) for t in out[0, ids.shape[1] :]]

    engine = model.model_copy(update={"capture_geometry": False})
    fns: dict[str, Callable[[], list[int]]] = {
        "plain": plain,
        "engine": lambda: list(engine.invoke(text).response_metadata["token_ids"]),
    }
    fast = model.model_copy(update={"capture": "fast"})
    for name, m in (("full", model), ("fast", fast)):
        fns[name] = lambda m=m: list(m.invoke(text).response_metadata["token_ids"])
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    mems: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dt, mb, toks = timed(fn)
            if toks != ref:
                raise RuntimeError(f"{name} produced different tokens: {toks} vs {ref}")
            times[name].append(dt)
            mems[name].append(mb)
    line = " ".join(f"{k}={statistics.median(v) * 1000:8.1f} ms" for k, v in times.items())
    print(f"prompt={n_prompt:5d} new={n_new} {line}", flush=True)
    return {"seconds": times, "extra_mb": mems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="repeats at 32 and 256 tokens")
    parser.add_argument("--repeats-long", type=int, default=5, help="repeats at 2,048 tokens")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    gc.collect()
    rss0 = rss_bytes()
    model = load_default_model(max_new_tokens=NEW_TOKENS)
    gc.collect()
    model_rss_mb = (rss_bytes() - rss0) / 2**20
    result: dict[str, Any] = {"full": {}, "fast": {}, "engine": {}}
    for n_prompt in PROMPT_LENGTHS:
        reps = args.repeats_long if n_prompt > 256 else args.repeats
        res = measure(model, n_prompt, reps)
        secs, mems = res["seconds"], res["extra_mb"]
        for mode in ("full", "fast", "engine"):
            ratios = [a / b for a, b in zip(secs[mode], secs["plain"], strict=True)]
            result[mode][f"ratio_prompt{n_prompt}"] = spread(ratios)
            if mode != "engine":  # capture over the same engine without capture
                own = [a / b for a, b in zip(secs[mode], secs["engine"], strict=True)]
                result[mode][f"over_engine_prompt{n_prompt}"] = spread(own)
            if n_prompt == 2048:
                extra = [a - b for a, b in zip(mems[mode], mems["plain"], strict=True)]
                result[mode]["extra_peak_mem_mb_2048"] = spread(extra)
        result.setdefault("plain_seconds", {})[f"prompt{n_prompt}"] = spread(secs["plain"])
    result["model_rss_mb"] = round(model_rss_mb, 1)
    result["repeats"] = {"short": args.repeats, "long": args.repeats_long}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
