"""``calibrate --scorer probe_*`` on the tiny random-weight Llama (issue 37): the probe is
fitted on the reference and train answers captured while generating, and the calibration
scores it stores are the deployed guard's live scores; ``evaluate --baselines`` fits the
probes and the type floor on the artifact's reference + train answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import ITEMS, HashJudge, _config, _judges
from tiny_models import tiny_chat_model

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.measure.evaluate import EvaluateOptions, evaluate
from abstain_guard.contract.runnables import map_chat_models
from abstain_guard.guard.chains import load_guard_chain


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_chat_model("llama", seed=0)


@pytest.mark.parametrize("scorer", ["probe_concat", "probe_mid", "likelihood_probe"])
def test_probe_calibration_scores_are_live_scores(tmp_path: Path, model: Any, scorer: str) -> None:
    """Calibrated on a full-capture model, deployed through the artifact's chain: the model
    in the chain generates in fast capture (``ProbeScorerBase.capture``), and every
    calibration answer scores live bitwise as stored."""
    cfg = _config(tmp_path, "probe", scorer=scorer).model_copy(
        update={"scorer_params": {"cv_folds": 2}}
    )
    calibrate(
        ITEMS,
        tmp_path / "probe",
        config=cfg,
        model=model,
        judges=_judges(tmp_path, "probe", HashJudge()),
        progress=False,
    )
    art = GuardArtifact.load(tmp_path / "probe")
    assert art.scorer.kind == scorer
    chain, guard, _ = load_guard_chain(
        tmp_path / "probe", GuardConfig(participation=0.5), model=model
    )
    modes: list[str] = []
    map_chat_models(guard.bound_runnable, lambda m: modes.append(m.capture) or m)
    assert modes == ["fast"]
    assert model.capture == "full"  # the caller's model is not changed
    by_id = {it.id: it for it in ITEMS}
    live = [
        chain.invoke({"question": by_id[i].question}).response_metadata["abstention"]["score"]
        for i in art.metadata["calibration_ids"]
    ]
    assert np.array_equal(np.asarray(live), art.scores)


def test_evaluate_fits_the_probes_and_the_floor(tmp_path: Path, model: Any) -> None:
    data = tmp_path / "questions.jsonl"
    rows = [
        {"id": it.id, "question": it.question, "answer": it.answers[0], "g": it.group}
        for it in ITEMS
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = _config(tmp_path, "geo", scorer="geometry").model_copy(
        update={
            "scorer_params": {"covariance": "oas"},
            "group_by": "g",
            "risk_target": 0.4,
            "delta": 0.2,
        }
    )
    judges = _judges(tmp_path, "geo", HashJudge())
    calibrate(str(data), tmp_path / "geo", config=cfg, model=model, judges=judges, progress=False)
    res = evaluate(
        tmp_path / "geo",
        tmp_path / "report",
        options=EvaluateOptions(
            baselines="probe_mid,probe_concat_last,type_floor,perplexity,geometry_plus",
            n_resplits=5,
            cache_dir=tmp_path / "geo.cache",
        ),
        progress=False,
        model=model,
        judges=judges,
    )
    [entry] = res["datasets"].values() if isinstance(res["datasets"], dict) else res["datasets"]
    paired = entry["paired"]["scorers"]
    assert {"geometry", "probe_mid", "probe_concat_last", "type_floor", "perplexity"} <= set(paired)
    assert "auroc_diff_ci" in paired["probe_mid"] and "auroc_diff" not in paired["geometry"]
    assert "within_auroc" in paired["type_floor"]  # ITEMS have two types
    assert paired["type_floor"]["within_auroc"] == pytest.approx(0.5)
    assert entry["costs"]["probe_mid"]["seconds_per_answer"] > 0
    assert entry["costs"]["probe_mid"]["state_bytes"] > 0
    assert "auroc_diff_ci" in paired["geometry_plus"]  # refitted with the artifact's means
    # every scorer is certified at the artifact's own target, not a default one
    for name in ("geometry", "probe_mid", "perplexity"):
        certified = paired[name]["certified"]
        assert (certified["risk_target"], certified["delta"]) == (0.4, 0.2)
    # issue 46: every comparison's p-value, Holm-adjusted over the report, in results.json
    stored = json.loads((tmp_path / "report" / "results.json").read_text(encoding="utf-8"))
    [saved] = stored["datasets"].values()
    assert saved["paired"]["family"]["size"] >= 4 and saved["paired"]["family"]["method"] == "holm"
    for name in ("probe_mid", "perplexity", "geometry_plus"):
        p = saved["paired"]["scorers"][name]
        assert 0 < p["auroc_diff_p"] <= p["auroc_diff_holm_p"] <= 1
        assert p["auroc_diff_verdict"] in {
            "reference better",
            "baseline better",
            "not significant after Holm at family-wise 0.05",
        }
    # issue 57: six scorers and perplexity calibrated on train read the calibration answers:
    # the ledger counts the seven in K
    names = saved["ledger"]["names"]
    assert names[0] == "geometry" and len(set(names)) == 7
    reloaded = GuardArtifact.load(tmp_path / "geo")
    assert reloaded.n_candidates == saved["ledger"]["n_candidates"] == 7
    assert saved["frontier"]["candidates"] == 7
