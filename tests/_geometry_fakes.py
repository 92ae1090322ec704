"""Synthetic replay responses for the geometry scorers' tests."""

from __future__ import annotations

import io

import numpy as np

from abstain_guard.adapters import ReplayResult, TokenStates

#: layers, hidden width and probe columns of the synthetic responses
L, D = 3, 8
K = 2 * L - 1


def _response(
    rng: np.random.Generator, correct: bool, family: str | None, n: int | None = None
) -> ReplayResult:
    """One synthetic response whose classes differ only in ``family`` (None = no family)."""
    n = n if n is not None else int(rng.integers(2, 6))
    shift = 0.8 if (correct and family is not None) else 0.0
    omega = rng.uniform(0, 1, size=(n, K)) + (shift if family == "omega" else 0.0)
    theta = rng.uniform(0.2, 1.2, size=(n, K)) + (shift if family == "theta" else 0.0)
    base = np.zeros(D)
    base[0] = 3.0
    if family == "phi":
        base[1] = 3.0 if correct else -3.0
    post_attn = base + rng.normal(size=(n, L, D))
    post_mlp = base + rng.normal(size=(n, L, D))
    logprob = np.log(rng.uniform(0.2, 1.0, size=n))
    meta = {
        "prompt_token_ids": [1, 2, 3],
        "token_ids": list(range(n)),
        "logprobs": {"content": [{"token": "x", "logprob": float(v)} for v in logprob]},
        "entropy": rng.uniform(0, 2, size=n).tolist(),
        "geometry": {
            "num_layers": L,
            "omega": omega.tolist(),
            "theta": theta.tolist(),
            "phi_in": None,
            "phi_out": None,
        },
    }
    return ReplayResult(metadata=meta, states=TokenStates(post_attn, post_mlp))


def _split(
    seed: int, n: int, family: str | None, p_correct: float = 0.4
) -> list[tuple[ReplayResult, bool]]:
    rng = np.random.default_rng(seed)
    labels = rng.uniform(size=n) < p_correct
    return [(_response(rng, bool(c), family), bool(c)) for c in labels]


def _npz_round_trip(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
