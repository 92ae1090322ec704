"""Hidden-state probes, likelihood + probe, the type-only floor (issue 37) and the paired
comparison of scorers: synthetic response metadata, no model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.calibration.measure.baselines import TypeFloor, parse_baselines
from abstain_guard.calibration.measure.paired import paired_report, selective_risk
from abstain_guard.default import default_artifact_path
from abstain_guard.errors import InvalidInputError, NotFittedError, ScoringError
from abstain_guard.scorers import (
    HiddenStateProbe,
    ScorerState,
    build_scorer,
    scorer_names,
    scorer_spec,
)
from abstain_guard.scorers._registry import scorer_from_state

D = 12
PROBES = (
    "probe_mid",
    "probe_upper",
    "probe_concat",
    "probe_mid_last",
    "probe_upper_last",
    "probe_concat_last",
)


def _response(rng: np.random.Generator, correct: bool, group: str | None = None) -> dict:
    """Correct answers lean along the first axis of the upper layer's mean state."""
    n = int(rng.integers(2, 6))
    mean = rng.normal(size=(2, D))
    last = rng.normal(size=(2, D))
    shift = 1.5 if correct else -1.5
    mean[1, 0] += shift
    last[1, 0] += shift
    mean[0, 1] += shift / 2
    last[0, 1] += shift / 2
    lp = rng.normal(-0.5 if correct else -1.5, 0.3, size=n).clip(max=-1e-3)
    meta: dict[str, Any] = {
        "token_ids": list(range(n)),
        "logprobs": {"content": [{"token": "x", "logprob": float(v)} for v in lp]},
        "entropy": rng.uniform(0.1, 2.0, size=n).tolist(),
        "geometry": {
            "omega": [],
            "hidden": {"layers": [1, 2], "mean": mean.tolist(), "last": last.tolist()},
        },
    }
    meta["question_group"] = group  # as evaluate sets it (None: no type)
    return meta


