"""The deployed guard scores exactly what calibration stored (tiny random-weight model).

Calibrate on a file, then run the guard chain as deployed (``load_guard_chain``: recorded
prompt, budget, decoding; one question per call) on the artifact's held-out questions:
same tokens, same scores, same decisions, same participation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import ITEMS, HashJudge, _config, _judges
from tiny_models import tiny_chat_model

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.measure.deployment_check import live_check
from abstain_guard.calibration.measure.held_out import artifact_items
from abstain_guard.errors import DatasetError


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_chat_model("llama", seed=0)


def _write(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in items), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory, model: Any) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("live")
    data = _write(
        tmp / "questions.jsonl",
        [{"id": it.id, "question": it.question, "answer": it.answers[0]} for it in ITEMS],
    )
    cfg = _config(tmp, "geo", scorer="geometry").model_copy(
        update={"scorer_params": {"covariance": "oas"}}
    )
    calibrate(
        str(data),
        tmp / "geo",
        config=cfg,
        model=model,
        judges=_judges(tmp, "geo", HashJudge()),
        progress=False,
    )
    return tmp, data


@pytest.mark.parametrize("participation", [0.5, 0.8])
def test_live_scores_equal_stored_scores(
    calibrated: tuple[Path, Path], model: Any, participation: float
) -> None:
    tmp, _ = calibrated
    art = GuardArtifact.load(tmp / "geo")
    result = live_check(
        tmp / "geo",
        guard_config=GuardConfig(participation=participation),
        model=model,
        judges=_judges(tmp, "geo", HashJudge()),
        progress=False,
    )
    rows = result["rows"]
    assert [r["id"] for r in rows] == art.metadata["calibration_ids"] + art.metadata["test_ids"]
    assert all(r["same_tokens"] for r in rows)
    live = np.array([r["live_score"] for r in rows])
    stored = np.array([r["stored_score"] for r in rows])
    np.testing.assert_allclose(live, stored, rtol=0, atol=1e-6)
    # the calibration rows are compared with the artifact's own stored scores
    np.testing.assert_allclose(live[: art.n], art.scores, rtol=0, atol=1e-6)
    summary = result["summary"]
    assert summary["same_decision"] == 1.0
    assert summary["participation_live"] == summary["participation_stored"]
    # on the calibration questions themselves, live participation is the calibrated one
    cal = [not r["abstained"] for r in rows if r["split"] == "calibration"]
    tau = result["threshold"]
    assert np.mean(cal) == np.mean(art.scores <= tau)


def test_live_check_on_the_test_split_only(calibrated: tuple[Path, Path], model: Any) -> None:
    tmp, _ = calibrated
    art = GuardArtifact.load(tmp / "geo")
    result = live_check(
        tmp / "geo",
        guard_config=GuardConfig(participation=0.5),
        model=model,
        judges=_judges(tmp, "geo", HashJudge()),
        progress=False,
        split="test",
    )
    assert [r["id"] for r in result["rows"]] == art.metadata["test_ids"]
    assert {r["split"] for r in result["rows"]} == {"test"}
    summary = result["summary"]
    answered = [r for r in result["rows"] if not r["abstained"]]
    if answered:
        wrong = sum(not r["correct"] for r in answered) / len(answered)
        assert summary["error_when_answered_live"] == pytest.approx(wrong)


def test_evaluation_uses_the_artifacts_ids_and_refuses_changed_data(
    calibrated: tuple[Path, Path], tmp_path: Path
) -> None:
    tmp, _ = calibrated
    art = GuardArtifact.load(tmp / "geo")
    _, held, _ = artifact_items(art)
    assert [it.id for it in held] == art.metadata["calibration_ids"] + art.metadata["test_ids"]

    changed = _write(
        tmp_path / "questions.jsonl",
        [{"id": it.id, "question": it.question + "?", "answer": "x"} for it in ITEMS],
    )
    meta = {**art.metadata, "data": str(changed)}
    moved = GuardArtifact(
        art.scorer,
        CalibrationSet(art.scores, art.correct),
        model_fingerprint=art.model_fingerprint,
        metadata=meta,
    )
    with pytest.raises(DatasetError, match="changed since"):
        artifact_items(moved)

    fewer = _write(
        tmp_path / "fewer.jsonl",
        [{"id": it.id, "question": it.question, "answer": "x"} for it in ITEMS[:10]],
    )
    meta = {**art.metadata, "data": str(fewer), "items_sha256": None}
    gone = GuardArtifact(
        art.scorer,
        CalibrationSet(art.scores, art.correct),
        model_fingerprint=art.model_fingerprint,
        metadata=meta,
    )
    with pytest.raises(DatasetError, match="not in"):
        artifact_items(gone)


def test_a_recalibrated_artifact_is_refused_with_what_to_run_instead(tmp_path: Path) -> None:
    """A guard recalibrated from feedback has live decisions, not held-out questions, as its
    calibration set: the live check says so before loading anything (it raised a bare
    ValueError from zip(strict=True) on the missing calibration ids before)."""
    from abstain_guard.errors import ConfigError
    from abstain_guard.scorers import PerplexityScorer

    rng = np.random.default_rng(0)
    art = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(rng.uniform(1, 3, 50), rng.uniform(size=50) > 0.5),
        metadata={"recalibrated_from": {"artifact": "runs/old-guard"}, "config": {}},
    )
    art.save(tmp_path / "new")
    with pytest.raises(ConfigError, match="recalibrated from live feedback") as info:
        live_check(tmp_path / "new", model=object())
    assert "evaluate --live --artifact runs/old-guard" in str(info.value)
