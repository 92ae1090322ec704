"""The vectorised resplit simulation, scorer tables, hypothesis checks and the results layout."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from _results import evaluate_scores

from abstain_guard.calibration.measure.hypotheses import hypothesis_checks, validate_importance
from abstain_guard.calibration.measure.metrics import bootstrap_intervals
from abstain_guard.calibration.measure.ranking import scorer_table
from abstain_guard.calibration.measure.results import (
    MeasureSettings,
    build_results,
    evaluate_dataset,
)
from abstain_guard.calibration.measure.simulation import (
    DEFAULT_LEVELS,
    level_key,
    resplit_arrays,
    resplit_permutations,
    resplit_simulation,
)
from abstain_guard.errors import InsufficientDataError, InvalidInputError
from abstain_guard.guarantee import conformal


def _synthetic(n: int, seed: int, shift: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.6).astype(int)
    return rng.normal(size=n) - shift * y, y


def _paper_reference(cal_s, cal_y, test_s, test_y, level):
    """One resplit, straight from the paper's definitions (no shared code)."""
    n = cal_s.size
    k = math.ceil(round(level * (n + 1), 9))
    tau = np.sort(cal_s)[k - 1] if k <= n else math.inf
    answered = test_s <= tau
    part = answered.mean()
    cc = test_y[answered].mean() if answered.any() else math.nan
    u = np.sort(cal_s[cal_y == 1])
    c = u.size
    # 1−β = sup{q in (0,1): Quantile(⌈q(c+1)⌉/c, 𝒰) ≤ τ}, by brute force over a fine grid.
    # A quantile level above 1 selects no element of 𝒰, so it never satisfies the condition
    # (also when τ = +inf; abstain_guard.guarantee.conformal reads it the same way:
    # 1−β = c/(c+1)).
    qs = np.linspace(1e-7, 1 - 1e-7, 200001)
    ranks = np.ceil(qs * (c + 1)).astype(int)
    ok = (ranks <= c) & (u[np.clip(ranks, 1, c) - 1] <= tau) if c else np.zeros(qs.size, bool)
    one_minus_beta = qs[ok].max() if ok.any() else 0.0
    bound = one_minus_beta / (level + 1 / (n + 1)) * c / n
    return tau, part, cc, one_minus_beta, bound


def test_simulation_ranks_use_participation_levels() -> None:
    # The simulation's levels are participation targets 1−α; its ranks are conformal_rank(α).
    s, y = _synthetic(20, seed=2)
    sim = resplit_simulation(s, y, levels=(0.7, 0.9), n_resplits=3)
    assert sim["n_calibration"] == 10
    assert sim["levels"]["0.7"]["calibration_rank"] == 8  # ⌈0.7 · 11⌉
    assert sim["levels"]["0.9"]["calibration_rank"] == 10  # ⌈0.9 · 11⌉


def test_level_key() -> None:
    assert [level_key(v) for v in (0.1, 0.5, 0.25)] == ["0.1", "0.5", "0.25"]


def test_vectorised_matches_paper_reference_loop() -> None:
    s, y = _synthetic(31, seed=4)
    levels = (0.1, 0.5, 0.8, 0.95)  # 0.95 with n_cal = 16 gives rank 17 > 16: τ = +inf
    arr = resplit_arrays(s, y, levels=levels, n_resplits=20, seed=7)
    perms = np.concatenate(list(resplit_permutations(31, 20, 7)))
    n_cal = arr.n_calibration
    assert n_cal == 16
    for r, perm in enumerate(perms):
        cal, test = perm[:n_cal], perm[n_cal:]
        for j, lv in enumerate(levels):
            tau, part, cc, omb, bound = _paper_reference(s[cal], y[cal], s[test], y[test], lv)
            assert arr.threshold[r, j] == tau
            assert arr.participation[r, j] == pytest.approx(part)
            if math.isnan(cc):
                assert math.isnan(arr.conditional_correctness[r, j])
            else:
                assert arr.conditional_correctness[r, j] == pytest.approx(cc)
            assert arr.one_minus_beta[r, j] == pytest.approx(omb, abs=1e-5)  # grid step 5e-6
            assert arr.bound[r, j] == pytest.approx(bound, abs=1e-4)


