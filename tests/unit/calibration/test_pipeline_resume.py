"""calibrate() end to end on a tiny random-weight model: artifact, guard, kill and resume.

The tiny model answers with random characters, so a deterministic content-hash judge stands
in for a real one (a real Judge subclass, cached like any other).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import ITEMS, HashJudge, _artifact_files, _config, _judges
from pydantic import Field
from tiny_models import char_tokenizer, tiny_chat_model, tiny_hf_model

from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
from abstain_guard.adapters import GeometryChatModel
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.errors import ArtifactMismatchError
from abstain_guard.guard.chains import load_guard_chain


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_chat_model("llama", seed=0)


class CountingChatModel(GeometryChatModel):
    """Counts ``batch`` calls (their sizes) and single generations (``_generate``, the
    LangChain extension point every chat model implements)."""

    batch_sizes: list[int] = Field(default_factory=list)
    single_calls: int = 0

    def batch(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.batch_sizes.append(len(inputs))
        return super().batch(inputs, *args, **kwargs)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        self.single_calls += 1
        return super()._generate(*args, **kwargs)


def test_calibrate_writes_an_artifact_the_guard_uses(tmp_path: Path, model: Any) -> None:
    summary = calibrate(
        ITEMS,
        tmp_path / "guard",
        config=_config(tmp_path, "guard"),
        model=model,
        judges=_judges(tmp_path, "guard", HashJudge()),
        progress=False,
    )
    assert summary.split_sizes == {"reference": 30, "train": 18, "calibration": 6, "test": 6}
    art = GuardArtifact.load(tmp_path / "guard", expected_fingerprint=model.fingerprint)
    assert art.scores.shape == (6,)
    assert np.all(np.isfinite(art.scores))
    assert art.metadata["split_sizes"]["calibration"] == 6
    assert len(art.metadata["test_ids"]) == 6
    record = art.metadata["deployment"]
    assert record["model_fingerprint"] == model.fingerprint
    assert record["prompts"] == {
        "open": {"system_prompt": "Answer.", "max_new_tokens": 6, "rendering": "{question}"}
    }
    chain, _, _ = load_guard_chain(tmp_path / "guard", GuardConfig(participation=0.5), model=model)
    msg = chain.invoke({"question": "What is item 3?"})
    info = msg.response_metadata["abstention"]
    assert info["scorer"] == "perplexity"
    assert info["abstained"] == (info["score"] > info["threshold"])
    # prompted or budgeted otherwise than at calibration: a typed error, not a silent guess
    guard = AbstentionGuard(model, artifact=art, config=GuardConfig(participation=0.5))
    with pytest.raises(ArtifactMismatchError, match="system prompt"):
        guard.invoke("What is item 3?")
    with pytest.raises(ArtifactMismatchError, match="max_new_tokens=7"):
        guard.invoke([("system", "Answer."), ("human", "What is item 3?")], max_new_tokens=7)


def test_kill_and_resume_gives_the_same_artifact(tmp_path: Path, model: Any) -> None:
    # uninterrupted reference run
    calibrate(
        ITEMS,
        tmp_path / "ref",
        config=_config(tmp_path, "ref"),
        model=model,
        judges=_judges(tmp_path, "ref", HashJudge()),
        progress=False,
    )

    # 1) killed during generation, after the third chunk was stored
    def kill(chunk: int) -> None:
        if chunk == 3:
            raise KeyboardInterrupt("simulated kill while generating")

    cfg = _config(tmp_path, "run")
    first_judge = HashJudge()
    with pytest.raises(KeyboardInterrupt):
        calibrate(
            ITEMS,
            tmp_path / "run",
            config=cfg,
            model=model,
            judges=_judges(tmp_path, "run", first_judge),
            progress=False,
            on_generation_chunk=kill,
        )
    assert first_judge.calls == 0
    assert not (tmp_path / "run").exists()

    # 2) killed during judging, after 25 verdicts; a model that counts its calls (the same
    # weights, so the same fingerprint and answers) shows what was generated again
    counting = CountingChatModel.from_hf(tiny_hf_model("llama", 0), char_tokenizer())
    counting.model_name = model.model_name
    assert counting.fingerprint == model.fingerprint
    second_judge = HashJudge(fail_after=25)
    with pytest.raises(KeyboardInterrupt):
        calibrate(
            ITEMS,
            tmp_path / "run",
            config=cfg,
            model=counting,
            judges=_judges(tmp_path, "run", second_judge),
            progress=False,
        )
    calls, singles = counting.batch_sizes, counting.single_calls
    # only the chunks not finished before the kill were generated again: 3 of the 6 batched
    # reference/train chunks were done; the 12 held-out questions go to the scheduler in
    # chunks that share decode steps (the default decode path; each answer bitwise its solo)
    assert sum(calls) == 48 - 3 * 8 + 12
    assert singles == 0
    assert second_judge.calls == 25

    # 3) resumed to the end: only the remaining verdicts are requested
    third_judge = HashJudge()
    calibrate(
        ITEMS,
        tmp_path / "run",
        config=cfg,
        model=model,
        judges=_judges(tmp_path, "run", third_judge),
        progress=False,
    )
    assert third_judge.calls == len(ITEMS) - 25

    ref, run = GuardArtifact.load(tmp_path / "ref"), GuardArtifact.load(tmp_path / "run")
    np.testing.assert_array_equal(ref.scores, run.scores)
    np.testing.assert_array_equal(ref.correct, run.correct)
    assert _artifact_files(tmp_path / "ref") == _artifact_files(tmp_path / "run")
    # nothing generated twice: one cached answer per question
    summary = json.loads((tmp_path / "run.cache" / "summary.json").read_text())
    assert summary["n_items"] == len(ITEMS)


def test_geometry_scorer_end_to_end_on_tiny_model(tmp_path: Path, model: Any) -> None:
    cfg = _config(tmp_path, "geo", scorer="geometry").model_copy(
        update={"scorer_params": {"covariance": "oas"}}
    )
    calibrate(
        ITEMS,
        tmp_path / "geo",
        config=cfg,
        model=model,
        judges=_judges(tmp_path, "geo", HashJudge()),
        progress=False,
    )
    art = GuardArtifact.load(tmp_path / "geo")
    assert art.scorer.kind == "geometry"
    chain, _, _ = load_guard_chain(tmp_path / "geo", GuardConfig(participation=0.5), model=model)
    msg = chain.invoke({"question": "What is item 7?"})
    info = msg.response_metadata["abstention"]
    assert info["error"] is None, info
    assert np.isfinite(info["score"])
