"""The paired comparison's p-values, their Holm adjustment, and the README's rows against the
audited JSON that ``bench/power/paired_tables.py`` wrote (``bench/power/paired_tables.json``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from abstain_guard.calibration.measure.metrics import bootstrap_draws
from abstain_guard.calibration.measure.paired import (
    adjust_family,
    bootstrap_p_value,
    delong_difference,
    holm_adjust,
    paired_report,
    verdict,
)

ROOT = Path(__file__).resolve().parents[3]


def _paired_p(signal_a: float, signal_b: float, seed: int, n: int = 200, b: int = 400) -> float:
    """p-value of AUROC(a) − AUROC(b) for two noisy scorers of the same labels."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.4).astype(int)
    a = -signal_a * y + rng.normal(size=n)
    other = -signal_b * y + rng.normal(size=n)
    da = bootstrap_draws(a, y, ("auroc",), n_boot=b, seed=seed)["auroc"]
    db = bootstrap_draws(other, y, ("auroc",), n_boot=b, seed=seed)["auroc"]
    return bootstrap_p_value(da - db)


def test_p_value_formula() -> None:
    # B = 9 draws: 2 at or below 0, 8 at or above 0 (one exactly 0).
    draws = np.array([-0.2, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    assert bootstrap_p_value(draws) == pytest.approx(2 * (2 + 1) / (9 + 1))
    assert bootstrap_p_value(-draws) == pytest.approx(0.6)  # two-sided: symmetric
    assert bootstrap_p_value(np.zeros(50)) == 1.0  # identical scorers
    assert bootstrap_p_value(np.full(99, 0.3)) == pytest.approx(2 / 100)  # never 0
    assert bootstrap_p_value(np.array([np.nan, 0.3, np.nan])) == pytest.approx(2 / 2)
    assert np.isnan(bootstrap_p_value(np.array([np.nan])))


def test_p_values_valid_under_null_and_small_under_difference() -> None:
    null = np.array([_paired_p(1.0, 1.0, seed) for seed in range(120)])
    # Exchangeable scorers: roughly uniform — not piled up near 0, spread over (0, 1].
    assert np.mean(null <= 0.05) <= 0.12
    assert np.mean(null <= 0.5) == pytest.approx(0.5, abs=0.15)
    assert 0.35 <= float(np.mean(null)) <= 0.65
    clear = [_paired_p(2.0, 0.0, seed) for seed in range(10)]
    assert max(clear) <= 2 / 401 + 1e-12  # every draw on one side: the smallest p possible


def test_holm_matches_statsmodels() -> None:
    multitest = pytest.importorskip("statsmodels.stats.multitest")
    rng = np.random.default_rng(3)
    for m in (1, 2, 5, 48):
        p = np.concatenate([rng.random(m // 2) * 0.01, rng.random(m - m // 2)])
        rng.shuffle(p)
        ref = multitest.multipletests(p, alpha=0.05, method="holm")[1]
        assert holm_adjust(p.tolist()) == pytest.approx(ref.tolist(), abs=1e-12)
    # Ties and NaN: NaN stays NaN and is not counted in the family.
    with_nan = [0.01, np.nan, 0.01, 0.04, 0.5]
    ref = multitest.multipletests([0.01, 0.01, 0.04, 0.5], method="holm")[1]
    got = holm_adjust(with_nan)
    assert np.isnan(got[1]) and [got[0], got[2], got[3], got[4]] == pytest.approx(ref.tolist())


def test_holm_textbook_example() -> None:
    # Hand-worked: m = 4, sorted 0.01, 0.02, 0.03, 0.04 → 0.04, 0.06, 0.06 (monotone), 0.06.
    assert holm_adjust([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
    assert holm_adjust([0.9, 0.8]) == [1.0, 1.0]
    assert holm_adjust([]) == []


def test_verdicts() -> None:
    assert verdict(0.05, 0.01) == "reference better"
    assert verdict(-0.05, 0.05) == "baseline better"
    assert verdict(-0.05, 0.051) == "not significant after Holm at family-wise 0.05"
    assert verdict(0.05, float("nan")) == "not significant after Holm at family-wise 0.05"


def _report(seed: int, n: int = 240) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.35).astype(int)
    scores = {
        "geometry": -1.5 * y + rng.normal(size=n),
        "probe_mid": -1.4 * y + rng.normal(size=n),  # a near-tie
        "perplexity": rng.normal(size=n),  # clearly worse
        "probe_upper": -4.0 * y + rng.normal(size=n),  # clearly better
    }
    return paired_report(
        scores,
        y,
        reference="geometry",
        groups=np.where(np.arange(n) % 2 == 0, "a", "b").tolist(),
        calibration=np.arange(n) < n // 2,
        n_boot=1000,
        seed=seed,
    )


def test_paired_report_p_values_and_family() -> None:
    reports = [_report(1), _report(2)]
    for rep in reports:
        sc = rep["scorers"]
        assert "auroc_diff_p" not in sc["geometry"]
        for name in ("probe_mid", "perplexity", "probe_upper"):
            assert 0 < sc[name]["auroc_diff_p"] <= 1 and 0 < sc[name]["within_diff_p"] <= 1
        assert sc["perplexity"]["auroc_diff_p"] < 0.01
    family = adjust_family(reports)
    assert family["size"] == 2 * 3 * 2 and reports[0]["family"] == family
    assert family["test"] == "paired DeLong"
    slots = [
        (rep["scorers"][name], comp)
        for rep in reports
        for name in ("probe_mid", "perplexity", "probe_upper")
        for comp in ("auroc_diff", "within_diff")
    ]
    expected = holm_adjust([e[f"{c}_p"] for e, c in slots])
    assert [e[f"{c}_holm_p"] for e, c in slots] == pytest.approx(expected)
    for e, c in slots:
        assert e[f"{c}_holm_p"] >= e[f"{c}_p"]
    sc = reports[0]["scorers"]
    assert sc["perplexity"]["auroc_diff_verdict"] == "reference better"
    assert sc["probe_upper"]["auroc_diff_verdict"] == "baseline better"


# --- paired DeLong, so that no verdict turns on a single bootstrap draw -------------------


def test_delong_matches_mlstatkit_on_the_same_answers() -> None:
    """Our paired DeLong against MLstatkit's ``Delong_test`` (aligned with R pROC's
    roc.test): the same variance and p-value on continuous scores (no ties)."""
    from MLstatkit import Delong_test

    for seed, (sa, sb) in enumerate([(1.0, 0.7), (1.0, 1.0), (0.3, 1.2), (2.0, 0.0)]):
        rng = np.random.default_rng(seed)
        y = (rng.random(300) < 0.4).astype(int)
        a, b = -sa * y + rng.normal(size=300), -sb * y + rng.normal(size=300)
        z, p, *_, info = Delong_test(y, -a, -b)  # it reads higher = positive: our -score
        diff, se, ours = delong_difference(a, b, y)
        assert info["method"] == "delong"
        assert se**2 == pytest.approx(info["var_diff"], rel=1e-9)
        assert ours == pytest.approx(p, rel=1e-9, abs=1e-300)
        assert diff / se == pytest.approx(-z, rel=1e-9)


def test_delong_within_type_adds_the_disjoint_types_variances() -> None:
    rng = np.random.default_rng(5)
    n = 400
    y = (rng.random(n) < 0.4).astype(int)
    groups = np.where(np.arange(n) % 3 == 0, "x", "y")
    groups[:3] = "z"  # too small for DeLong: left out, as in the within-type AUROC
    a, b = -1.0 * y + rng.normal(size=n), -0.8 * y + rng.normal(size=n)
    diffs, variances = [], []
    for g in ("x", "y"):
        m = groups == g
        d, se, _ = delong_difference(a[m], b[m], y[m])
        diffs.append(d)
        variances.append(se**2)
    diff, se, _ = delong_difference(a, b, y, groups=groups)
    assert diff == pytest.approx(np.mean(diffs))
    assert se == pytest.approx(np.sqrt(sum(variances)) / 2)
    assert np.isnan(delong_difference(a, a, y)[2])  # identical rankings: no test, no verdict


def test_delong_p_values_are_valid_under_the_null_and_reach_below_the_bootstrap_floor() -> None:
    def p_of(signal_a: float, signal_b: float, seed: int) -> float:
        rng = np.random.default_rng(seed)
        y = (rng.random(200) < 0.4).astype(int)
        a = -signal_a * y + rng.normal(size=200)
        return delong_difference(a, -signal_b * y + rng.normal(size=200), y)[2]

    null = np.array([p_of(1.0, 1.0, seed) for seed in range(300)])
    assert np.mean(null <= 0.05) <= 0.09 and 0.4 <= float(np.mean(null)) <= 0.6
    # a clear difference: far below 2/(B+1) for any affordable number of draws B
    assert max(p_of(2.0, 0.0, seed) for seed in range(10)) < 1e-6


def test_reports_test_with_delong_and_keep_the_bootstrap_p_for_reference() -> None:
    rep = _report(3)
    sc = rep["scorers"]["perplexity"]
    assert sc["auroc_diff_p"] != sc["auroc_diff_bootstrap_p"]
    assert sc["auroc_diff_se"] > 0 and sc["within_diff_se"] > 0
    assert sc["auroc_diff_bootstrap_p"] >= 2 / 1001
    assert "DeLong" in rep["method"] and "DeLong" in rep["p_value"]


def test_the_readme_table_is_the_committed_evidence() -> None:
    """README's "Is geometry worth its cost?" rows are, cell for cell, the headline rows of the
    committed ``bench/power/paired_tables.json`` (so an auditor re-derives every README figure
    from it), and that JSON's family is the whole one: DeLong, every set and scorer, and the MLP
    comparisons of ``experiments/probe_mlp/probe_mlp.json`` (its sha256 recorded)."""
    doc = json.loads((ROOT / "bench" / "power" / "paired_tables.json").read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name, entry in doc["sets"].items():
        cells = entry["headline"]
        row = "| " + " | ".join(cells[c] for c in doc["headline_columns"]) + " |"
        assert row in readme, f"README's {name} row is not the committed evidence"
    family = doc["family"]
    assert family["test"] == "paired DeLong"
    per_set = {
        name: sum(
            e.get(f"{c}_holm_p") is not None
            for e in entry["scorers"].values()
            for c in ("auroc_diff", "within_diff")
        )
        for name, entry in doc["sets"].items()
    }
    assert family["size"] == sum(per_set.values()) + len(doc["also"]) == 50
    mlp = ROOT / "experiments" / "probe_mlp" / "probe_mlp.json"
    digest = hashlib.sha256(mlp.read_bytes()).hexdigest()
    assert {"path": "experiments/probe_mlp/probe_mlp.json", "sha256": digest} in doc["sources"]
    assert f"Holm-adjusted over the {family['size']} comparisons" in readme
