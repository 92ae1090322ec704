"""geometry_fast: the paper's geometry scorer on fast-capture features (ω_dir, Θ, Φ).

Checked: the fast token vector's layout; a fast-capture response and a full-capture response
of the same answer give the same features and the same score (synthetic, and on the tiny
random-weight models of every family: fast capture = the ω_dir columns of full capture,
bitwise); the scorer reads ω_dir and ignores ω_prop; its state round trip; ``prepare`` runs
the model in fast capture; a geometry_fast calibration generates its held-out answers with
fast capture and stores the scores the deployed guard computes live.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _capture_reference import PROMPT
from _geometry_fakes import _npz_round_trip, _split
from _pipeline_fakes import ITEMS, HashJudge, _config, _judges
from tiny_models import FAMILIES, tiny_chat_model

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.adapters import ReferenceMeans, ReplayResult
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.measure import metrics
from abstain_guard.calibration.measure.permutation_importance import permutation_importance
from abstain_guard.contract.metadata import ResponseMetadata
from abstain_guard.errors import CaptureModeError, ScoringError
from abstain_guard.guard.chains import load_guard_chain
from abstain_guard.scorers import (
    ScorerState,
    family_slices,
    feature_width,
    layers_of_width,
    scorer_from_state,
    scorer_spec,
    token_block,
    with_capture,
)
from abstain_guard.scorers.geometry import GeometryScorer

L = 3
K = 2 * L - 1

Labeled = list[tuple[ReplayResult, bool]]


def _fast_twin(response: ReplayResult) -> ReplayResult:
    """The response as fast capture reports it: ``omega`` None, ``omega_dir`` = the ω_dir
    (even) columns of Ω, the capture marker "fast"; states and everything else unchanged."""
    meta = json.loads(json.dumps(response.metadata))
    omega = np.asarray(meta["geometry"]["omega"])
    meta["geometry"].update(capture="fast", omega=None, omega_dir=omega[:, 0::2].tolist())
    return ReplayResult(metadata=meta, states=response.states)


def _shift_columns(data: Labeled, columns: slice, seed: int) -> Labeled:
    """``data`` (classes differing in every Ω column) with the Ω columns outside ``columns``
    redrawn from one distribution for both classes: only ``columns`` carry the signal."""
    rng = np.random.default_rng(seed)
    out = []
    for r, c in data:
        omega = np.asarray(r.metadata["geometry"]["omega"])
        keep = np.zeros(K, dtype=bool)
        keep[columns] = True
        omega[:, ~keep] = rng.uniform(0, 1, size=(omega.shape[0], int((~keep).sum())))
        meta = json.loads(json.dumps(r.metadata))
        meta["geometry"]["omega"] = omega.tolist()
        out.append((ReplayResult(metadata=meta, states=r.states), c))
    return out


@pytest.fixture(scope="module")
def fitted() -> tuple[GeometryScorer, Labeled]:
    scorer = GeometryScorer(capture="fast", num_boost_round=100)
    scorer.fit(_split(1, 60, "omega"), _split(2, 60, "omega"))
    return scorer, _split(3, 40, "omega")


# --- layout and registry ---------------------------------------------------------------


def test_fast_layout_is_omega_dir_then_theta_and_phi() -> None:
    slices = family_slices(L, "fast")
    assert [(s.start, s.stop) for s in slices.values()] == [(0, 3), (3, 8), (8, 13), (13, 18)]
    assert feature_width(L, "fast") == 7 * L - 3 and feature_width(L) == 8 * L - 4
    assert layers_of_width(18, "fast") == 3 and layers_of_width(20) == 3
    assert layers_of_width(20, "fast") is None
    r = _split(0, 1, "omega")[0][0]
    means = ReferenceMeans.from_states([r.states], [r.states])
    full, fast = token_block(r, means), token_block(r, means, capture="fast")
    assert fast.geometry.shape == (full.geometry.shape[0], 7 * L - 3)
    omega = np.asarray(r.metadata["geometry"]["omega"])
    np.testing.assert_array_equal(fast.geometry[:, :L], omega[:, 0::2])
    np.testing.assert_array_equal(fast.geometry[:, L:], full.geometry[:, K:])


def test_registered_as_a_fitted_geometry_scorer() -> None:
    spec = scorer_spec("geometry_fast")
    assert spec.family == "geometry" and spec.fitted
    assert spec.cls is GeometryScorer and spec.params == {"capture": "fast"}
    assert GeometryScorer(capture="fast").capture == "fast" and GeometryScorer().capture == "full"


# --- scoring ---------------------------------------------------------------------------


def test_fast_and_full_responses_of_one_answer_score_identically(fitted: Any) -> None:
    scorer, data = fitted
    full = [r for r, _ in data]
    fast = [_fast_twin(r) for r in full]
    assert ResponseMetadata.of(fast[0].metadata).capture_mode() == "fast"
    np.testing.assert_array_equal(scorer.score_many(fast), scorer.score_many(full))
    assert [scorer.score(r) for r in fast] == [scorer.score(r) for r in full]


def test_the_full_scorer_still_refuses_fast_responses(fitted: Any) -> None:
    _, data = fitted
    full_scorer = GeometryScorer(num_boost_round=20).fit(
        _split(1, 30, "omega"), _split(2, 30, "omega")
    )
    with pytest.raises(CaptureModeError):
        full_scorer.score(_fast_twin(data[0][0]))


def test_reads_omega_dir_and_ignores_omega_prop() -> None:
    def auroc(columns: slice) -> float:
        ref, train, test = (_shift_columns(_split(s, 80, "omega"), columns, s) for s in (1, 2, 3))
        fast = GeometryScorer(capture="fast", num_boost_round=100).fit(ref, train)
        return metrics.auroc(fast.score_many([r for r, _ in test]), [c for _, c in test])

    dir_only, prop_only = auroc(slice(0, K, 2)), auroc(slice(1, K, 2))
    print("geometry_fast AUROC, signal in omega_dir only:", dir_only, "omega_prop only:", prop_only)
    assert dir_only > 0.85
    assert abs(prop_only - 0.5) < 0.15


def test_width_of_another_model_is_a_typed_error(fitted: Any) -> None:
    scorer, _ = fitted
    scorer_wide = GeometryScorer.from_state(scorer.get_state())
    scorer_wide.num_layers_ = L + 1
    with pytest.raises(ScoringError, match="width"):
        scorer_wide.score(_split(5, 1, "omega")[0][0])


@pytest.mark.parametrize("variant", ["paper", "raw"])
def test_state_round_trip(variant: str) -> None:
    scorer = GeometryScorer(capture="fast", variant=variant, num_boost_round=50)  # type: ignore[arg-type]
    scorer.fit(_split(1, 40, "omega"), _split(2, 40, "omega"))
    state = scorer.get_state()
    assert state.kind == "geometry_fast"
    loaded = scorer_from_state(
        ScorerState(
            kind=state.kind,
            params=json.loads(json.dumps(state.params)),
            arrays=_npz_round_trip(state.arrays),
            files={k: bytes(v) for k, v in state.files.items()},
        )
    )
    assert type(loaded) is GeometryScorer and loaded.capture == "fast"
    data = [_fast_twin(r) for r, _ in _split(3, 10, "omega")]
    np.testing.assert_array_equal(loaded.score_many(data), scorer.score_many(data))


# --- on the tiny random-weight models ---------------------------------------------------


def _random_means(model: Any, seed: int) -> ReferenceMeans:
    rng = np.random.default_rng(seed)
    shape = (model.num_layers, model.hf_model.config.hidden_size)
    names = ("post_attn_in", "post_mlp_in", "post_attn_out", "post_mlp_out")
    return ReferenceMeans(**{k: rng.normal(size=shape) for k in names})


@pytest.mark.parametrize("fam", FAMILIES)
def test_fast_capture_features_equal_the_fast_subset_of_full_capture(fam: str) -> None:
    full = tiny_chat_model(fam, seed=3, max_new_tokens=10)
    means = _random_means(full, 0)
    full = full.with_reference(means)
    fast = with_capture(full, "fast")
    a, b = full.invoke(PROMPT), fast.invoke(PROMPT)
    assert ResponseMetadata.of(b).capture_mode() == "fast"
    assert a.response_metadata["token_ids"] == b.response_metadata["token_ids"]
    from_full = token_block(a, means, capture="fast")
    from_fast = token_block(b, means, capture="fast")
    np.testing.assert_array_equal(from_fast.geometry, from_full.geometry)
    np.testing.assert_array_equal(from_fast.logprob, from_full.logprob)


def test_prepare_runs_every_chat_model_in_fast_capture(fitted: Any) -> None:
    model = tiny_chat_model("llama", seed=0)
    scorer = GeometryScorer.from_state(fitted[0].get_state())  # the fixture stays as is
    scorer.reference_means_ = _random_means(model, 1)
    prepared = scorer.prepare(model)
    assert prepared.capture == "fast" and model.capture == "full"
    assert prepared.reference is scorer.reference_means_
    assert prepared.hf_model is model.hf_model
    bound = scorer.prepare(model.bind(max_new_tokens=4))
    assert bound.bound.capture == "fast"
    meta = prepared.invoke(PROMPT).response_metadata
    assert meta["geometry"]["capture"] == "fast" and meta["geometry"]["phi_in"] is not None


def test_calibration_stores_the_scores_the_fast_guard_computes_live(tmp_path: Path) -> None:
    model = tiny_chat_model("llama", seed=0)
    cfg = _config(tmp_path, "fast", scorer="geometry_fast").model_copy(
        update={"scorer_params": {"covariance": "oas"}}
    )
    calibrate(
        ITEMS,
        tmp_path / "fast",
        config=cfg,
        model=model,
        judges=_judges(tmp_path, "fast", HashJudge()),
        progress=False,
    )
    art = GuardArtifact.load(tmp_path / "fast")
    assert art.scorer.kind == "geometry_fast"
    # train and held-out answers were generated with fast capture (reference: full, states)
    with sqlite3.connect(tmp_path / "fast.cache" / "run.sqlite") as conn:
        rows = [
            json.loads(v)
            for (v,) in conn.execute("SELECT value FROM kv WHERE ns = ?", ("generation",))
        ]
    modes = [((r.get("metadata") or {}).get("geometry") or {}).get("capture") for r in rows]
    split = art.metadata["split_sizes"]
    assert modes.count("fast") == split["train"] + split["calibration"] + split["test"]
    assert modes.count(None) == split["reference"]

    # deployed as load_guard_chain deploys it, from the full-capture model
    chain, guard, _ = load_guard_chain(
        tmp_path / "fast", GuardConfig(participation=0.5), model=model
    )
    assert guard.bound_runnable.bound.capture == "fast"
    by_id = {it.id: it for it in ITEMS}
    live = [
        chain.invoke({"question": by_id[i].question}).response_metadata["abstention"]["score"]
        for i in art.metadata["calibration_ids"]
    ]
    print(
        "geometry_fast live - stored, max abs:",
        float(np.max(np.abs(np.asarray(live) - art.scores))),
    )
    np.testing.assert_array_equal(np.asarray(live), art.scores)


def test_permutation_importance_uses_the_fast_layout(fitted: Any) -> None:
    scorer, data = fitted
    imp = permutation_importance(scorer, [r for r, _ in data], [c for _, c in data], n_repeats=3)
    assert imp.drops["omega"]["auroc_mean"] > 0.2
    for fam in ("theta", "phi_in", "phi_out"):
        assert abs(imp.drops[fam]["auroc_mean"]) < 0.1


@pytest.mark.model
def test_real_model_fast_guard_answers_like_full_capture(default_model: Any) -> None:
    """On the embedded model: the prepared (fast-capture) model gives the same tokens as full
    capture, and its fast features equal the full ones' ω_dir/Θ/Φ columns to float32
    rounding, so the two captures score an answer alike."""
    from langchain_core.messages import HumanMessage, SystemMessage

    items = [
        ([SystemMessage("Answer in a few words."), HumanMessage(q)], a)
        for q, a in (
            ("What is the capital of France?", "Paris"),
            ("What is the capital of Japan?", "Tokyo"),
            ("What is the capital of France?", "Lyon"),
            ("What is the capital of Japan?", "Osaka"),
        )
    ]
    replays = default_model.replay_batch(items, return_states=True)
    pairs = list(zip(replays, [True, True, False, False], strict=True))
    scorer = GeometryScorer(capture="fast", num_boost_round=10).fit(pairs, pairs)
    fast = scorer.prepare(default_model)
    full = default_model.with_reference(scorer.reference_means_)
    assert fast.capture == "fast" and full.capture == "full"
    a = full.invoke(items[0][0], max_new_tokens=8)
    b = fast.invoke(items[0][0], max_new_tokens=8)
    assert a.response_metadata["token_ids"] == b.response_metadata["token_ids"]
    from_full = token_block(a, scorer.reference_means_, capture="fast").geometry
    from_fast = token_block(b, scorer.reference_means_, capture="fast").geometry
    diff = float(np.max(np.abs(from_full - from_fast)))
    print("real model, fast vs full capture features, max abs difference:", diff)
    assert diff <= 1e-4
    assert scorer.score(b) == pytest.approx(scorer.score(a), abs=1e-3)
