"""Memory-bounded exact capture (adapters/capture/source_parts.py) and the fast capture mode.

The sparse (decode step) and source-chunked dense strategies must equal an independent
float64 computation of the parts, and the full-matrix reference of
tests/test_adapters_exactness.py on the tiny models of all five families, whichever strategy
the session is forced to use. Fast capture must give the same Θ, Φ and ω_dir as full capture
and be refused, with a typed error, by anything fitted on the other mode.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _capture_reference import PROMPT, family_case, reference_features
from tiny_models import FAMILIES, tiny_chat_model

import abstain_guard.adapters.capture.architectures as architectures
import abstain_guard.adapters.capture.session as capture_module
from abstain_guard.adapters import ReferenceMeans
from abstain_guard.adapters.capture.source_parts import (
    Rows,
    cached_numerators,
    dense_numerators,
    head_max_abs,
    heads_by_query,
    new_parts,
    proximity_from_numerators,
    sparse_numerators,
)
from abstain_guard.contract.metadata import ResponseMetadata
from abstain_guard.errors import CaptureModeError, InvalidInputError

STRATEGIES = ("cached", "dense", "sparse")


def _random_case(seed: int, gemma: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    b, h, hkv, r, s, dh, d = 2, 6, 2, 3, 40, 8, 48
    logits = torch.randn((b, h, r, s), generator=gen) * 3.0
    return {
        "probs": torch.softmax(logits, -1),
        "v": torch.randn((b, hkv, s, dh), generator=gen),
        "wo_kv": torch.randn((hkv, dh, (h // hkv) * d), generator=gen) * 0.3,
        "z": torch.randn((b, r, d), generator=gen),
        "e_self": torch.randn((b, r, d), generator=gen),
        "t_idx": torch.tensor([30, 35, 39]),
        "factor": torch.rand((b, r, d), generator=gen) + 0.2 if gemma else None,
    }


def _float64_numerators(c: dict[str, Any]) -> torch.Tensor:
    """Every part materialised in float64: ``|z|_1 - |z - a(T, s)|_1``, ``[B, R, S]``."""
    probs, v, wo_kv = c["probs"].double(), c["v"].double(), c["wo_kv"].double()
    b, h, _, s = probs.shape
    hkv, d = v.shape[1], c["z"].shape[-1]
    u = torch.matmul(v, wo_kv).view(b, hkv, s, h // hkv, d).permute(0, 2, 1, 3, 4)
    parts = torch.einsum("bhqs,bshd->bqsd", probs, u.reshape(b, s, h, d))
    if c["factor"] is not None:
        parts = parts * c["factor"].double()[:, :, None, :]
    for q, t in enumerate(c["t_idx"].tolist()):
        parts[:, q, t] += c["e_self"][:, q].double()
    z = c["z"].double()
    return z.abs().sum(-1, keepdim=True) - (z[:, :, None, :] - parts).abs().sum(-1)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_sparse_and_chunked_numerators_equal_float64(seed: int, gemma: bool) -> None:
    c = _random_case(seed, gemma)
    ref = _float64_numerators(c)
    rows = Rows(c["z"], c["e_self"], c["t_idx"], c["factor"])
    dense = dense_numerators(c["probs"], c["v"], c["wo_kv"], rows, max_chunk_elems=3000)
    norms = head_max_abs(c["v"], c["wo_kv"], c["z"].shape[-1], chunk=7)
    sparse = sparse_numerators(c["probs"], c["v"], norms, c["wo_kv"], rows)
    u = torch.cat([new_parts(c["v"][:, :, a : a + 9], c["wo_kv"], 48) for a in range(0, 40, 9)], 2)
    cached = cached_numerators(c["probs"], u, rows)
    assert dense.shape == sparse.shape == cached.shape == ref.shape
    np.testing.assert_allclose(dense.double(), ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(sparse.double(), ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(cached.double(), ref, atol=1e-4, rtol=0)
    # the corrections matter: the linear term alone is not the answer here
    assert (ref.clamp_min(0) > 0).any() and (ref < 0).any()
    prox = proximity_from_numerators(sparse)
    np.testing.assert_allclose(prox.sum(-1).numpy(), 1.0, atol=1e-5)


def test_sparse_needs_the_corrections() -> None:
    """Without corrections (all bounds zero) the result differs: the test above can fail."""
    c = _random_case(0, False)
    rows = Rows(c["z"], c["e_self"], c["t_idx"], c["factor"])
    zero = torch.zeros(c["probs"].shape[0], c["probs"].shape[-1], c["probs"].shape[1])
    wrong = sparse_numerators(c["probs"], c["v"], zero, c["wo_kv"], rows)
    assert (wrong.double() - _float64_numerators(c)).abs().max() > 1e-2


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> dict[str, Any]:
    return family_case(request.param)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_equals_reference(
    family: dict[str, Any], strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation and replay with the session forced to one strategy (cached: keep u of
    every position; dense: recompute in source chunks every step; sparse: bounds and
    corrections, also for the replay block) equal the float64 full-matrix reference and the
    default run. (Replay keeps nothing across calls, so "cached" replays densely.)"""
    monkeypatch.setattr(capture_module, "DEFAULT_STRATEGY", strategy)
    used: list[tuple[bool, bool]] = []
    real = capture_module.CaptureSession._on_post_attention

    def spy(self: Any, i: int) -> None:
        used.append((self._u[i] is not None, bool(self.sparse)))
        real(self, i)

    monkeypatch.setattr(capture_module.CaptureSession, "_on_post_attention", spy)
    model, meta = family["model"], family["meta"]
    got = model.invoke(PROMPT).response_metadata
    assert got["token_ids"] == meta["token_ids"]
    n_prompt, n_new = len(meta["prompt_token_ids"]), len(meta["token_ids"])
    rows = list(range(n_prompt - 1, n_prompt - 1 + n_new))
    omega_ref, theta_ref = reference_features(family["ref"], rows)
    generation_used = set(used)
    replayed = model.replay(PROMPT, meta["token_ids"]).metadata
    expected = {"cached": (True, False), "dense": (False, False), "sparse": (False, True)}
    assert generation_used == {expected[strategy]}  # the strategy really ran
    for m in (got, replayed):
        np.testing.assert_allclose(np.asarray(m["geometry"]["omega"]), omega_ref, atol=1e-4)
        np.testing.assert_allclose(np.asarray(m["geometry"]["theta"]), theta_ref, atol=1e-4)
        np.testing.assert_allclose(
            np.asarray(m["geometry"]["omega"]), np.asarray(meta["geometry"]["omega"]), atol=1e-4
        )


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_session_memory_follows_the_budget(
    family: dict[str, Any], budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over budget, a generation's session holds no tensor with a per-source hidden axis:
    its buffers are C_MLP ``[B, S]`` and the max-norms ``[B, S, H]`` per layer; within
    budget it keeps ``u`` (``[B, H, S, D]`` per layer) and gives the same numbers."""
    monkeypatch.setattr(capture_module, "CACHE_BUDGET_BYTES", budget)
    model = family["model"]
    spec = model._spec
    sessions: list[Any] = []
    real = capture_module.CaptureSession.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        sessions.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capture_module.CaptureSession, "__init__", spy)
        got = model.invoke(PROMPT).response_metadata
    assert got["token_ids"] == family["meta"]["token_ids"]
    np.testing.assert_allclose(
        np.asarray(got["geometry"]["omega"]),
        np.asarray(family["meta"]["geometry"]["omega"]),
        atol=1e-5,
    )
    assert sessions
    heads = spec.layers[0].num_heads
    for s in sessions:
        assert s.cached == (budget > 0)
        extra = spec.hidden_size * heads if budget > 0 else 0
        bound = spec.num_layers * s.batch_size * s.max_len * (heads + 1 + extra)
        weights = ("_wo_kv",)  # per layer, not per position: W_O regrouped (the model's)
        tensors = [
            t
            for name, v in vars(s).items()
            if name not in weights
            for t in (v if isinstance(v, list) else [v])
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        # numbers held: each storage once (per-layer lists may be views of one stacked tensor)
        storages = {t.untyped_storage().data_ptr(): t for t in tensors}
        held = sum(t.untyped_storage().nbytes() // t.element_size() for t in storages.values())
        assert held <= bound, (held, bound)
        assert held >= spec.num_layers * s.batch_size * s.max_len  # C_MLP at least: counted


def test_sparse_sessions_share_the_models_regrouped_w_o(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sparse strategy reads W_O in query-head order (float32): one copy per model,
    shared by every session. A copy per session cost L·H·Dh·D float32 per concurrent row
    (2.4 GB per row of an 8B model: batch 32 at 2,048 tokens took 80 GiB over plain on a
    GPU, issue 38)."""
    monkeypatch.setattr(capture_module, "DEFAULT_STRATEGY", "sparse")
    model = tiny_chat_model("llama", seed=3, max_new_tokens=4)
    spec = model._spec
    sessions: list[Any] = []
    real = capture_module.CaptureSession.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        sessions.append(self)

    monkeypatch.setattr(capture_module.CaptureSession, "__init__", spy)
    model.invoke(PROMPT)
    shared = [spec.wo_by_query_head(i) for i in range(spec.num_layers)]
    model.invoke("Another question, a little longer than the first one?")
    assert len(sessions) >= 2
    for i, w in enumerate(shared):
        assert spec.wo_by_query_head(i) is w  # computed once
        kv = spec.wo_by_kv_head()[i]
        assert torch.equal(w, heads_by_query(kv, spec.layers[i].num_heads))
    model_storages = {w.untyped_storage().data_ptr() for w in shared}
    model_storages |= {w.untyped_storage().data_ptr() for w in spec.wo_by_kv_head()}
    width = spec.layers[0].num_heads * spec.layers[0].head_dim * spec.hidden_size
    for s in sessions:
        own = [
            t
            for v in vars(s).values()
            for t in (v if isinstance(v, list) else [v])
            if isinstance(t, torch.Tensor) and t.numel() == width
        ]
        assert all(t.untyped_storage().data_ptr() in model_storages for t in own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["sparse", "dense"])
def test_a_model_too_large_to_keep_w_o_regroups_it_per_use_with_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, strategy: str
) -> None:
    """Above ``WO_KEEP_SHARE`` of the weights (a bfloat16 8B model's float32 copies of W_O
    would be 4.8 GB, a 70B one's 43 GB) capture regroups a layer's W_O per use: nothing
    kept, same answer bit for bit (the cast to float32 is exact)."""
    monkeypatch.setattr(capture_module, "DEFAULT_STRATEGY", strategy)
    kept = tiny_chat_model("qwen3", seed=3, dtype=dtype, max_new_tokens=6)
    want = kept.invoke(PROMPT).response_metadata
    assert kept._spec.keeps_wo
    monkeypatch.setattr(architectures, "WO_KEEP_SHARE", 0.0)
    monkeypatch.setattr(architectures, "WO_KEEP_MIN_BYTES", 0)
    monkeypatch.setattr(architectures, "WO_KEEP_DEVICE_TYPES", ())  # as on a GPU
    model = tiny_chat_model("qwen3", seed=3, dtype=dtype, max_new_tokens=6)
    got = model.invoke(PROMPT).response_metadata
    spec = model._spec
    assert not spec.keeps_wo and spec._wo_kv is None and not spec._wo_q
    for key in ("token_ids", "logprobs", "geometry"):
        assert got[key] == want[key], key


