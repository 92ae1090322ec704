"""``abstain-guard plan``: the label plan on the command line, as the library computes it."""

from __future__ import annotations

import json

import pytest

from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.cli import main
from abstain_guard.default import default_artifact_path
from abstain_guard.guarantee.planning import PlanScenario, label_plan


def test_the_json_is_the_librarys_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--risk-target", "0.3", "--accuracy", "0.6", "--auroc", "0.8"]
    assert main([*argv, "--sizes", "100", "400", "--draws", "20", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = label_plan(PlanScenario(0.3, 0.1, 0.6, 0.8), (100, 400), draws=20).to_dict()
    assert got == json.loads(json.dumps(want))


def test_an_artifacts_scores_are_resampled(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(default_artifact_path())
    argv = ["plan", "--risk-target", "0.35", "--artifact", path, "--sizes", "300"]
    assert main([*argv, "--draws", "10", "--participation", "0.2"]) == 0
    out = capsys.readouterr().out
    artifact = GuardArtifact.load(path)
    plan = label_plan(
        PlanScenario(0.35, 0.1, float(artifact.correct.mean()), source=path),
        (300,),
        draws=10,
        stored=(artifact.scores, artifact.correct),
    )
    assert f"{plan.rows[0].median:8.1%}" in out and "for a median participation of 20%" in out


def test_the_scorer_quality_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--risk-target", "0.3"])
    assert "--auroc" in capsys.readouterr().err
