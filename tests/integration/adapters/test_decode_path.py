"""The decode path is the library's choice, not the shell's, and it is recorded.

Before the library set its own threads, ``OMP_NUM_THREADS=1`` (as Ray sets it) made the
engine share decode steps while two threads decoded each row alone: the same question gave
other logprobs and geometry in the last bits, and nothing in the record said so. Now a
process started with one BLAS thread in its environment takes the path a two-thread process
takes, and gets bitwise the same answer. (A response decoded on another path is refused by
the guard: ``test_calibrate_batch_decode.test_the_other_decode_path_is_refused``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from tiny_models import tiny_chat_model

from abstain_guard.adapters.capture.session import default_parts
from abstain_guard.adapters.engine.threads import (
    ENGINE_WORKERS_ENV,
    MIN_DECODE_ROWS,
    DecodePath,
    choose_decode_path,
    engine_workers,
    process_cpus,
)
from abstain_guard.contract.deployment import decode_path_problem

QUESTION = "What is the capital of Peru?"

_CHILD = """
import json, sys
from abstain_guard.adapters import load_default_model
msg = load_default_model(max_new_tokens=24).invoke(sys.argv[1], max_new_tokens=8)
meta = msg.response_metadata
print(json.dumps({
    "path": meta["generation"]["decode_path"],
    "token_ids": meta["token_ids"],
    "logprobs": [t["logprob"] for t in meta["logprobs"]["content"]],
    "geometry": meta["geometry"],
}))
"""


def _answer(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "path": meta["generation"]["decode_path"],
        "token_ids": meta["token_ids"],
        "logprobs": [t["logprob"] for t in meta["logprobs"]["content"]],
        "geometry": meta["geometry"],
    }


@pytest.mark.model
def test_one_blas_thread_in_the_environment_changes_nothing(default_model: Any) -> None:
    here = _answer(default_model.invoke(QUESTION, max_new_tokens=8).response_metadata)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, QUESTION],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert here["path"] == {
        "steps": "shared",
        "threads": 1,
        "min_rows": MIN_DECODE_ROWS,
        "prefix": "system_turn",
        "parts": default_parts().record(),
    }
    assert there == json.loads(json.dumps(here))  # bitwise: JSON floats round-trip exactly


def test_the_path_is_chosen_from_the_weights_not_the_thread_setting() -> None:
    model = tiny_chat_model("qwen2", seed=3)
    before = torch.get_num_threads()
    try:
        paths = set()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            paths.add(choose_decode_path(model.hf_model, True, 8))
    finally:
        torch.set_num_threads(before)
    (path,) = paths
    assert path.record() == DecodePath("shared", 1, MIN_DECODE_ROWS).record()
    assert MIN_DECODE_ROWS <= path.max_rows <= 8
    assert choose_decode_path(model.hf_model, False, 8) == DecodePath("alone", 1, 1)
    # a model loaded with more rows per step (calibration's 16) decodes the same numbers:
    # the steps hold at most as many rows as stay independent on this CPU (6 on an Intel
    # Xeon with MKL's AVX2 branch, where 16 rows per step once made every row go alone)
    wide = choose_decode_path(model.hf_model, True, 16)
    assert wide.record() == path.record()
    assert path.max_rows <= wide.max_rows <= 16
    msg = model.invoke("Hi")
    assert msg.response_metadata["generation"]["decode_path"] == model.decode_path()


def test_engines_follow_the_library_setting_not_omp(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = torch.nn.Linear(2, 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(ENGINE_WORKERS_ENV, raising=False)
    assert engine_workers(hf) == process_cpus()
    monkeypatch.setenv(ENGINE_WORKERS_ENV, "3")
    assert engine_workers(hf) == 3
    monkeypatch.setenv(ENGINE_WORKERS_ENV, "zero")
    with pytest.raises(ValueError, match=ENGINE_WORKERS_ENV):
        engine_workers(hf)


def test_the_refusal_names_both_paths() -> None:
    shared = DecodePath("shared", 1, 4).record()
    alone = DecodePath("alone", 1, 1).record()
    message = decode_path_problem(alone, shared)
    assert "each row decoded alone on 1 BLAS thread(s)" in message
    assert (
        "calibrated with each prompt in one pass, shared decode steps on 1 BLAS thread(s), "
        "padded to 4 rows" in message
    )
    assert "an unrecorded decode path" in decode_path_problem(None, shared)
    prefixed = DecodePath("shared", 1, 4, prefix="system_turn").record()
    assert prefixed == {**shared, "prefix": "system_turn"}
    message = decode_path_problem(shared, prefixed)
    assert "calibrated with prompt passes split after the shared prefix (system_turn)" in message
    assert "prefix_cache" in message