@pytest.fixture(scope="module")
def means() -> ReferenceMeans:
    rng = np.random.default_rng(0)
    arrays = {
        k: rng.normal(size=(3, 32))
        for k in ("post_attn_in", "post_mlp_in", "post_attn_out", "post_mlp_out")
    }
    return ReferenceMeans(**arrays)


@pytest.mark.parametrize("fam", FAMILIES)
def test_fast_capture_matches_full_where_defined(fam: str, means: ReferenceMeans) -> None:
    full = tiny_chat_model(fam, seed=3, max_new_tokens=10).with_reference(means)
    fast = full.model_copy(update={"capture": "fast"})
    fast._shared = full._shared
    a = full.invoke(PROMPT).response_metadata
    b = fast.invoke(PROMPT).response_metadata
    assert b["token_ids"] == a["token_ids"]
    assert a["geometry"]["capture"] == "full" and b["geometry"]["capture"] == "fast"
    assert b["geometry"]["omega"] is None
    full_omega = np.asarray(a["geometry"]["omega"])
    np.testing.assert_allclose(
        np.asarray(b["geometry"]["omega_dir"]), full_omega[:, 0::2], atol=1e-5
    )
    for key in ("theta", "phi_in", "phi_out"):
        np.testing.assert_allclose(
            np.asarray(b["geometry"][key]), np.asarray(a["geometry"][key]), atol=1e-5
        )
    replayed = fast.replay(PROMPT, b["token_ids"]).metadata["geometry"]
    assert replayed["capture"] == "fast" and replayed["omega"] is None
    np.testing.assert_allclose(np.asarray(replayed["omega_dir"]), full_omega[:, 0::2], atol=1e-4)
    np.testing.assert_allclose(
        np.asarray(replayed["theta"]), np.asarray(a["geometry"]["theta"]), atol=1e-4
    )


