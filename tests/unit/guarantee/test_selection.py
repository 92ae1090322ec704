"""Choosing the scorer among K candidates on the calibration answers keeps δ (issue 46):
every candidate certified at δ/K (:mod:`abstain_guard.guarantee.selection`), the artifact records a
``selection`` block, and a guard loaded from it certifies at δ/K — the shipped default guard
included (``probe_mid`` chosen among 13 scorers, 7 more looks in its ledger: K = 20)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _selection_fakes import _artifact, _recorded

from abstain_guard import GuardArtifact, GuardConfig, default_artifact_path
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.errors import (
    ArtifactSchemaError,
    ConfigError,
    InvalidInputError,
    UncertifiableTargetError,
)
from abstain_guard.guarantee import conformal
from abstain_guard.guarantee.frontier import frontier_document, smallest_certifiable_risk
from abstain_guard.guarantee.ledger import parse_ledger
from abstain_guard.guarantee.selection import (
    ScorerSelection,
    participation_lower_bound,
    per_candidate_delta,
    record_choice,
    select_scorer,
)

ROOT = Path(__file__).resolve().parents[3]

SHIPPED_CANDIDATES = (
    "geometry",
    "geometry_plus",
    "probe_mid",
    "probe_upper",
    "probe_concat",
    "probe_mid_last",
    "probe_upper_last",
    "probe_concat_last",
    "likelihood_probe",
    "type_floor",
    "perplexity",
    "max_sequence_probability",
    "mean_token_entropy",
)


def _risk(scores: Any, correct: Any, eps: float, delta: float, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        return conformal.risk_threshold(scores, correct, eps, delta, **kw)


# --- the rule -----------------------------------------------------------------------------


def test_the_chosen_threshold_is_the_chosen_candidate_certified_alone_at_delta_over_k() -> None:
    rng = np.random.default_rng(3)
    n = 600
    correct = rng.random(n) < 0.6
    # three scorers of different quality: noise added to the label
    scores = {
        name: np.where(correct, 0.0, 1.0) + rng.normal(0, sd, n)
        for name, sd in (("weak", 2.0), ("good", 0.6), ("mid", 1.0))
    }
    sel = select_scorer(scores, correct, 0.25, 0.1, data="synthetic")
    assert sel.candidates == ("weak", "good", "mid")
    assert sel.delta_per_candidate == pytest.approx(0.1 / 3)
    for name, cert in sel.certificates.items():
        alone = _risk(scores[name], correct, 0.25, 0.1 / 3)
        assert cert.rank == alone.rank and cert.participation == alone.participation
        assert cert.threshold == (alone.threshold if alone.feasible else None)
    best = max(sel.certificates.values(), key=lambda c: c.participation)
    assert sel.chosen == best.name == "good"
    alone = _risk(scores["good"], correct, 0.25, 0.1 / 3)
    assert sel.certificates["good"].threshold == alone.threshold
    # and it is stricter than certifying the chosen one at the full delta
    assert alone.rank < _risk(scores["good"], correct, 0.25, 0.1).rank


def test_a_hand_computed_selection() -> None:
    """ε = 0.2, δ = 0.1, K = 4, the original fixed-sequence chain. Sorted by score,
    candidate a answers 15 right then 25 wrong, b 20 right then 20 wrong, c and d the
    reverse orders. At δ/4 = 0.025 the chain starts at rank 1 + ⌈log 0.025 / log 0.8⌉ = 18:
    a's rank 18 has 2 errors among the 17 below, P(Bin(17, .2) ≤ 2) = 0.31 > 0.025, so a
    certifies nothing; b passes ranks 18–21 with no error below and fails at rank 22,
    P(Bin(21, .2) ≤ 1) = 0.8^21 + 21·0.2·0.8^20 = 0.058 > 0.025: b certifies rank 21
    (participation 21/40, one error among them). Certified alone at δ = 0.1 (start 12), a
    would reach rank 16 (rank 17: P(Bin(16, .2) ≤ 1) = 0.141 > 0.1) and b rank 22
    (rank 22: 0.058 ≤ 0.1; rank 23: P(Bin(22, .2) ≤ 2) = 0.155 > 0.1)."""
    scores = np.arange(40, dtype=np.float64)
    correct = np.arange(40) < 20  # answers 0-19 right, 20-39 wrong
    # a's k-th smallest score is on answer perm_a[k]: 15 right, 20 wrong, 5 right
    perm_a = np.concatenate([np.arange(15), np.arange(20, 40), np.arange(15, 20)])
    ranked = {"a": np.empty(40), "b": scores.copy(), "c": scores[::-1].copy(), "d": np.empty(40)}
    ranked["a"][perm_a] = scores
    ranked["d"][perm_a[::-1]] = scores
    assert list(correct[perm_a][:16]) == [True] * 15 + [False]
    sel = select_scorer(ranked, correct, 0.2, 0.1, data="hand", method="fixed_sequence")
    certs = sel.certificates
    assert not certs["a"].feasible and not certs["c"].feasible and not certs["d"].feasible
    assert (certs["b"].rank, certs["b"].participation) == (21, 21 / 40)
    assert certs["b"].threshold == 20.0 and certs["b"].empirical_risk == pytest.approx(1 / 21)
    assert sel.chosen == "b"
    # without the selection accounted for (each at δ) the numbers would have been larger
    assert _risk(ranked["a"], correct, 0.2, 0.1, method="fixed_sequence").rank == 16
    assert _risk(ranked["b"], correct, 0.2, 0.1, method="fixed_sequence").rank == 22


def test_choosing_the_best_of_k_at_delta_breaks_it_and_delta_over_k_keeps_it() -> None:
    """Simulation: the error rate is 0.31 everywhere, so any certificate of ε = 0.3 is
    wrong. Ten candidates of pure noise; choosing the best certified at δ = 0.1 each ships a
    false certificate far more often than δ, the δ/K rule at most δ."""
    rng = np.random.default_rng(0)
    k, n, eps, delta, trials = 10, 200, 0.3, 0.1, 400
    naive = kept = 0
    for _ in range(trials):
        correct = rng.random(n) >= 0.31
        scores = {f"s{i}": rng.random(n) for i in range(k)}
        sel = select_scorer(scores, correct, eps, delta, data="sim")
        kept += sel.certificates[sel.chosen].feasible
        naive += any(_risk(s, correct, eps, delta).feasible for s in scores.values())
    assert kept / trials <= delta
    assert naive / trials > 2 * delta


def test_per_candidate_delta_and_the_participation_bound() -> None:
    assert per_candidate_delta(0.1, 13) == pytest.approx(0.1 / 13)
    with pytest.raises(InvalidInputError):
        per_candidate_delta(0.1, 0)
    # the Beta(k, n+1-k) quantile: a looser level gives a larger bound, rank > n answers all
    assert participation_lower_bound(81, 100, 0.01) < participation_lower_bound(81, 100, 0.1)
    assert participation_lower_bound(101, 100, 0.1) == 1.0
    # Monte Carlo: the participation given the calibration set is Beta(k, n+1-k)
    rng = np.random.default_rng(1)
    covered = np.sort(rng.random((20000, 100)), axis=1)[:, 80]  # τ = 81st of 100 uniforms
    below = np.mean(covered < participation_lower_bound(81, 100, 0.05))
    assert below == pytest.approx(0.05, abs=0.01)


def test_a_selection_block_round_trips_and_rejects_nonsense() -> None:
    rng = np.random.default_rng(2)
    correct = rng.random(300) < 0.5
    scores = {"x": rng.random(300), "y": np.where(correct, 0.2, 0.8) + rng.random(300)}
    sel = select_scorer(scores, correct, 0.3, 0.1, data="d")
    block = json.loads(json.dumps(sel.to_json()))
    assert ScorerSelection.from_json(block) == sel
    assert block["delta_per_candidate"] == pytest.approx(0.05) and block["rule"] == "bonferroni"
    for bad in (
        {**block, "chosen": "z"},
        {**block, "rule": "holm"},
        {**block, "delta_per_candidate": 0.1},
        {k: v for k, v in block.items() if k != "candidates"},
    ):
        with pytest.raises(InvalidInputError):
            ScorerSelection.from_json(bad)


# --- the artifact and the guard -------------------------------------------------------------


def test_a_guard_from_a_selected_artifact_certifies_at_delta_over_k(tmp_path: Path) -> None:
    plain = _artifact(None)
    sel = _recorded(plain)
    art = _artifact(sel)
    art.save(tmp_path / "guard")
    loaded = GuardArtifact.load(tmp_path / "guard")
    assert loaded.selection == sel and loaded.n_candidates == 5
    cfg = GuardConfig(mode="risk", risk_target=0.3, delta=0.1)
    rule = loaded.decision_rule(cfg)
    alone = _risk(art.scores, art.correct, 0.3, 0.1 / 5)
    assert rule.threshold == alone.threshold == sel.certificates["perplexity"].threshold
    assert rule.threshold < plain.decision_rule(cfg).threshold
    g = rule.guarantee
    assert g.delta == 0.1 and g.confidence == 0.9
    assert g.delta_per_candidate == pytest.approx(0.02)
    assert g.selection["n_candidates"] == 5 and g.selection["rule"] == "bonferroni"
    assert "chosen among 5 candidates" in g.statement and "accounted for" in g.statement
    # any other delta a deployment asks for is divided by K too
    other = loaded.decision_rule(cfg.with_overrides(delta=0.2))
    assert other.threshold == _risk(art.scores, art.correct, 0.3, 0.2 / 5).threshold
    # participation mode: same threshold, plus the PAC bound accounting for the choice
    part = loaded.decision_rule(GuardConfig(participation=0.8))
    assert part.threshold == plain.decision_rule(GuardConfig(participation=0.8)).threshold
    bound = part.guarantee.selection["participation_lower_bound"]
    assert bound == pytest.approx(participation_lower_bound(part.guarantee.rank, 800, 0.02))
    # the paper's correctness bound is not adjusted for the choice, and says so
    chosen = part.guarantee.selection
    assert chosen["correctness_bound_adjusted"] is False
    assert "not adjusted for the choice" in chosen["statement"]
    # groups: each group's rule at its delta / K as well
    rules = loaded.group_rules(cfg.with_overrides(group_by="g"))
    for name in ("even", "odd"):
        mask = loaded.groups == name
        own = _risk(art.scores[mask], art.correct[mask], 0.3, 0.1 / 5)
        assert rules.rules[name].threshold == own.threshold


def test_an_uncertifiable_target_names_the_smallest_at_delta_over_k() -> None:
    plain = _artifact(None)
    art = _artifact(_recorded(plain, k=20))
    smallest = smallest_certifiable_risk(art.scores, art.correct, 0.1 / 20)
    assert smallest is not None and smallest > smallest_certifiable_risk(
        art.scores, art.correct, 0.1
    )
    with pytest.raises(UncertifiableTargetError, match="per candidate") as info:
        art.decision_rule(GuardConfig(mode="risk", risk_target=smallest - 0.01))
    assert info.value.smallest_risk_target == smallest
    doc = frontier_document(art.scores, art.correct, candidates=art.n_candidates)
    assert doc["smallest"]["0.1"] == smallest and doc["candidates"] == 20


def test_a_selection_block_that_does_not_fit_the_artifact_is_refused(tmp_path: Path) -> None:
    plain = _artifact(None)
    wrong_n = _recorded(_artifact(None, n=500))
    with pytest.raises(InvalidInputError, match="500 calibration answers"):
        _artifact(wrong_n)
    other = record_choice(
        "geometry", plain.scores, plain.correct, ["geometry", "perplexity"], 0.3, 0.1,
        data="cal", choice="x",
    )  # fmt: skip
    with pytest.raises(InvalidInputError, match="chose 'geometry'"):
        _artifact(other)
    # on disk: a hand-edited block is a schema error at load
    _artifact(_recorded(plain)).save(tmp_path / "guard")
    manifest = json.loads((tmp_path / "guard" / "manifest.json").read_text())
    manifest["metadata"]["selection"]["chosen"] = "other1"
    from abstain_guard.artifact.files import canonical_json, sha256_hex

    manifest.pop("manifest_sha256")
    manifest["manifest_sha256"] = sha256_hex(canonical_json(manifest))
    (tmp_path / "guard" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactSchemaError, match="chose 'other1'"):
        GuardArtifact.load(tmp_path / "guard")


# --- the calibration config ------------------------------------------------------------------


def test_the_calibration_config_takes_auto_and_candidates() -> None:
    cfg = CalibrationConfig(scorer="auto", candidates="perplexity, geometry", risk_target=0.3)
    assert cfg.selects and cfg.candidates == ("perplexity", "geometry")
    assert cfg.for_candidate("geometry").scorer == "geometry"
    named = CalibrationConfig(scorer="probe_mid", candidates=SHIPPED_CANDIDATES, risk_target=0.35)
    assert not named.selects
    for bad, match in (
        ({"scorer": "auto"}, "needs candidates"),
        ({"scorer": "auto", "candidates": "perplexity,geometry"}, "need risk_target"),
        ({"scorer": "auto", "candidates": "perplexity,type_floor", "risk_target": 0.3}, "unknown"),
        ({"scorer": "perplexity", "candidates": "geometry,probe_mid", "risk_target": 0.3}, "not"),
        ({"scorer": "auto", "candidates": "perplexity", "risk_target": 0.3}, "at least two"),
    ):
        with pytest.raises(ConfigError, match=match):
            CalibrationConfig(**bad)


# --- the shipped default guard ----------------------------------------------------------------


def test_the_shipped_guard_records_its_selection_and_certifies_at_delta_over_20() -> None:
    """probe_mid was chosen among the power run's 13 scorers; an audit found 7
    more looks at the same answers before the choice (configs/default_guard/audit.jsonl), kept
    in the artifact's selection ledger: K = 20."""
    art = GuardArtifact.load(default_artifact_path())
    sel = art.selection
    assert sel is not None
    assert sel.candidates == SHIPPED_CANDIDATES and sel.chosen == "probe_mid" == art.scorer.kind
    assert sel.rule == "bonferroni" and sel.n == art.n == 1345
    assert (sel.risk_target, sel.delta) == (0.35, 0.1)
    audit = (ROOT / "configs" / "default_guard" / "audit.jsonl").read_text(encoding="utf-8")
    assert [e.name for e in art.ledger] == [e.name for e in parse_ledger(audit)]
    assert all(e.by == "audit" and e.evidence for e in art.ledger)
    assert art.n_candidates == sel.n_candidates == 20
    assert sel.delta_per_candidate == pytest.approx(0.1 / 20)
    assert "calibration split" in sel.data
    rule = art.decision_rule(GuardConfig(mode="risk", risk_target=0.35, delta=0.1))
    alone = _risk(art.scores, art.correct, 0.35, 0.1 / 20)
    assert rule.threshold == alone.threshold
    assert rule.guarantee.calibration_participation == pytest.approx(368 / 1345)
    assert "chosen among 13 candidates" in rule.guarantee.statement
    assert "ledger records 7 more" in rule.guarantee.statement
    # the smallest certifiable risk target at delta 0.1, every look accounted for
    assert smallest_certifiable_risk(art.scores, art.correct, 0.1 / 20) == 0.19
    with pytest.raises(UncertifiableTargetError):
        art.decision_rule(GuardConfig(mode="risk", risk_target=0.18, delta=0.1))


