"""Exactness of geometry capture on tiny random-weight models of every supported family.

The reference here is written independently of adapters/capture/session.py: an *eager* copy of the
model with ``output_attentions=True`` gives the full attention matrices (soft-capped for
Gemma-2; without the sink column for gpt-oss, so rows sum to less than 1); the value vectors
are recomputed from the attention module's input and its weights (``v_proj``, the value
slice of Phi-3's fused ``qkv_proj``, GPT-2's ``c_attn``); every part ``a(t, s)`` is
materialised for all (t, s) in float64 -- scaled by Granite's residual multiplier, through
the frozen attention-output norm of Gemma-2/3 (``1 + w``) and OLMo-2 (``w``) -- then the
full C_Attn / C_MLP matrices, Ω and Θ.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _capture_reference import (
    PROMPT,
    family_case,
    reference_features,
)
from tiny_models import FAMILIES


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request: pytest.FixtureRequest) -> dict[str, Any]:
    return family_case(request.param)


def test_parts_sum_to_post_attention_state(family_run: dict[str, Any]) -> None:
    for layer in family_run["ref"]["layers"]:
        total = layer["parts"].sum(axis=1) + layer["bias"]
        np.testing.assert_allclose(total, layer["e_tilde"], atol=1e-5, rtol=0)


def test_capture_equals_full_matrix_reference(family_run: dict[str, Any]) -> None:
    meta = family_run["meta"]
    n_prompt = len(meta["prompt_token_ids"])
    n_new = len(meta["token_ids"])
    assert n_new > 1
    rows = list(range(n_prompt - 1, n_prompt - 1 + n_new))
    omega_ref, theta_ref = reference_features(family_run["ref"], rows)
    omega = np.asarray(meta["geometry"]["omega"])
    theta = np.asarray(meta["geometry"]["theta"])
    n_layers = len(family_run["ref"]["layers"])
    assert omega.shape == theta.shape == (n_new, 2 * n_layers - 1)
    assert meta["geometry"]["num_layers"] == n_layers
    np.testing.assert_allclose(omega, omega_ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(theta, theta_ref, atol=1e-4, rtol=0)
    # the test must be able to fail: the features are not trivially constant
    assert omega.std() > 1e-3 and theta.std() > 1e-3


def test_sliding_window_is_shorter_than_sequence(family_run: dict[str, Any]) -> None:
    cfg = family_run["model"].hf_model.config
    window = getattr(cfg, "sliding_window", None)
    if family_run["family"] in ("mistral", "gemma3_text", "gemma2", "phi3", "gpt_oss"):
        meta = family_run["meta"]
        assert window is not None
        assert len(meta["prompt_token_ids"]) + len(meta["token_ids"]) > 2 * window


def test_replay_equals_capture(family_run: dict[str, Any]) -> None:
    model = family_run["model"]
    meta = family_run["meta"]
    res = model.replay(PROMPT, meta["token_ids"])
    for key in ("omega", "theta"):
        np.testing.assert_allclose(
            np.asarray(res.metadata["geometry"][key]),
            np.asarray(meta["geometry"][key]),
            atol=1e-4,
            rtol=0,
        )
    np.testing.assert_allclose(res.metadata["entropy"], meta["entropy"], atol=1e-4)
    got = [c["logprob"] for c in res.metadata["logprobs"]["content"]]
    want = [c["logprob"] for c in meta["logprobs"]["content"]]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert res.metadata["token_ids"] == meta["token_ids"]
    assert res.metadata["prompt_token_ids"] == meta["prompt_token_ids"]


def test_replay_batch_with_padding_equals_single(family_run: dict[str, Any]) -> None:
    model = family_run["model"]
    items = [(PROMPT, "Lisbon."), ("Hi?", "It is a rather long answer here.")]
    batched = model.replay_batch(items, batch_size=2, return_states=True)
    for item, got in zip(items, batched, strict=True):
        alone = model.replay(*item, return_states=True)
        for key in ("omega", "theta"):
            np.testing.assert_allclose(
                np.asarray(got.metadata["geometry"][key]),
                np.asarray(alone.metadata["geometry"][key]),
                atol=1e-4,
            )
        assert got.states is not None and alone.states is not None
        np.testing.assert_allclose(got.states.post_mlp, alone.states.post_mlp, atol=1e-4)