def test_capture_mode_is_checked_by_the_metadata_reader() -> None:
    model = tiny_chat_model("llama", seed=3, max_new_tokens=6)
    fast = model.model_copy(update={"capture": "fast"})
    fast._shared = model._shared
    full_msg, fast_msg = model.invoke(PROMPT), fast.invoke(PROMPT)
    assert ResponseMetadata.of(full_msg).capture_mode() == "full"
    assert ResponseMetadata.of(fast_msg).capture_mode() == "fast"
    with pytest.raises(CaptureModeError, match="capture='fast'"):
        ResponseMetadata.of(fast_msg).geometry(capture="full")
    with pytest.raises(CaptureModeError, match="capture='full'"):
        ResponseMetadata.of(full_msg).geometry(capture="fast")
    ResponseMetadata.of(full_msg).geometry(capture="full")
    legacy = dict(full_msg.response_metadata)
    legacy["geometry"] = {k: v for k, v in legacy["geometry"].items() if k != "capture"}
    assert ResponseMetadata.of(legacy).capture_mode() == "full"


def test_geometry_scorer_features_refuse_fast_capture() -> None:
    from abstain_guard.scorers import token_block

    model = tiny_chat_model("qwen2", seed=3, max_new_tokens=6)
    fast = model.model_copy(update={"capture": "fast"})
    fast._shared = model._shared
    with pytest.raises(CaptureModeError):
        token_block(fast.invoke(PROMPT), None)


def test_unknown_capture_mode_is_refused() -> None:
    with pytest.raises(ValueError):
        tiny_chat_model("llama", capture="approximate")
    model = tiny_chat_model("llama")
    with pytest.raises(InvalidInputError):
        capture_module.CaptureSession(model._spec, batch_size=1, max_len=4, capture="x")
