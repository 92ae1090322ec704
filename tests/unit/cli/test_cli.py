"""The command line: errors before model loading, and merging reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _results import evaluate_scores

from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.building import pipeline
from abstain_guard.calibration.measure.results import MeasureSettings
from abstain_guard.cli import main


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the CLI loaded a model")

    monkeypatch.setattr(pipeline, "load_model", fail)


def test_calibrate_missing_data_is_a_clear_error(tmp_path: Path, capsys) -> None:
    code = main(["calibrate", "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_calibrate_unknown_judge_is_a_clear_error(tmp_path: Path, capsys) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"Q{i}?", "answer": f"a{i}"}) + "\n" for i in range(100))
    )
    code = main(["calibrate", "--data", str(data), "--out", str(tmp_path / "g"), "--judge", "x"])
    assert code == 2
    assert "lexical" in capsys.readouterr().err


def test_report_merges_results(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    paths = []
    for name in ("alpha", "beta"):
        correct = rng.random(80) < 0.4
        scores = {"s": rng.random(80) + (~correct) * 0.5}
        doc = evaluate_scores(scores, correct, name=name, settings=MeasureSettings(n_resplits=50))
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc, default=float))
        paths.append(str(path))
    assert main(["report", "--results", *paths, "--out", str(tmp_path / "rep")]) == 0
    merged = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert set(merged["datasets"]) == {"alpha", "beta"}
    assert 0.5 < merged["datasets"]["alpha"]["scorers"]["s"]["auroc"] <= 1.0
    assert "alpha" in (tmp_path / "rep" / "report.md").read_text()


def test_evaluate_without_live_refuses_an_agent_artifact(tmp_path: Path, capsys) -> None:
    from abstain_guard import GuardArtifact
    from abstain_guard.contract.deployment import AgentRecord, DeploymentRecord, PromptRecord
    from abstain_guard.scorers import PerplexityScorer

    record = DeploymentRecord(
        prompts={"open": PromptRecord(system_prompt=None, max_new_tokens=48)},
        agent=AgentRecord(factory="examples.lookup_agent:build_agent", step_limit=8),
    )
    rng = np.random.default_rng(0)
    GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(rng.uniform(size=20), rng.uniform(size=20) > 0.5),
        metadata={"deployment": record.to_json()},
    ).save(tmp_path / "agent")
    code = main(["evaluate", "--artifact", str(tmp_path / "agent"), "--out", str(tmp_path / "r")])
    assert code == 2
    assert "evaluate --live" in capsys.readouterr().err