def test_vectorised_matches_core_conformal_functions() -> None:
    s, y = _synthetic(41, seed=5)
    levels = (0.1, 0.3, 0.6, 0.9)
    arr = resplit_arrays(s, y, levels=levels, n_resplits=30, seed=3)
    perms = np.concatenate(list(resplit_permutations(41, 30, 3)))
    ranks = resplit_simulation(s, y, levels=levels, n_resplits=1)["levels"]
    n_cal = arr.n_calibration
    checked = 0
    for r, perm in enumerate(perms):
        cal = perm[:n_cal]
        if y[cal].min() == y[cal].max():
            continue  # the scalar bound needs both classes
        for j, lv in enumerate(levels):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                thr = conformal.participation_threshold(s[cal], 1 - lv)
                b = conformal.conditional_correctness_bound(s[cal], y[cal], 1 - lv)
            lo, hi = conformal.participation_interval(1 - lv, n_cal)
            assert arr.threshold[r, j] == thr.threshold
            assert arr.one_minus_beta[r, j] == pytest.approx(b.coverage_correct)
            assert arr.bound[r, j] == pytest.approx(b.bound)
            assert ranks[level_key(lv)]["calibration_rank"] == thr.rank
            assert hi - lo == pytest.approx(1 / (n_cal + 1))
            checked += 1
    assert checked > 50


def test_chunking_does_not_change_results() -> None:
    s, y = _synthetic(60, seed=6)
    a = resplit_arrays(s, y, n_resplits=37, seed=11)
    b = resplit_arrays(s, y, n_resplits=37, seed=11, chunk_size=5)
    np.testing.assert_array_equal(a.participation, b.participation)
    np.testing.assert_array_equal(a.bound, b.bound)


def test_mean_participation_in_band_on_exchangeable_data() -> None:
    s, y = _synthetic(400, seed=8)
    sim = resplit_simulation(s, y, n_resplits=2000, seed=1)
    assert sim["n_calibration"] == 200 and sim["n_test"] == 200
    for key, lv in sim["levels"].items():
        lo, hi = lv["band"]
        assert lo == pytest.approx(float(key))
        assert hi == pytest.approx(float(key) + 1 / 201)
        # The exact expectation over random splits (distinct scores) is k/(n_cal+1) ∈ band.
        assert lo <= lv["expected_participation"] < hi
        se = lv["empirical_participation_se"]
        assert abs(lv["empirical_participation"] - lv["expected_participation"]) < 4 * se
        assert lv["participation_in_band_within_3se"]
        assert lv["n_resplits_none_answered"] == 0
        assert 0.0 <= lv["fraction_resplits_at_or_above_bound"] <= 1.0
        # The paper's bound is (slightly) below the selective accuracy it estimates.
        assert lv["correctness_at_or_above_bound_within_3se"]
    # An informative score: correctness among answered falls as participation grows.
    cc = [lv["conditional_correctness"] for lv in sim["levels"].values()]
    assert cc[0] > cc[-1] > sim["accuracy"] - 0.02


def test_resplits_with_nothing_answered_are_counted() -> None:
    s, y = _synthetic(10, seed=9)
    sim = resplit_simulation(s, y, levels=(0.1,), n_resplits=400, seed=0)
    lv = sim["levels"]["0.1"]
    assert lv["calibration_rank"] == 1
    assert 0 < lv["n_resplits_none_answered"] < 400
    assert math.isfinite(lv["conditional_correctness"])


def test_infinite_threshold_answers_everything() -> None:
    s, y = _synthetic(12, seed=10)
    sim = resplit_simulation(s, y, levels=(0.9,), n_resplits=50)
    lv = sim["levels"]["0.9"]
    assert lv["threshold_infinite"] and lv["empirical_participation"] == 1.0


