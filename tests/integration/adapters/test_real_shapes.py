"""Capture at a real width: a Qwen3-1.7B-wide model (hidden 2,048, 16 query / 8 KV heads,
head size 128, MLP 6,144) at reduced depth (2 layers) against the float64 reference, every
strategy, float32 and bfloat16; and, at a tiny width in a process where LangChain cannot be
imported (what a GPU machine running the real-size benchmarks has), the engine's capture
against the float64 reference and its prefix path against one pass.

The vocabulary is cut to 1,024 tokens (the geometry does not read it; it saves 1.2 GB).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import real_shapes as rs
import torch

HELPERS = Path(rs.__file__).resolve().parent  # where real_shapes.py lives

#: the guard's half-precision tolerance (tests/test_half_precision.py), measured on tiny
#: models; at a real width it must hold too
BF16_TOLERANCE = 0.06


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_width_two_layers_equal_float64(dtype: torch.dtype) -> None:
    hf = rs.build_model("qwen3-1.7b", layers=2, dtype=dtype, vocab=1024, seed=1)
    assert hf.config.hidden_size == 2048 and hf.config.num_attention_heads == 16
    prompt = rs.random_prompt(12, 1024, seed=2)
    res = rs.exactness(hf, prompt, 4, ("auto", "cached", "sparse", "dense"))
    assert res["new_tokens"] == 4
    assert res["parts_err"] < 1e-9  # the reference's parts sum to its own e~
    tol = 1e-4 if dtype == torch.float32 else BF16_TOLERANCE
    for name, err in res["max_abs_err"].items():
        assert err <= tol, (name, res)
    # the strategies differ in float32 only by rounding
    if dtype == torch.float32:
        assert max(v["omega"] for v in res["per_strategy"].values()) <= 1e-4


#: run in a fresh process that cannot import LangChain: the smoke shape's capture against the
#: float64 reference (float32 and bfloat16), and a stored prefix against a fresh one and
#: against one pass, per capture mode; prints one JSON object
WITHOUT_LANGCHAIN = """
import json, sys
sys.modules["langchain_core"] = None
sys.path.insert(0, {here!r})
import real_shapes as rs
import torch
rs.import_engine()  # the leaf modules alone, before any abstain_guard import
from abstain_guard.adapters.engine.prefix import prefix_store

out = {{"exactness": {{}}, "prefix": {{}}}}
for name in ("float32", "bfloat16"):
    hf = rs.build_model("qwen3-1.7b", 2, rs.DTYPES[name], seed=1, overrides=rs.SMOKE)
    prompt = rs.random_prompt(32, int(hf.config.vocab_size), seed=5)
    out["exactness"][name] = rs.exactness(hf, prompt, 8, ("auto", "sparse", "dense"))["max_abs_err"]
hf = rs.build_model("qwen3-8b", 2, torch.float32, overrides=rs.SMOKE)
loaded = rs.wrap(hf)
store = prefix_store(loaded)
vocab = int(hf.config.vocab_size)
prompt = rs.random_prompt(24, vocab, seed=24) + rs.random_prompt(6, vocab, seed=7)
for mode in ("full", "fast", "none"):
    store.clear()
    _, fresh, fresh_f = rs.prefix_first(loaded, prompt, 24, mode)
    _, stored, stored_f = rs.prefix_first(loaded, prompt, 24, mode)
    _, one, _ = rs.prefix_first(loaded, prompt, None, mode)
    same = torch.equal(fresh, stored) and all((fresh_f[k] == stored_f[k]).all() for k in fresh_f)
    out["prefix"][mode] = {{
        "stored_equals_fresh": bool(same),
        "max_abs_logit_diff": float((one.float() - stored.float()).abs().max()),
    }}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_engine_without_langchain_equals_float64_and_its_prefix_path_one_pass(
    tmp_path: Path,
) -> None:
    code = WITHOUT_LANGCHAIN.format(here=str(HELPERS))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert max(result["exactness"]["float32"].values()) <= 1e-4
    assert max(result["exactness"]["bfloat16"].values()) <= BF16_TOLERANCE
    assert set(result["prefix"]) == {"full", "fast", "none"}
    for mode, p in result["prefix"].items():
        assert p["stored_equals_fresh"], (mode, p)
        assert p["max_abs_logit_diff"] <= 1e-4, (mode, p)