# --- calibrate --scorer auto, end to end on the tiny random-weight model ----------------------


def test_calibrate_scorer_auto_ships_the_best_certified_candidate(tmp_path: Path) -> None:
    from _pipeline_fakes import ITEMS, HashJudge, _config, _judges
    from tiny_models import tiny_chat_model

    from abstain_guard.calibration.building.pipeline import calibrate

    model = tiny_chat_model("llama", seed=0)
    names = ("perplexity", "max_sequence_probability", "mean_token_entropy")
    cfg = _config(tmp_path, "auto").model_copy(
        update={"scorer": "auto", "candidates": names, "risk_target": 0.9, "ratios": (1, 1, 4, 1)}
    )
    summary = calibrate(
        ITEMS,
        tmp_path / "auto",
        config=cfg,
        model=model,
        judges=_judges(tmp_path, "auto", HashJudge()),
        progress=False,
    )
    art = GuardArtifact.load(tmp_path / "auto")
    sel = art.selection
    assert sel is not None and sel.candidates == names and sel.n == art.n
    assert summary.scorer == sel.chosen == art.scorer.kind
    assert set(sel.certificates) == set(names)
    best = max(sel.certificates.values(), key=lambda c: c.participation)
    assert sel.certificates[sel.chosen].participation == best.participation
    # each candidate's certificate is its own scores certified alone at delta/3: rebuild them
    for name in names:
        alone = calibrate(
            ITEMS,
            tmp_path / name,
            config=cfg.model_copy(update={"scorer": name, "candidates": None}),
            model=model,
            judges=_judges(tmp_path, "auto", HashJudge()),  # the same run cache: no new model run
            progress=False,
        )
        assert alone.split_sizes == summary.split_sizes
        own = GuardArtifact.load(tmp_path / name)
        cert = sel.certificates[name]
        assert cert.rank == _risk(own.scores, own.correct, 0.9, 0.1 / 3).rank
    chosen = GuardArtifact.load(tmp_path / sel.chosen)
    assert np.array_equal(chosen.scores, art.scores)
    rule = art.decision_rule(GuardConfig(mode="risk", risk_target=0.9, on_infeasible="abstain_all"))
    assert rule.guarantee.delta_per_candidate == pytest.approx(0.1 / 3)