def test_simulation_errors() -> None:
    s, y = _synthetic(20, seed=0)
    with pytest.raises(InvalidInputError, match="strictly between"):
        resplit_simulation(s, y, levels=(0.0, 0.5))
    with pytest.raises(InvalidInputError, match="n_resplits"):
        resplit_simulation(s, y, n_resplits=0)
    with pytest.raises(InvalidInputError, match="length mismatch"):
        resplit_simulation(s, y[:-1])
    with pytest.raises(InvalidInputError, match="NaN"):
        resplit_simulation(np.where(np.arange(20) == 3, np.nan, s), y)
    with pytest.raises(InsufficientDataError):
        resplit_simulation([0.1], [1])
    with pytest.raises(InvalidInputError, match="calibration_fraction"):
        resplit_simulation(s, y, calibration_fraction=1.0)


def test_scorer_table_and_within_group() -> None:
    y = np.array([1, 0, 1, 0, 1, 1, 1, 0])
    groups = np.array(["a", "a", "a", "a", "b", "b", "c", "c"])
    u = np.array([0.1, 0.9, 0.2, 0.3, 0.5, 0.6, 0.4, 0.1])
    table = scorer_table({"s": u}, y, groups=groups)
    entry = table["s"]
    assert set(entry) >= {"auroc", "auprc", "auprc_incorrect", "prr", "n", "within_group"}
    wg = entry["within_group"]
    assert wg["groups"]["a"]["auroc"] == pytest.approx(1.0)
    assert wg["groups"]["c"]["auroc"] == pytest.approx(0.0)
    assert "b" in wg["skipped_groups"] and "one class" in wg["skipped_groups"]["b"]
    assert wg["mean_auroc"] == pytest.approx(0.5)
    assert wg["weighted_mean_auroc"] == pytest.approx((4 * 1.0 + 2 * 0.0) / 6)
    with_none = groups.astype(object)
    with_none[0] = None
    wg2 = scorer_table({"s": u}, y, groups=with_none)["s"]["within_group"]
    assert wg2["n_without_group"] == 1 and "None" not in wg2["groups"]
    assert wg2["groups"]["a"]["n"] == 3


def test_scorer_table_nan_policy() -> None:
    y = np.array([1, 0, 1, 0, 1])
    u = np.array([0.1, 0.9, np.nan, 0.8, 0.2])
    with pytest.raises(InvalidInputError, match="nan_policy='omit'"):
        scorer_table({"s": u}, y)
    entry = scorer_table({"s": u}, y, nan_policy="omit")["s"]
    assert entry["n"] == 4 and entry["n_omitted"] == 1 and entry["auroc"] == 1.0
    broken = scorer_table({"s": u, "dead": np.full(5, np.nan)}, y, nan_policy="omit")
    assert broken["dead"]["n"] == 0 and "empty" in broken["dead"]["error"]
    entry = evaluate_dataset(
        "d",
        {"s": u, "dead": np.full(5, np.nan)},
        y,
        settings=MeasureSettings(n_resplits=5, nan_policy="omit"),
    )
    assert "participation" in entry["scorers"]["s"] and "error" in entry["scorers"]["dead"]
    with pytest.raises(InvalidInputError, match="one score per labeled response"):
        scorer_table({"s": u[:3]}, y)
    with pytest.raises(InvalidInputError, match="empty"):
        scorer_table({}, y)


def _geometry(n_tokens: int, num_layers: int, omega: float, phi_shift: float, rng) -> dict:
    w = 2 * num_layers - 1
    return {
        "num_layers": num_layers,
        "omega": (omega + 0.05 * rng.random((n_tokens, w))).tolist(),
        "theta": np.ones((n_tokens, w)).tolist(),
        "phi_in": (1.0 + phi_shift + 0.05 * rng.random((n_tokens, w))).tolist(),
        "phi_out": np.ones((n_tokens, w)).tolist(),
    }


