"""The demo's decision rules and closing table (no model: the shipped artifact's stored
calibration scores decide which risk target the demo can lead with)."""

from __future__ import annotations

import pytest
from statsmodels.stats.proportion import proportion_confint

from abstain_guard import GuardArtifact, GuardConfig, default_artifact_path
from abstain_guard.calibration.measure.demo import (
    RISK_TARGET,
    _risk_reading,
    error_interval,
    risk_config,
    summary_table,
)
from abstain_guard.guarantee.frontier import smallest_certifiable_risk
from abstain_guard.guarantee.selection import per_candidate_delta


def test_demo_leads_with_the_risk_target_the_shipped_guard_certifies():
    art = GuardArtifact.load(default_artifact_path())
    cfg = risk_config(art, RISK_TARGET, 0.1)
    assert (cfg.mode, cfg.risk_target, cfg.delta) == ("risk", RISK_TARGET, 0.1)
    rule = art.decision_rule(cfg)
    answered = float((art.scores <= rule.threshold).mean())
    assert answered >= 0.2, "ε = 0.35 should certify useful participation on the shipped guard"


def test_an_uncertifiable_target_falls_back_to_the_smallest_certified_one(capsys):
    art = GuardArtifact.load(default_artifact_path())
    cfg = risk_config(art, 0.01, 0.1)
    # the shipped scorer was chosen among several: every target is certified at δ/K
    per_candidate = per_candidate_delta(0.1, art.n_candidates)
    assert cfg.risk_target == smallest_certifiable_risk(art.scores, art.correct, per_candidate)
    assert cfg.risk_target is not None and cfg.risk_target > 0.01
    assert "does not certify risk_target=0.01" in capsys.readouterr().out
    art.decision_rule(cfg)  # certifiable: no error


def test_summary_table_has_risk_participation_and_no_guard_rows():
    summary = {
        "asked": 96,
        "risk": {
            "answered": 6,
            "correct_when_answered": 4,
            "error_when_answered": 1 / 3,
            "error_interval": error_interval(2, 6),
            "target": "error ≤ 0.35 (δ 0.1)",
        },
        "participation": {
            "answered": 0,
            "correct_when_answered": 0,
            "error_when_answered": None,
            "error_interval": None,
            "target": "answer 80.0–80.1 %",
        },
        "correct_overall": 6,
    }
    header, risk, part, bare = summary_table(summary)
    assert header.split()[:2] == ["mode", "answered"] and "95 % CI" in header
    # 2 wrong of 6: Clopper–Pearson [0.043, 0.777]
    assert risk.split()[:5] == ["risk", "6/96", "2/6", "0.33", "[0.04,"]
    assert "0.78]" in risk and "error ≤ 0.35" in risk
    assert part.split()[:3] == ["participation", "0/96", "n/a"]
    assert bare.startswith("without guard") and "90/96 0.94 [" in bare


def test_the_error_interval_is_the_exact_binomial_one():

    for wrong, n in [(0, 5), (2, 6), (11, 42), (42, 42)]:
        low, high = proportion_confint(wrong, n, alpha=0.05, method="beta")
        assert error_interval(wrong, n) == pytest.approx([low, high], abs=1e-12)
    assert error_interval(0, 0) is None


def test_the_demo_reads_its_risk_row_against_epsilon_with_the_interval():
    below = {"risk_target": 0.35, "error_when_answered": 0.1, "error_interval": [0.02, 0.3]}
    covers = {"risk_target": 0.35, "error_when_answered": 0.26, "error_interval": [0.14, 0.42]}
    assert "lies below ε = 0.35" in _risk_reading(below)
    assert "covers ε = 0.35" in _risk_reading(covers)
    assert "answered nothing" in _risk_reading({"risk_target": 0.35, "error_interval": None})


def test_default_participation_config_is_what_the_demo_shows_second():
    art = GuardArtifact.load(default_artifact_path())
    rule = art.decision_rule(GuardConfig())
    assert rule.mode == "participation" and rule.target == 0.8
