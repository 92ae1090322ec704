"""Half precision: the dtype and device type in the generation and deployment records, the
typed refusal of a response generated in another dtype than calibration's, and capture of
a bfloat16 / float16 model (float32 accumulators) against the float64 reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _capture_reference import PROMPT, reference_features, slow_reference
from tiny_models import FAMILIES, tiny_chat_model

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
from abstain_guard.adapters.engine.kernels import kernel_facts
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.building.answering.answers import numerics_key
from abstain_guard.contract.deployment import (
    DeploymentRecord,
    PromptRecord,
    dtype_mismatches,
    generation_mismatches,
)
from abstain_guard.contract.kernels import bit_deciding
from abstain_guard.errors import ArtifactMismatchError
from abstain_guard.scorers import PerplexityScorer

RECORD = DeploymentRecord(decoding={"temperature": 0.0, "dtype": "bfloat16", "device_type": "cpu"})


def test_a_response_in_another_dtype_is_a_mismatch_naming_both() -> None:
    (problem,) = dtype_mismatches(RECORD, {"dtype": "float32", "device_type": "cpu"})
    assert "dtype='float32' but calibration used 'bfloat16'" in problem
    assert "torch.bfloat16" in problem  # says how to load the model
    assert dtype_mismatches(RECORD, {"dtype": "bfloat16", "device_type": "cuda"}) == []
    (unrecorded,) = dtype_mismatches(RECORD, {})
    assert "bfloat16" in unrecorded
    # records written before dtypes were recorded check nothing
    assert dtype_mismatches(DeploymentRecord(decoding={}), {"dtype": "float16"}) == []
    assert any("dtype" in p for p in generation_mismatches(RECORD, {"dtype": "float16"}))


def test_the_records_carry_dtype_and_device_type() -> None:
    model = tiny_chat_model("llama", seed=0, max_new_tokens=3)
    model.hf_model.to(torch.bfloat16)
    msg = model.invoke("Hi?")
    gen = msg.response_metadata["generation"]
    assert (gen["dtype"], gen["device_type"]) == ("bfloat16", "cpu")
    settings = model.decoding_settings()
    assert (settings["dtype"], settings["device_type"]) == ("bfloat16", "cpu")
    (problem,) = dtype_mismatches(DeploymentRecord(decoding={**settings, "dtype": "float32"}), gen)
    assert "dtype='bfloat16' but calibration used 'float32'" in problem


#: Largest |capture - float64 reference| measured over the 13 tiny families, seeds 3 and 4,
#: 8 new tokens each, generation and replay
#: (``python experiments/family_exactness/family_exactness.py --dtypes bfloat16,float16``):
#: bfloat16 Ω 4.0e-2, Θ 3.1e-2; float16 Ω 1.2e-2, Θ 3.1e-3; float32 Ω, Θ <= 1e-5. The
#: reference runs the same (rounded) weights in float64, so this is the model's own
#: half-precision forward, not capture (see the state test below). Tolerances: ~1.5x those.
TOLERANCE = {torch.bfloat16: 0.06, torch.float16: 0.02}


def _angle64(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    cos = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))
    return np.arccos(np.clip(cos, -1.0, 1.0))


def _c_mlp64(e_tilde: np.ndarray, e_out: np.ndarray) -> np.ndarray:
    """``C_MLP[t, t]`` in float64 from the states (normalised L1 proximity, part m)."""
    zn = np.abs(e_out).sum(-1)
    num_m = np.maximum(0.0, zn - np.abs(e_tilde).sum(-1))
    num_a = np.maximum(0.0, zn - np.abs(e_out - e_tilde).sum(-1))
    den = num_m + num_a
    return np.divide(num_m, den, out=np.zeros_like(den), where=den > 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_capture_is_within_the_measured_tolerance(family: str) -> None:
    """A bfloat16 model (CPU) captures Ω, Θ within the measured bfloat16 tolerance of the
    float64 reference of its own (rounded) weights, generation and replay; and given the
    model's own bfloat16 states, capture's float32 accumulators add nothing measurable:
    Θ and ω_dir recomputed in float64 from the replayed states agree to 1e-5."""
    model = tiny_chat_model(family, seed=3, dtype=torch.bfloat16, max_new_tokens=6)
    assert model.hf_model.dtype == torch.bfloat16
    meta = model.invoke(PROMPT).response_metadata
    ids = meta["prompt_token_ids"] + meta["token_ids"]
    n_prompt, n_new = len(meta["prompt_token_ids"]), len(meta["token_ids"])
    ref = slow_reference(family, 3, ids, weights_dtype=torch.bfloat16)
    omega_ref, theta_ref = reference_features(ref, list(range(n_prompt - 1, n_prompt - 1 + n_new)))
    replayed = model.replay(PROMPT, meta["token_ids"], return_states=True)
    tol = TOLERANCE[torch.bfloat16]
    for m in (meta, replayed.metadata):
        omega, theta = np.asarray(m["geometry"]["omega"]), np.asarray(m["geometry"]["theta"])
        assert np.isfinite(omega).all() and np.isfinite(theta).all()
        np.testing.assert_allclose(omega, omega_ref, atol=tol, rtol=0)
        np.testing.assert_allclose(theta, theta_ref, atol=tol, rtol=0)
    states = replayed.states
    assert states is not None
    e_tilde, e_out = states.post_attn.astype(np.float64), states.post_mlp.astype(np.float64)
    geo = replayed.metadata["geometry"]
    theta, omega = np.asarray(geo["theta"]), np.asarray(geo["omega"])
    np.testing.assert_allclose(theta[:, 0::2], _angle64(e_tilde, e_out), atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        theta[:, 1::2], _angle64(e_out[:, :-1], e_tilde[:, 1:]), atol=1e-5, rtol=0
    )
    np.testing.assert_allclose(omega[:, 0::2], _c_mlp64(e_tilde, e_out), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_float16_capture_is_within_the_measured_tolerance(family: str) -> None:
    model = tiny_chat_model(family, seed=4, dtype=torch.float16, max_new_tokens=6)
    meta = model.invoke(PROMPT).response_metadata
    ids = meta["prompt_token_ids"] + meta["token_ids"]
    n_prompt, n_new = len(meta["prompt_token_ids"]), len(meta["token_ids"])
    ref = slow_reference(family, 4, ids, weights_dtype=torch.float16)
    omega_ref, theta_ref = reference_features(ref, list(range(n_prompt - 1, n_prompt - 1 + n_new)))
    tol = TOLERANCE[torch.float16]
    np.testing.assert_allclose(np.asarray(meta["geometry"]["omega"]), omega_ref, atol=tol)
    np.testing.assert_allclose(np.asarray(meta["geometry"]["theta"]), theta_ref, atol=tol)


def _guard(model: Any, calibrated_dtype: str) -> AbstentionGuard:
    """A guard whose artifact says it was calibrated on ``model`` in ``calibrated_dtype``."""
    record = DeploymentRecord(
        model_fingerprint=model.fingerprint,
        chat_template_sha256=model.chat_template_sha256,
        decoding={**model.decoding_settings(), "dtype": calibrated_dtype},
        prompts={"open": PromptRecord(system_prompt=None, max_new_tokens=3)},
    )
    scores = np.linspace(0.0, 1.0, 20)
    artifact = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, np.arange(20) % 2 == 0),
        model_fingerprint=model.fingerprint,
        metadata={"deployment": record.to_json()},
    )
    return AbstentionGuard(
        model.bind(max_new_tokens=3), artifact=artifact, config=GuardConfig(participation=0.5)
    )


def test_a_guard_refuses_a_response_generated_in_another_dtype() -> None:
    model = tiny_chat_model("llama", seed=0, dtype=torch.bfloat16)
    _guard(model, "bfloat16").invoke("Hi?")  # the calibrated dtype: no mismatch
    with pytest.raises(
        ArtifactMismatchError, match="dtype='bfloat16' but calibration used 'float32'"
    ):
        _guard(model, "float32").invoke("Hi?")


def test_the_generation_cache_keys_answers_of_a_half_precision_model_apart() -> None:
    """Calibration caches answers by model fingerprint, which leaves the dtype and the
    kernels out: a bfloat16 run's keys carry its dtype, float32 keys none; both carry the
    bit-deciding kernel facts of this process (answers from other kernels are not reused)."""
    half = numerics_key(tiny_chat_model("llama", seed=0, dtype=torch.bfloat16))
    full = numerics_key(tiny_chat_model("llama", seed=0))
    assert half["dtype"] == "bfloat16"
    assert "dtype" not in full
    assert full["kernels"] == half["kernels"] == bit_deciding(kernel_facts("cpu"))
    assert full["kernels"]["aten_capability"] == torch.backends.cpu.get_cpu_capability()