def test_hypothesis_checks_direction_and_values() -> None:
    rng = np.random.default_rng(0)
    y = np.array([1] * 15 + [0] * 15)
    geoms = [_geometry(3, 3, 0.6 if c else 0.3, -0.2 if c else 0.1, rng) for c in y]
    geoms.append({"num_layers": 3, "omega": [], "theta": [], "phi_in": None, "phi_out": None})
    geoms.insert(0, None)  # a response without geometry
    y = np.concatenate([[0], y, [1]])
    out = hypothesis_checks(geoms, y)
    assert out["num_layers"] == 3 and out["n_without_tokens"] == 2
    h1, h2 = out["knowledge_interaction"], out["relative_angular_distance"]
    assert h1["supported"] and h2["supported"]
    assert len(h1["per_layer"]["mean_correct"]) == 5
    assert h1["n_correct"] == 15 and h1["n_incorrect"] == 15
    expected = np.mean([np.asarray(g["omega"]).mean(axis=0) for g in geoms[1:16]], axis=0)
    np.testing.assert_allclose(h1["per_layer"]["mean_correct"], expected)
    assert h1["n_layers_significant_expected_direction"] == 5
    # Reversed labels: the direction no longer agrees, so the hypothesis is not supported.
    assert not hypothesis_checks(geoms, 1 - y)["knowledge_interaction"]["supported"]


def test_hypothesis_checks_without_phi_and_errors() -> None:
    rng = np.random.default_rng(1)
    y = np.array([1, 0, 1, 0])
    geoms = [_geometry(2, 2, 0.5, 0.0, rng) for _ in y]
    for g in geoms:
        g["phi_in"] = g["phi_out"] = None
    out = hypothesis_checks(geoms, y)
    assert out["relative_angular_distance"] is None and out["n_without_phi"] == 4
    bad = [dict(g) for g in geoms]
    bad[0]["omega"] = [[0.1, 0.2]]
    with pytest.raises(InvalidInputError, match=r"\[tokens, 2L-1\]"):
        hypothesis_checks(bad, y)
    with pytest.raises(InvalidInputError, match="length mismatch"):
        hypothesis_checks(geoms, y[:3])
    with pytest.raises(InsufficientDataError):
        hypothesis_checks(geoms, [1, 1, 1, 1])
    with pytest.raises(InsufficientDataError, match="no response carries geometry"):
        hypothesis_checks([None, None], [1, 0])
    mixed = [dict(g) for g in geoms]
    mixed[1] = _geometry(2, 3, 0.5, 0.0, rng)
    with pytest.raises(InvalidInputError, match="num_layers"):
        hypothesis_checks(mixed, y)


def test_validate_importance() -> None:
    good = {
        f: {
            "auroc_drop_mean": np.float32(0.1),
            "auroc_drop_sd": 0.0,
            "auprc_drop_mean": 0.2,
            "auprc_drop_sd": 0.01,
        }
        for f in ("omega", "theta")
    }
    out = validate_importance(good)
    assert isinstance(out["omega"]["auroc_drop_mean"], float)
    with pytest.raises(InvalidInputError, match="lacks"):
        validate_importance({"omega": {"auroc_drop_mean": 0.1}})
    # GeometryScorer.feature_importance(...).to_dict() form.
    scorer_form = {
        "auroc": 0.8,
        "auprc": 0.7,
        "drops": {
            "theta": {"auroc_mean": 0.05, "auroc_sd": 0.01, "auprc_mean": 0.03, "auprc_sd": 0.02}
        },
    }
    norm = validate_importance(scorer_form)
    assert norm == {
        "theta": {
            "auroc_drop_mean": 0.05,
            "auroc_drop_sd": 0.01,
            "auprc_drop_mean": 0.03,
            "auprc_drop_sd": 0.02,
            "unpermuted_auroc": 0.8,
            "unpermuted_auprc": 0.7,
        }
    }

    class _Importance:
        def to_dict(self) -> dict:
            return scorer_form

    assert validate_importance(_Importance()) == norm


