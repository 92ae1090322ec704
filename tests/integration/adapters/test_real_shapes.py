"""Capture at a real width (issue 38): a Qwen3-1.7B-wide model (hidden 2,048, 16 query / 8
KV heads, head size 128, MLP 6,144) at reduced depth (2 layers) against the float64
reference, every strategy, float32 and bfloat16; and the GPU bench's smoke mode on the CPU,
in a process where LangChain cannot be imported (the GPU machine has none).

The vocabulary is cut to 1,024 tokens (the geometry does not read it; it saves 1.2 GB).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def _real_shapes() -> ModuleType:
    path = ROOT / "bench" / "real_shapes.py"
    spec = importlib.util.spec_from_file_location("bench_real_shapes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


rs = _real_shapes()

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


def run_bench_without_langchain(
    script: str, args: list[str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """``bench/<script> --smoke --out-dir tmp_path *args`` in a fresh process that cannot
    import LangChain (what a GPU machine has), outside the repository root; asserts it ran."""
    argv = [script, "--smoke", "--out-dir", str(tmp_path), *args]
    code = (
        f"import runpy, sys; sys.modules['langchain_core'] = None; sys.argv = {argv!r}; "
        f"runpy.run_path({str(ROOT / 'bench' / script)!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_gpu_bench_smoke_runs_without_langchain(tmp_path: Path) -> None:
    proc = run_bench_without_langchain("gpu.py", ["--repeats", "1", "--new", "4"], tmp_path)
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["smoke"] and result["device"] == "cpu"
    speed = [c for c in result["configs"] if c["kind"] == "speed"]
    assert {(c["prompt"], c["batch"]) for c in speed} == {(24, 1), (40, 1), (24, 2), (40, 2)}
    for c in speed:
        assert "errors" not in c and "error" not in c, c
        for v in ("plain", "full", "fast", "full_shared"):
            assert c[v]["decode_tok_s"] > 0
    exact = {
        c["dtype"]: c["exactness"]["max_abs_err"]
        for c in result["configs"]
        if c["kind"] == "exactness"
    }
    assert max(exact["float32"].values()) <= 1e-4
    assert max(exact["bfloat16"].values()) <= BF16_TOLERANCE
    assert "| shape | prompt | batch |" in proc.stdout  # the table is printed last


@pytest.mark.slow
def test_prefix_bench_smoke_runs_without_langchain(tmp_path: Path) -> None:
    """The prefix path's real-size bench runs on the engine alone (what a GPU machine has)
    and finds a stored prefix bitwise a fresh one in every capture mode."""
    run_bench_without_langchain("prefix_real_size.py", [], tmp_path)
    result = json.loads((tmp_path / "prefix_real_size.json").read_text())
    assert result["smoke"] and result["device"] == "cpu"
    assert {p["capture"] for p in result["points"]} == {"full", "fast", "none"}
    for p in result["points"]:
        assert p["stored_equals_fresh"], p
        assert p["max_abs_logit_diff"] <= 1e-4, p
