"""fast_capture.py turns full token blocks into fast ones: the same columns as
``token_block(..., capture="fast")`` of the same response.

    .venv/bin/pytest -p no:cacheprovider -q experiments
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fast_capture import fast_block

from abstain_guard.adapters import ReferenceMeans, ReplayResult, TokenStates
from abstain_guard.scorers import token_block

L, D, N = 3, 8, 4  # layers, width, tokens of the synthetic response
K = 2 * L - 1  # Ω columns: ω_prop and ω_dir interleaved, as full capture stores them


def _response(rng: np.random.Generator) -> ReplayResult:
    meta = {
        "prompt_token_ids": [1, 2, 3],
        "token_ids": list(range(N)),
        "logprobs": {"content": [{"token": "x", "logprob": -0.5} for _ in range(N)]},
        "entropy": rng.uniform(0, 2, size=N).tolist(),
        "geometry": {
            "num_layers": L,
            "omega": rng.uniform(0, 1, size=(N, K)).tolist(),
            "theta": rng.uniform(0.2, 1.2, size=(N, K)).tolist(),
            "phi_in": None,
            "phi_out": None,
        },
    }
    states = TokenStates(rng.normal(size=(N, L, D)), rng.normal(size=(N, L, D)))
    return ReplayResult(metadata=meta, states=states)


def test_the_study_reads_the_columns_the_scorer_reads() -> None:
    r = _response(np.random.default_rng(4))
    means = ReferenceMeans.from_states([r.states], [r.states])
    converted = fast_block(token_block(r, means), L)
    np.testing.assert_array_equal(
        converted.geometry, token_block(r, means, capture="fast").geometry
    )
