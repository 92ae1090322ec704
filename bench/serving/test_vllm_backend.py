"""vllm_backend.py --gpu end to end on the CPU (``--smoke``: the same script on a toy width
of the Qwen3 architecture, eager): three stock vLLM servers started one after the other, the
guarded one's every capture checked, the JSON with each side's tokens/s, KV-cache size and
the ratios (a few minutes on two cores).

    .venv/bin/pytest -p no:cacheprovider -q bench/serving/test_vllm_backend.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_backend import GPU_SIDES, main

from abstain_guard.backends.vllm_engine import VLLM_PYTHON_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_the_gpu_bench_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    if not os.environ.get(VLLM_PYTHON_ENV):
        pytest.skip(f"{VLLM_PYTHON_ENV} is not set (make bench sets it to .venv-vllm)")
    out = tmp_path / "gpu.json"
    assert main(["--gpu", "--smoke", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "vllm_backend_gpu" and result["cuda_graphs"] is False
    assert list(result["sides"]) == list(GPU_SIDES)  # one after the other, in this order
    for name, side in result["sides"].items():
        assert "error" not in side, (name, side)
        assert side["kv_cache_tokens"] > 0
        assert set(side["tokens_per_s"]) == {"1", "4"}
        assert all(v["median"] > 0 for v in side["tokens_per_s"].values())
    for base in ("stock_v1", "stock_default"):
        assert set(result[f"guarded_over_{base}"]) == {"1", "4"}