def test_evaluate_dataset_layout() -> None:
    s, y = _synthetic(80, seed=13)
    rng = np.random.default_rng(2)
    groups = rng.choice(["x", "y"], size=80)
    entry = evaluate_dataset(
        "toy",
        {"geometry": s, "perplexity": s + rng.normal(size=80)},
        y,
        groups=groups,
        calibrated_scores_by_scorer={"perplexity": s + rng.normal(size=80)},
        settings=MeasureSettings(n_resplits=50),
    )
    results = build_results([entry], {"model": "toy"})
    sc = results["datasets"]["toy"]["scorers"]["geometry"]
    assert {"auroc", "auprc", "prr", "participation", "resplit"} <= set(sc)
    assert list(sc["participation"]) == [level_key(v) for v in DEFAULT_LEVELS]
    lv = sc["participation"]["0.9"]
    assert {"empirical_participation", "band", "conditional_correctness", "paper_bound"} <= set(lv)
    assert results["datasets"]["toy"]["calibrated_scorers"]["perplexity"]["participation"]
    assert "mean_auroc" in results["datasets"]["toy"]["within_group"]["geometry"]
    assert results["datasets"]["toy"]["n_groups"] == 2
    assert results["datasets"]["toy"]["hypothesis"] is None
    with pytest.raises(InvalidInputError, match="twice"):
        build_results([entry, entry])
    one = evaluate_scores({"g": s}, y, name="d", settings=MeasureSettings(n_resplits=10))
    assert one["datasets"]["d"]["scorers"]["g"]["resplit"]["n_resplits"] == 10


def test_intervals_and_counts_in_the_results() -> None:
    s, y = _synthetic(120, seed=21)
    rng = np.random.default_rng(3)
    groups = rng.choice(["x", "y", "z"], size=120)
    entry = evaluate_dataset(
        "toy",
        {"geometry": s, "noise": rng.normal(size=120)},
        y,
        groups=groups,
        calibrated_scores_by_scorer={"noise": rng.normal(size=120)},
        settings=MeasureSettings(n_resplits=20),
    )
    assert entry["n_correct"] == int(y.sum()) and entry["n_incorrect"] == int((1 - y).sum())
    assert entry["bootstrap"]["n_boot"] == 2000 and entry["bootstrap"]["confidence"] == 0.95
    for sc in (*entry["scorers"].values(), *entry["calibrated_scorers"].values()):
        assert sc["n_correct"] + sc["n_incorrect"] == sc["n"] == 120
        for m in ("auroc", "auprc", "auprc_incorrect", "prr"):
            lo, hi = sc[f"{m}_ci"]
            assert lo <= sc[m] <= hi, m
    geo = entry["scorers"]["geometry"]
    assert tuple(geo["auroc_ci"]) == bootstrap_intervals(s, y, ("auroc",), seed=0)["auroc"]
    assert geo["auroc_ci"][0] > 0.5  # a real signal: the interval excludes chance
    wg = entry["within_group"]["geometry"]
    lo, hi = wg["mean_auroc_ci"]
    assert lo <= wg["mean_auroc"] <= hi
    for g in wg["groups"].values():
        assert g["auroc_ci"][0] <= g["auroc"] <= g["auroc_ci"][1]
    assert wg["n_correct"] + wg["n_incorrect"] == sum(g["n"] for g in wg["groups"].values())
    # The within-type interval is wider than the pooled one (each group has fewer answers).
    assert hi - lo > geo["auroc_ci"][1] - geo["auroc_ci"][0]


def test_intervals_can_be_switched_off_and_follow_nan_policy() -> None:
    s, y = _synthetic(60, seed=22)
    off = evaluate_dataset("d", {"s": s}, y, settings=MeasureSettings(n_resplits=5, n_boot=0))
    assert off["bootstrap"] is None and "auroc_ci" not in off["scorers"]["s"]
    with_nan = s.copy()
    with_nan[[1, 7]] = np.nan
    omit = MeasureSettings(n_resplits=5, nan_policy="omit", n_boot=300)
    on = evaluate_dataset("d", {"s": with_nan}, y, settings=omit)
    sc = on["scorers"]["s"]
    expected = bootstrap_intervals(with_nan, y, n_boot=300, nan_policy="omit")
    assert {m: tuple(sc[f"{m}_ci"]) for m in expected} == expected
    assert sc["n_correct"] + sc["n_incorrect"] == 58
    with pytest.raises(InvalidInputError, match="n_boot"):
        scorer_table({"s": s}, y, n_boot=-1)
