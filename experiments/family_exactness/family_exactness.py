"""How far capture is from the float64 reference, per family, strategy and dtype.

Tiny random-weight models of every supported family (tests/tiny_models.py), the prompt of
tests/unit/adapters/test_adapters_exactness.py, greedy answers:

* ``float32`` (default): per family the largest |capture - reference| of Ω and Θ over the
  cached, dense and sparse strategies, generation and replay (seed 3, 14 new tokens), and
  ``parts`` = max |Σ_s a(T, s) + b_O - ẽ| of the reference itself;
* ``--dtypes bfloat16,float16``: the model in half precision (float32 accumulators in
  capture) against the float64 reference of the same rounded weights, seeds 3 and 4, 8 new
  tokens; also replay against generation.

Prints Markdown table rows (docs/method.md). Run from the repository root:
``python experiments/family_exactness/family_exactness.py [--dtypes bfloat16,float16]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from test_adapters_exactness import PROMPT, reference_features, slow_reference
from tiny_models import FAMILIES, tiny_chat_model

import abstain_guard.adapters.capture.session as capture_module

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rows(meta: dict) -> list[int]:
    n_prompt, n_new = len(meta["prompt_token_ids"]), len(meta["token_ids"])
    return list(range(n_prompt - 1, n_prompt - 1 + n_new))


def _err(geo: dict, omega: np.ndarray, theta: np.ndarray) -> tuple[float, float]:
    return (
        float(np.abs(np.asarray(geo["omega"]) - omega).max()),
        float(np.abs(np.asarray(geo["theta"]) - theta).max()),
    )


def float32_row(family: str) -> str:
    """One table row: every strategy, generation and replay, float32."""
    model = tiny_chat_model(family, seed=3, max_new_tokens=14)
    meta = model.invoke(PROMPT).response_metadata
    ids = meta["prompt_token_ids"] + meta["token_ids"]
    ref = slow_reference(family, 3, ids)
    parts = max(
        float(np.abs(layer["parts"].sum(1) + layer["bias"] - layer["e_tilde"]).max())
        for layer in ref["layers"]
    )
    omega, theta = reference_features(ref, _rows(meta))
    errs = []
    try:
        for strategy in ("cached", "dense", "sparse"):
            capture_module.DEFAULT_STRATEGY = strategy
            gen = model.invoke(PROMPT).response_metadata["geometry"]
            rep = model.replay(PROMPT, meta["token_ids"]).metadata["geometry"]
            errs += [_err(gen, omega, theta), _err(rep, omega, theta)]
    finally:
        capture_module.DEFAULT_STRATEGY = "auto"
    d_omega, d_theta = max(e[0] for e in errs), max(e[1] for e in errs)
    n_new = len(meta["token_ids"])
    return f"| `{family}` | {n_new} | {len(ids)} | {parts:.1e} | {d_omega:.1e} | {d_theta:.1e} |"


def half_row(family: str, dtype: str, seed: int) -> str:
    """One table row: a half-precision model against the float64 reference."""
    model = tiny_chat_model(family, seed=seed, dtype=DTYPES[dtype], max_new_tokens=8)
    meta = model.invoke(PROMPT).response_metadata
    ref = slow_reference(
        family, seed, meta["prompt_token_ids"] + meta["token_ids"], weights_dtype=DTYPES[dtype]
    )
    omega, theta = reference_features(ref, _rows(meta))
    rep = model.replay(PROMPT, meta["token_ids"]).metadata["geometry"]
    g_o, g_t = _err(meta["geometry"], omega, theta)
    r_o, r_t = _err(rep, omega, theta)
    drift = float(np.abs(np.asarray(rep["omega"]) - np.asarray(meta["geometry"]["omega"])).max())
    return (
        f"| {dtype} | `{family}` | {seed} | {len(meta['token_ids'])} | {max(g_o, r_o):.1e} | "
        f"{max(g_t, r_t):.1e} | {drift:.1e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, ...")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    families = args.families.split(",")
    for dtype in args.dtypes.split(","):
        if dtype == "float32":
            print("| family | new tokens | positions | parts | max ΔΩ | max ΔΘ |")
            print("|---|---|---|---|---|---|")
            for family in families:
                print(float32_row(family), flush=True)
        else:
            print(
                "| dtype | family | seed | new tokens | max ΔΩ | max ΔΘ | replay − generation ΔΩ |"
            )
            print("|---|---|---|---|---|---|---|")
            for family in families:
                for seed in (3, 4):
                    print(half_row(family, dtype, seed), flush=True)


if __name__ == "__main__":
    main()