def _split(seed: int, n: int, groups: bool = False) -> list[tuple[dict, bool]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        correct = bool(rng.random() < 0.4)
        group = ("easy" if i % 2 else "hard") if groups else None
        out.append((_response(rng, correct, group), correct))
    return out


@pytest.mark.parametrize("kind", [*PROBES, "likelihood_probe"])
def test_probe_separates_and_round_trips(kind: str, tmp_path: Path) -> None:
    scorer = build_scorer(kind).fit(_split(1, 60), _split(2, 60))  # type: ignore[attr-defined]
    test = _split(3, 80)
    data = [r for r, _ in test]
    scores = scorer.score_many(data)
    assert np.all((scores > 0) & (scores < 1))
    y = np.array([c for _, c in test])
    assert roc_auc_score(y, -scores) > 0.75
    # one at a time: bitwise the batch's scores (live = stored)
    assert np.array_equal(np.array([scorer.score(r) for r in data]), scores)
    state = scorer.get_state()
    assert state.kind == kind and not state.files
    loaded = scorer_from_state(
        ScorerState(state.kind, json.loads(json.dumps(state.params)), dict(state.arrays))
    )
    assert np.array_equal(loaded.score_many(data), scores)
    art = GuardArtifact.from_calibration(scorer=scorer, calibration=CalibrationSet(scores, y))
    art.save(tmp_path / "guard")
    assert np.array_equal(GuardArtifact.load(tmp_path / "guard").scorer.score_many(data), scores)


def test_probe_errors() -> None:
    scorer = build_scorer("probe_concat")
    with pytest.raises(NotFittedError):
        scorer.score(_split(0, 1)[0][0])
    no_hidden = {"logprobs": {"content": [{"token": "a", "logprob": -1.0}]}, "geometry": {}}
    with pytest.raises(ScoringError, match="hidden-state summary"):
        scorer.fit([(no_hidden, True)] * 6, [(no_hidden, False)] * 6)  # type: ignore[attr-defined]
    fitted = build_scorer("probe_upper").fit(_split(1, 40), _split(2, 40))  # type: ignore[attr-defined]
    with pytest.raises(ScoringError, match="hidden-state summary"):
        fitted.score(no_hidden)
    wrong_kind = fitted.get_state()
    wrong_kind.kind = "probe_mid"
    with pytest.raises(Exception, match="reads layer"):
        scorer_from_state(wrong_kind)


def test_one_probe_class_its_presets_are_the_stored_kinds() -> None:
    """The six probe kinds are presets of one class: its layer and token summary."""
    assert set(HiddenStateProbe.presets) == set(PROBES)
    for kind in PROBES:
        scorer = build_scorer(kind)
        assert type(scorer) is HiddenStateProbe and scorer.kind == kind
        assert (scorer.layer, scorer.summary) == (
            kind.split("_")[1],
            "last" if kind.endswith("_last") else "mean",
        )
    assert HiddenStateProbe(layer="upper", summary="last").kind == "probe_upper_last"
    with pytest.raises(InvalidInputError, match="layer"):
        HiddenStateProbe(layer="lower")  # type: ignore[arg-type]
    shipped = GuardArtifact.load(default_artifact_path()).scorer
    assert isinstance(shipped, HiddenStateProbe) and shipped.kind == "probe_mid"


def test_type_floor() -> None:
    ref, train = _split(1, 40, groups=True), _split(2, 40, groups=True)
    floor = TypeFloor().fit(ref, train)
    counts = {"easy": [0, 0], "hard": [0, 0]}
    for r, c in [*ref, *train]:
        counts[r["question_group"]][0] += int(c)
        counts[r["question_group"]][1] += 1
    for g, (c, n) in counts.items():
        assert floor.score({"question_group": g}) == pytest.approx(1 - (c + 1) / (n + 2))
    overall = sum(c for c, _ in counts.values()) / 80
    assert floor.score({"question_group": "unseen"}) == pytest.approx(1 - overall)
    with pytest.raises(ScoringError, match="measuring floor"):
        floor.score({"logprobs": {}})
    state = floor.get_state()
    assert state.kind == "type_floor" and state.params["accuracy"] == floor.accuracy_
    untyped = TypeFloor().fit(_split(1, 20), [])
    assert len({untyped.score(r) for r, _ in _split(5, 10)}) == 1  # one constant: AUROC 0.5


def test_registry_and_evaluate_accept_them() -> None:
    probes = scorer_names(family="probe")
    assert set(PROBES) | {"likelihood_probe"} == set(probes)
    assert all("probe" in k for k in probes)
    assert all(scorer_spec(k).fitted and scorer_spec(k).reads >= {"hidden"} for k in probes)
    # the type floor is a measuring floor of evaluate, not a scorer an artifact can hold
    assert "type_floor" not in scorer_names()
    assert parse_baselines("probe_concat,type_floor,perplexity") == [
        "probe_concat",
        "type_floor",
        "perplexity",
    ]
    assert {"type_floor", "probe_mid", "likelihood_probe"} <= set(parse_baselines("probes"))


def test_calibrate_can_deploy_probes() -> None:
    from abstain_guard.calibration.building.answering.online_geometry import captures_geometry
    from abstain_guard.calibration.building.run.calibration_config import (
        FIT_SCORERS,
        CalibrationConfig,
    )

    assert "probe_concat" in FIT_SCORERS and "type_floor" not in FIT_SCORERS
    assert CalibrationConfig(scorer="probe_upper").scorer == "probe_upper"
    assert captures_geometry(build_scorer("probe_upper"))


def test_paired_report() -> None:
    rng = np.random.default_rng(0)
    y = rng.random(300) < 0.3
    good = -y.astype(float) + rng.normal(0, 0.5, 300)
    bad = rng.normal(size=300)
    groups = np.where(np.arange(300) % 3 == 0, "a", "b")
    rep = paired_report(
        {"geometry": good, "other": bad},
        y,
        reference="geometry",
        groups=groups.tolist(),
        calibration=np.arange(300) < 150,
        n_boot=300,
    )
    other = rep["scorers"]["other"]
    assert "auroc_diff" not in rep["scorers"]["geometry"]
    lo, hi = other["auroc_diff_ci"]
    assert lo <= other["auroc_diff"] <= hi and lo > 0
    assert other["within_diff_ci"][0] > 0 and rep["n_groups_used"] == 2
    cert = rep["scorers"]["geometry"]["certified"]
    assert cert["n"] == 150 and 0 <= cert["participation_at_target"] <= 1
    sel = selective_risk(np.arange(4.0), np.array([1, 1, 0, 0]))
    assert sel["error_at"]["0.5"] == 0.0 and sel["aurc"] == pytest.approx((0 + 0 + 1 / 3 + 0.5) / 4)
