"""Calibration without replay (issue 14, part 4), on the tiny random-weight Llama.

The geometry scorer's inputs are captured while generating: the reference split with its
per-token states (cached as arrays beside the run cache), the other splits with Φ online from
the fitted means. Checked here: captured features = replayed features of the same ids; the
calibration scores are what the deployed guard computes live; a killed geometry run resumes
byte-identically without generating anything twice; a cache without captured geometry is
replayed instead of regenerated; the arrays are checksummed like rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import ITEMS, HashJudge, _artifact_files, _config, _judges
from pydantic import Field
from tiny_models import char_tokenizer, tiny_chat_model, tiny_hf_model

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.adapters import GeometryChatModel
from abstain_guard.adapters.engine.scheduler import GenerationScheduler
from abstain_guard.calibration.building.answering.answer_rows import (
    STATES_NS,
    GenerationOptions,
    means_digest,
)
from abstain_guard.calibration.building.answering.answers import (
    PIPELINED_CHUNKS,
    chunks_in_flight,
    generate_answers,
    generated_pairs,
)
from abstain_guard.calibration.building.answering.online_geometry import (
    fit_reference_means,
    reference_responses,
)
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.run.store import RunStore
from abstain_guard.errors import CacheError
from abstain_guard.guard.chains import load_guard_chain
from abstain_guard.scorers import token_block

#: Captured (KV-cached generation) vs replayed (one teacher-forced pass) features of the
#: same token ids: angles in radians, proximities in [0, 1]; float32 forward passes.
FEATURE_ATOL = 1e-5


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_chat_model("llama", seed=0)


class CountingChatModel(GeometryChatModel):
    """Counts the answers it generates: with states, batched, one by one (its copies made
    by ``with_reference`` count into the same lists)."""

    calls: dict[str, list[int]] = Field(
        default_factory=lambda: {"states": [], "batch": [], "single": []}
    )

    def generate_with_states(self, inputs: Any, **kwargs: Any) -> Any:
        self.calls["states"].append(len(inputs))
        return super().generate_with_states(inputs, **kwargs)

    def batch(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls["batch"].append(len(inputs))
        return super().batch(inputs, *args, **kwargs)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["single"].append(1)
        return super()._generate(*args, **kwargs)

    def with_reference(self, means: Any) -> Any:
        clone = super().with_reference(means)
        clone.calls = self.calls
        return clone

    def generated(self) -> int:
        return sum(sum(v) for v in self.calls.values())


def _counting() -> CountingChatModel:
    model = CountingChatModel.from_hf(tiny_hf_model("llama", 0), char_tokenizer())
    model.model_name = tiny_chat_model("llama", seed=0).model_name
    # one engine, so the chunks in flight at a kill (PIPELINED_CHUNKS per engine) do not
    # depend on the machine's CPUs
    model._s.scheduler = GenerationScheduler(model._s, workers=1)
    assert model.engine_workers() == 1
    return model


def _geo_config(tmp: Path, name: str) -> Any:
    return _config(tmp, name, scorer="geometry").model_copy(
        update={"scorer_params": {"covariance": "oas"}}
    )


def _max_diff(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, np.float64))))


def test_captured_features_equal_replayed_features(tmp_path: Path, model: Any) -> None:
    cfg = _config(tmp_path, "cap")
    store = RunStore(tmp_path / "run.sqlite")
    fp = model.fingerprint
    reference, train, held_out = ITEMS[:16], ITEMS[16:32], ITEMS[32:40]
    ref = generate_answers(
        model, reference, store, cfg, fingerprint=fp, options=GenerationOptions(capture="states")
    )
    labels = {it.id: {"correct": i % 2 == 0} for i, it in enumerate(reference)}
    means = fit_reference_means(reference, ref, labels, store)

    # reference answers: Ω, Θ and the states captured while generating = replay's
    replayed = model.replay_batch(
        generated_pairs(reference, ref, cfg), batch_size=1, return_states=True
    )
    diffs: dict[str, float] = {}
    for it, res in zip(reference, replayed, strict=True):
        arrays = store.get_arrays(STATES_NS, ref[it.id]["key"])
        assert arrays is not None
        for name in ("omega", "theta"):
            diffs[name] = max(
                diffs.get(name, 0.0), _max_diff(arrays[name], res.metadata["geometry"][name])
            )
        for name in ("post_attn", "post_mlp"):
            assert res.states is not None
            scale = float(np.abs(getattr(res.states, name)).max())
            rel = _max_diff(arrays[name], getattr(res.states, name)) / scale
            diffs[name] = max(diffs.get(name, 0.0), rel)
    # the reference token vectors the scorer fits on: states-from-cache = states-from-replay
    for ours, theirs in zip(
        reference_responses(reference, ref, store, means), replayed, strict=True
    ):
        diffs["reference_nu"] = max(
            diffs.get("reference_nu", 0.0),
            _max_diff(token_block(ours, means).geometry, token_block(theirs, means).geometry),
        )

    # train (batched) and held-out (one per call) answers: Φ online = replay with the means
    scoring = model.with_reference(means)
    for items, size in ((train, None), (held_out, 1)):
        got = generate_answers(
            model,
            items,
            store,
            cfg,
            fingerprint=fp,
            options=GenerationOptions(batch_size=size, capture="geometry", reference=means),
        )
        assert all(got[it.id]["reference"] == means_digest(means) for it in items)
        again = scoring.replay_batch(generated_pairs(items, got, cfg), batch_size=1)
        for it, res in zip(items, again, strict=True):
            mine = token_block(got[it.id]["metadata"], means)
            theirs = token_block(res.metadata, means)
            assert mine.geometry.shape == theirs.geometry.shape
            diffs["nu"] = max(diffs.get("nu", 0.0), _max_diff(mine.geometry, theirs.geometry))
            diffs["logprob"] = max(
                diffs.get("logprob", 0.0), _max_diff(mine.logprob, theirs.logprob)
            )
    print("capture vs replay, max abs difference:", diffs)
    assert all(np.isfinite(v) for v in diffs.values())
    assert max(diffs.values()) <= FEATURE_ATOL, diffs


def test_calibration_scores_are_the_guards_live_scores(tmp_path: Path, model: Any) -> None:
    cfg = _geo_config(tmp_path, "live")
    calibrate(
        ITEMS,
        tmp_path / "live",
        config=cfg,
        model=model,
        judges=_judges(tmp_path, "live", HashJudge()),
        progress=False,
    )
    art = GuardArtifact.load(tmp_path / "live")
    chain, _, _ = load_guard_chain(tmp_path / "live", GuardConfig(participation=0.5), model=model)
    by_id = {it.id: it for it in ITEMS}
    live = []
    for item_id in art.metadata["calibration_ids"]:
        msg = chain.invoke({"question": by_id[item_id].question})
        live.append(msg.response_metadata["abstention"]["score"])
    # generated exactly as the guard generates, with the same means: the same numbers
    np.testing.assert_allclose(live, art.scores, rtol=0, atol=1e-6)
    print("live - stored, max abs:", float(np.max(np.abs(np.asarray(live) - art.scores))))


def test_geometry_run_killed_twice_resumes_byte_identically(tmp_path: Path, model: Any) -> None:
    calibrate(
        ITEMS,
        tmp_path / "ref",
        config=_geo_config(tmp_path, "ref"),
        model=model,
        judges=_judges(tmp_path, "ref", HashJudge()),
        progress=False,
    )
    cfg = _geo_config(tmp_path, "run")
    counting = _counting()
    assert counting.fingerprint == model.fingerprint

    def kill_at(n: int) -> Any:
        def kill(chunk: int) -> None:
            if chunk == n:
                raise KeyboardInterrupt("simulated kill while generating")

        return kill

    # 1) killed in the reference split (4 chunks of 8), after its second chunk was stored
    with pytest.raises(KeyboardInterrupt):
        calibrate(
            ITEMS,
            tmp_path / "run",
            config=cfg,
            model=counting,
            judges=_judges(tmp_path, "run", HashJudge()),
            progress=False,
            on_generation_chunk=kill_at(2),
        )
    # the third chunk was in flight (PIPELINED_CHUNKS = 2, one engine): generated, not stored
    assert PIPELINED_CHUNKS == 2
    assert counting.calls["states"] == [8, 8, 8]
    # 2) killed in the train split (3 chunks), after its first chunk: only the missing
    # reference chunks were generated again, none replayed
    with pytest.raises(KeyboardInterrupt):
        calibrate(
            ITEMS,
            tmp_path / "run",
            config=cfg,
            model=counting,
            judges=_judges(tmp_path, "run", HashJudge()),
            progress=False,
            on_generation_chunk=kill_at(1),
        )
    # (chunks in flight together enter the model in thread order, not submission order: each
    # phase's chunk sizes are compared as a multiset, the phases in order)
    assert counting.calls["states"][:3] == [8, 8, 8]
    assert sorted(counting.calls["states"][3:]) == [6, 8]
    assert counting.calls["batch"] == [8, 8]
    # 3) to the end
    calibrate(
        ITEMS,
        tmp_path / "run",
        config=cfg,
        model=counting,
        judges=_judges(tmp_path, "run", HashJudge()),
        progress=False,
    )
    # nothing generated twice but the chunk in flight at each kill
    assert counting.generated() == len(ITEMS) + 8 + 8
    # train in chunks of 8, then the 12 held-out questions in chunks sharing decode steps
    # (the default decode path: each answer bitwise its solo one), none generated alone
    batch = counting.calls["batch"]
    assert batch[:2] == [8, 8] and not counting.calls["single"]
    assert sorted(batch[2:4]) == [2, 8] and sorted(batch[4:]) == [4, 8]
    assert _artifact_files(tmp_path / "ref") == _artifact_files(tmp_path / "run")


def test_cache_without_captured_geometry_is_replayed_not_regenerated(
    tmp_path: Path, model: Any
) -> None:
    # a perplexity run writes every answer without geometry (as an older version did)
    cfg = _config(tmp_path, "old")
    calibrate(
        ITEMS,
        tmp_path / "ppl",
        config=cfg,
        model=model,
        judges=_judges(tmp_path, "old", HashJudge()),
        progress=False,
    )
    counting = _counting()
    geo = cfg.model_copy(update={"scorer": "geometry", "scorer_params": {"covariance": "oas"}})
    calibrate(
        ITEMS,
        tmp_path / "geo",
        config=geo,
        model=counting,
        judges=_judges(tmp_path, "old", HashJudge()),
        progress=False,
    )
    assert counting.generated() == 0
    # the same answers captured while generating: the same scores up to capture-vs-replay
    calibrate(
        ITEMS,
        tmp_path / "fresh",
        config=_geo_config(tmp_path, "fresh"),
        model=model,
        judges=_judges(tmp_path, "fresh", HashJudge()),
        progress=False,
    )
    replayed, captured = (
        GuardArtifact.load(tmp_path / "geo"),
        GuardArtifact.load(tmp_path / "fresh"),
    )
    np.testing.assert_array_equal(replayed.correct, captured.correct)
    np.testing.assert_allclose(replayed.scores, captured.scores, rtol=0, atol=1e-3)


def test_arrays_beside_the_cache_are_checksummed(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run.sqlite")
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2)}
    store.put_arrays("states", "k1", arrays)
    got = store.get_arrays("states", "k1")
    assert got is not None and set(got) == {"a", "b"}
    np.testing.assert_array_equal(got["a"], arrays["a"])
    assert got["a"].dtype == np.float32
    assert store.get_arrays("states", "absent") is None
    assert store.has_arrays("states", ["k1", "absent"]) == {"k1"}
    path = store.arrays_dir / "states" / "k1.npz"
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="checksum"):
        store.get_arrays("states", "k1")
    path.unlink()  # deleted to save space: absent, recomputed by the next run
    assert store.get_arrays("states", "k1") is None
    assert store.has_arrays("states", ["k1"]) == set()


def test_chunks_in_flight_keep_every_engine_full() -> None:
    assert chunks_in_flight(True, 8, 8, 1) == PIPELINED_CHUNKS
    assert chunks_in_flight(True, 16, 8, 2) == PIPELINED_CHUNKS * 2 * 2
    assert chunks_in_flight(True, 4, 8, 2) == PIPELINED_CHUNKS * 2  # a chunk fills a step
    assert chunks_in_flight(False, 16, 8, 2) == 2  # rows alone: one chunk per engine
    assert chunks_in_flight(False, 16, 8, 0) == 1
