"""The supported families: registry, README and tiny models agree; capture leaves each
model's own computation alone; each family's own term in the decomposition matters;
loading in half precision and on devices.

The exactness tests of every family (Ω, Θ vs the float64 reference, every strategy,
generation and replay) are tests/test_adapters_exactness.py and tests/test_capture_memory.py,
parametrized over ``FAMILIES``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _capture_reference import PROMPT, reference_features, slow_reference
from _concurrency import _run_threads
from tiny_models import CONCURRENT_PROMPTS as PROMPTS
from tiny_models import FAMILIES, assert_same_answer, char_tokenizer, tiny_chat_model, tiny_hf_model

import abstain_guard.adapters.capture.architectures as arch
import abstain_guard.adapters.capture.session as capture_module
from abstain_guard.adapters import GeometryChatModel
from abstain_guard.adapters.capture.architectures import (
    SUPPORTED_ARCHITECTURES,
    LayerSpec,
    build_spec,
)
from abstain_guard.errors import InvalidInputError, UnsupportedArchitectureError

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_lists_exactly_the_registry() -> None:
    text = README.read_text(encoding="utf-8")
    block = re.search(
        r"<!-- supported-models:start[^>]*-->\n(.*?)<!-- supported-models:end", text, re.S
    )
    assert block is not None, "README.md lost its supported-models markers"
    listed = "\n".join(f"- `{key}`: {name}" for key, name in SUPPORTED_ARCHITECTURES.items())
    assert block.group(1).strip() == listed, (
        "README.md's supported models differ from SUPPORTED_ARCHITECTURES: paste this between "
        f"the markers:\n{listed}"
    )


def test_every_registered_family_has_a_tiny_model() -> None:
    """So every family runs the exactness tests (they are parametrized over FAMILIES)."""
    assert tuple(SUPPORTED_ARCHITECTURES) == FAMILIES
    for family in FAMILIES:
        assert tiny_hf_model(family).config.model_type == family


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_leaves_the_models_own_tokens_alone(family: str) -> None:
    """Greedy tokens with capture, without capture, and from transformers' own ``generate``
    are the same (Gemma-2 and gpt-oss run their eager attention in every path)."""
    with_capture = tiny_chat_model(family, seed=3, max_new_tokens=6)
    meta = with_capture.invoke(PROMPT).response_metadata
    plain = tiny_chat_model(family, seed=3, max_new_tokens=6, capture_geometry=False)
    assert plain.invoke(PROMPT).response_metadata["token_ids"] == meta["token_ids"]
    prompt = torch.tensor([meta["prompt_token_ids"]])
    out = with_capture.hf_model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False
    )
    hf_ids = out[0, prompt.shape[1] :].tolist()
    assert hf_ids[: len(meta["token_ids"])] == meta["token_ids"]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_concurrent_calls_on_a_mixture_of_experts_get_their_solo_answers(family: str) -> None:
    """An expert's product holds the rows routed to it, so MoE models never share decode
    steps (``threads.model_independent_rows``): concurrent calls stay bitwise solo."""
    model = tiny_chat_model(family, seed=3, max_new_tokens=8, batch_decode=True)
    solo = [model.invoke(p) for p in PROMPTS]
    got = _run_threads(model, [lambda p=p: model.invoke(p) for p in PROMPTS])
    for a, b in zip(solo, got, strict=True):
        assert_same_answer(a, b)


def _ablated_error(family: str, monkeypatch: pytest.MonkeyPatch) -> float:
    """Largest |Ω - reference| with the family's own term removed from capture."""
    if family in ("gemma2", "gpt_oss"):
        real = capture_module.row_probabilities
        drop = "softcap" if family == "gemma2" else "sinks"

        def without(*args: Any, softcap: Any = None, sinks: Any = None) -> torch.Tensor:
            extra = {"softcap": softcap, "sinks": sinks}
            if len(args) > 6:  # capture passes them positionally
                extra = dict(zip(("softcap", "sinks"), args[6:], strict=False))
            extra[drop] = None
            return real(*args[:6], **extra)

        monkeypatch.setattr(capture_module, "row_probabilities", without)
    else:
        real_layer = arch._decoder_layer

        def layer(model_type: str, config: Any, i: int, mod: Any) -> LayerSpec:
            spec = real_layer(model_type, config, i, mod)
            if family == "granite":
                spec.wo_heads = spec.wo_heads / config.residual_multiplier
            else:  # olmo2: Gemma's (1 + w) instead of w
                spec.attn_out_norm_offset = 1.0
            return spec

        monkeypatch.setattr(arch, "_decoder_layer", layer)
    model = tiny_chat_model(family, seed=3, max_new_tokens=8)
    meta = model.invoke(PROMPT).response_metadata
    ref = slow_reference(family, 3, meta["prompt_token_ids"] + meta["token_ids"])
    n_prompt, n_new = len(meta["prompt_token_ids"]), len(meta["token_ids"])
    omega_ref, _ = reference_features(ref, list(range(n_prompt - 1, n_prompt - 1 + n_new)))
    return float(np.abs(np.asarray(meta["geometry"]["omega"]) - omega_ref).max())


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "granite", "olmo2"])
def test_each_familys_own_term_matters(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Gemma-2's soft-cap, gpt-oss's sinks, Granite's residual multiplier or
    OLMo-2's norm weight (``w``, not ``1 + w``), Ω is off by far more than the exactness
    tolerance (1e-4): those tests can fail on each of these terms."""
    assert _ablated_error(family, monkeypatch) > 1e-3


def test_gpt_oss_sinks_take_probability_mass() -> None:
    """The tiny gpt-oss's rows sum to well under 1 over the tokens (the sink takes the rest)."""
    model = tiny_hf_model("gpt_oss", 3)
    with torch.no_grad():
        out = model(torch.tensor([list(range(4, 40))]), output_attentions=True)
    sums = torch.stack([a.sum(-1) for a in out.attentions])
    assert sums.max() <= 1.0 + 1e-6 and sums.mean() < 0.9


def _save_tiny(family: str, folder: Path) -> Path:
    tiny_hf_model(family, 3).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def test_from_pretrained_in_bfloat16_with_a_device_map(tmp_path: Path) -> None:
    folder = _save_tiny("qwen3", tmp_path / "qwen3")
    model = GeometryChatModel.from_pretrained(
        folder, dtype=torch.bfloat16, device_map={"": "cpu"}, max_new_tokens=4
    )
    assert model.hf_model.dtype == torch.bfloat16
    gen = model.invoke(PROMPT).response_metadata["generation"]
    assert (gen["dtype"], gen["device_type"]) == ("bfloat16", "cpu")
    with pytest.raises(InvalidInputError, match="not both"):
        GeometryChatModel.from_pretrained(folder, device="cuda", device_map="auto")
    with pytest.raises(InvalidInputError, match="floating torch dtype"):
        GeometryChatModel.from_pretrained(folder, dtype=torch.int8)


def _sessions(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    sessions: list[Any] = []
    real = capture_module.CaptureSession.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        sessions.append(self)

    monkeypatch.setattr(capture_module.CaptureSession, "__init__", spy)
    return sessions


def _session_tensors(session: Any) -> list[tuple[int, torch.Tensor]]:
    """``(layer, tensor)`` of every per-layer buffer a session holds, and the regrouped
    ``W_O`` it reads (the model's, kept or built per use)."""
    held = [
        (i, t)
        for name in ("_cmlp", "_u", "_unorm")
        for i, t in enumerate(getattr(session, name))
        if isinstance(t, torch.Tensor)
    ]
    spec = session.spec
    return held + [(i, spec.wo_kv(i)) for i in range(spec.num_layers)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_on_a_gpu_capture_stays_there_and_equals_the_cpu(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = tiny_chat_model(family, seed=3, max_new_tokens=8).invoke(PROMPT).response_metadata
    sessions = _sessions(monkeypatch)
    model = GeometryChatModel.from_hf(
        tiny_hf_model(family, 3).to("cuda"), char_tokenizer(), max_new_tokens=8
    )
    gpu = model.invoke(PROMPT).response_metadata
    assert gpu["generation"]["device_type"] == "cuda"
    assert sessions and all(
        t.device.type == "cuda" for s in sessions for _, t in _session_tensors(s)
    )
    assert gpu["token_ids"] == cpu["token_ids"]
    for key in ("omega", "theta"):
        np.testing.assert_allclose(
            np.asarray(gpu["geometry"][key]), np.asarray(cpu["geometry"][key]), atol=1e-4
        )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_split_across_gpus_every_layer_keeps_its_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _save_tiny("qwen3", tmp_path / "qwen3")
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.layers.2": 1,
        "model.norm": 1,
        "lm_head": 1,
    }
    sessions = _sessions(monkeypatch)
    model = GeometryChatModel.from_pretrained(folder, device_map=device_map, max_new_tokens=8)
    meta = model.invoke(PROMPT).response_metadata
    layer_dev = [ls.device for ls in model._spec.layers]
    assert [d.index for d in layer_dev] == [0, 1, 1]
    for s in sessions:
        for i, t in _session_tensors(s):
            assert t.device == layer_dev[i], (i, t.device)
    cpu = tiny_chat_model("qwen3", seed=3, max_new_tokens=8).invoke(PROMPT).response_metadata
    assert meta["token_ids"] == cpu["token_ids"]
    np.testing.assert_allclose(
        np.asarray(meta["geometry"]["omega"]), np.asarray(cpu["geometry"]["omega"]), atol=1e-4
    )


def test_a_layer_offloaded_to_disk_is_refused() -> None:
    """Weights on the ``meta`` device (a device_map that offloads to disk) cannot be read
    by capture: refused with the fix."""
    model = tiny_hf_model("qwen3", 3)
    model.model.layers[1].self_attn.o_proj.to("meta")
    with pytest.raises(UnsupportedArchitectureError, match="offloaded"):
        build_spec(model)