def test_a_selection_split_chooses_on_answers_the_certificate_never_reads(tmp_path: Path) -> None:
    """``selection_share``: the candidates are compared on a seeded draw of the calibration
    answers, the chosen one certifies at δ (K = 1) on the others, and the artifact stores only
    those (issue 57)."""
    from _pipeline_fakes import ITEMS, HashJudge, _config, _judges
    from tiny_models import tiny_chat_model

    from abstain_guard.calibration.building.pipeline import calibrate
    from abstain_guard.guarantee.selection import select_on_split

    model = tiny_chat_model("llama", seed=0)
    names = ("perplexity", "max_sequence_probability", "mean_token_entropy")
    update = {"scorer": "auto", "candidates": names, "risk_target": 0.9, "ratios": (1, 1, 4, 1)}
    judges = _judges(tmp_path, "auto", HashJudge())
    calibrate(
        ITEMS,
        tmp_path / "all",
        config=_config(tmp_path, "auto").model_copy(update=update),
        model=model,
        judges=judges,
        progress=False,
    )
    every = GuardArtifact.load(tmp_path / "all")  # compared on every calibration answer
    cfg = _config(tmp_path, "auto").model_copy(update={**update, "selection_share": 0.5})
    calibrate(ITEMS, tmp_path / "split", config=cfg, model=model, judges=judges, progress=False)
    art = GuardArtifact.load(tmp_path / "split")
    sel = art.selection
    assert sel is not None and sel.rule == "selection_split" and art.n_candidates == 1
    chosen_ids, picked = art.metadata["calibration_ids"], art.metadata["selection_ids"]
    assert not set(chosen_ids) & set(picked)
    assert sorted(chosen_ids + picked) == sorted(every.metadata["calibration_ids"])
    assert art.n == sel.n == len(chosen_ids) and art.metadata["split_sizes"]["selection"] == len(
        picked
    )
    # the same draw, by hand: choose on the picked answers, keep the others
    plain = {n: _scores_of(tmp_path, n, update, model, judges) for n in names}
    by_hand, pick, keep = select_on_split(
        plain, every.correct, 0.9, 0.1, share=0.5, seed=cfg.seed, data="x"
    )
    assert by_hand.chosen == sel.chosen == art.scorer.kind
    assert np.array_equal(art.scores, plain[sel.chosen][keep])
    assert [every.metadata["calibration_ids"][i] for i in pick] == picked
    rule = art.decision_rule(GuardConfig(mode="risk", risk_target=0.9, on_infeasible="abstain_all"))
    per_candidate = rule.guarantee.delta_per_candidate
    assert (0.1 if per_candidate is None else per_candidate) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="selection_share"):
        CalibrationConfig(scorer="perplexity", selection_share=0.5)


def _scores_of(tmp: Path, name: str, update: dict[str, Any], model: Any, judges: Any) -> Any:
    from _pipeline_fakes import ITEMS, _config

    from abstain_guard.calibration.building.pipeline import calibrate

    cfg = _config(tmp, "auto").model_copy(update={**update, "scorer": name, "candidates": None})
    calibrate(ITEMS, tmp / name, config=cfg, model=model, judges=judges, progress=False)
    return GuardArtifact.load(tmp / name).scores
