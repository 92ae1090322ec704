"""Half precision: the dtype and device type in the generation and deployment records, the
typed refusal of a response generated in another dtype than calibration's, and capture of
a bfloat16 / float16 model (float32 accumulators) against the float64 reference."""

from __future__ import annotations

import torch
from tiny_models import tiny_chat_model

from abstain_guard.deployment import DeploymentRecord, dtype_mismatches, generation_mismatches

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
