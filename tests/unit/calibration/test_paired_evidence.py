"""Issue 46 item 10: the paired comparison's p-values, their Holm adjustment, and the audited
JSON that ``bench/paired_tables.py`` writes beside the bench."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType
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


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_paired_tables", ROOT / "bench" / "paired_tables.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    assert family["test"] == "paired DeLong" and family["smallest_attainable_holm_p"] is None
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


def _results_json(tmp_path: Path, names: tuple[str, ...]) -> list[Path]:
    paths = []
    for i, name in enumerate(names):
        paired = _report(10 + i)
        entry = {
            "name": name,
            "scorers": {
                s: {"auprc": 0.5 + 0.01 * j, "auprc_ci": [0.4, 0.6]}
                for j, s in enumerate(paired["scorers"])
            },
            "paired": paired,
            "costs": {"geometry": {"seconds_per_answer": 1e-4}},
        }
        path = tmp_path / f"power_report_{name}" / "results.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"datasets": {name: entry}}), encoding="utf-8")
        paths.append(path)
    return paths


def test_tables_json_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    paths = _results_json(tmp_path, ("builtin", "sciq"))
    out = tmp_path / "paired_tables.json"
    bench.main([*map(str, paths), "--json", str(out)])
    md = capsys.readouterr().out
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert [s["path"] for s in doc["sources"]] == [str(p) for p in paths]
    for src, path in zip(doc["sources"], paths, strict=True):
        assert src["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert doc["family"]["size"] == 2 * 3 * 2 and doc["family"]["method"] == "holm"
    ps, holm = [], []
    for path in paths:
        entry = next(iter(json.loads(path.read_text())["datasets"].values()))
        got = doc["sets"][entry["name"]]
        assert got["source"] == str(path) and got["reference"] == "geometry"
        assert got["n_correct"] == entry["paired"]["n_correct"]
        for name, p in entry["paired"]["scorers"].items():
            g = got["scorers"][name]
            for key in (
                "auroc",
                "auroc_ci",
                "auroc_diff",
                "auroc_diff_ci",
                "auroc_diff_p",
                "within_diff",
                "within_diff_ci",
                "within_diff_p",
            ):
                assert g[key] == p.get(key), (name, key)
            assert g["auprc"] == entry["scorers"][name]["auprc"]
            # every cell shown in the markdown is in the JSON, and the row is the table's
            assert "| " + " | ".join(g["cells"][c] for c in got["columns"]) + " |" in md
            if name != "geometry":
                ps += [p["auroc_diff_p"], p["within_diff_p"]]
                holm += [g["auroc_diff_holm_p"], g["within_diff_holm_p"]]
                assert g["auroc_diff_verdict"] in {
                    "reference better",
                    "baseline better",
                    "not significant after Holm at family-wise 0.05",
                }
        row = "| " + " | ".join(got["headline"][c] for c in doc["headline_columns"]) + " |"
        assert row in md and "Holm p" in md
    assert holm == pytest.approx(holm_adjust(ps))  # one family across both files


def test_tables_without_p_values_warn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    [path] = _results_json(tmp_path, ("builtin",))
    doc = json.loads(path.read_text())
    for p in doc["datasets"]["builtin"]["paired"]["scorers"].values():
        p.pop("auroc_diff_p", None)
        p.pop("within_diff_p", None)
    path.write_text(json.dumps(doc))
    out = tmp_path / "t.json"
    bench.main([str(path), "--json", str(out)])
    assert "no paired p-values" in capsys.readouterr().err
    got = json.loads(out.read_text())
    assert got["family"]["size"] == 0
    assert got["sets"]["builtin"]["scorers"]["perplexity"]["auroc_diff_holm_p"] is None


# --- issue 57: paired DeLong, so that no verdict turns on a single bootstrap draw ----------


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


def test_comparisons_outside_the_tables_join_the_holm_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 57 item 3: bench/probe_mlp.py's MLP − logistic comparisons were made on the same
    held-out answers; ``--also`` puts them in the one Holm family with the tables'."""
    bench = _bench()
    paths = _results_json(tmp_path, ("builtin", "sciq"))
    rng = np.random.default_rng(7)
    y = (rng.random(300) < 0.3).astype(int)
    features = {
        kind: {
            "paired": paired_report(
                {"mlp": -s * y + rng.normal(size=300), "logistic": -1.0 * y + rng.normal(size=300)},
                y,
                reference="mlp",
                n_boot=200,
            )
        }
        for kind, s in (("probe_concat", 1.0), ("probe_concat_last", 3.0))
    }
    mlp = tmp_path / "probe_mlp.json"
    mlp.write_text(json.dumps({"artifact": "runs/x", "data": "builtin", "features": features}))
    out = tmp_path / "paired_tables.json"
    bench.main([*map(str, paths), "--also", str(mlp), "--json", str(out)])
    md = capsys.readouterr().out
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["family"]["size"] == 2 * 3 * 2 + 2 and "mlp − logistic" in doc["family"]["members"]
    assert doc["sources"][-1]["sha256"] == hashlib.sha256(mlp.read_bytes()).hexdigest()
    ps = [
        json.loads(p.read_text())["datasets"][n]["paired"]["scorers"][s][f"{c}_p"]
        for p, n in zip(paths, ("builtin", "sciq"), strict=True)
        for s in ("probe_mid", "perplexity", "probe_upper")
        for c in ("auroc_diff", "within_diff")
    ]
    ps += [features[k]["paired"]["scorers"]["logistic"]["auroc_diff_p"] for k in features]
    expected = holm_adjust(ps)
    also = [doc["also"][f"builtin {k}: mlp − logistic"]["compared"]["logistic"] for k in features]
    assert [a["auroc_diff_holm_p"] for a in also] == pytest.approx(expected[-2:])
    assert doc["sets"]["builtin"]["scorers"]["perplexity"]["auroc_diff_holm_p"] == pytest.approx(
        expected[2]
    )
    assert also[1]["verdict"] == "reference better"  # the 3σ MLP against the 1σ logistic
    assert "builtin probe_concat_last: mlp − logistic" in md
    # a probe_mlp.json written before it stored its paired reports is refused, not skipped
    for f in features.values():
        f.pop("paired")
    mlp.write_text(json.dumps({"data": "builtin", "features": features}))
    with pytest.raises(SystemExit, match=r"rerun bench/probe_mlp\.py"):
        bench.main([*map(str, paths), "--also", str(mlp)])


def test_the_readme_table_is_the_committed_evidence() -> None:
    """Issue 57: README's "Is geometry worth its cost?" rows are, cell for cell, the headline
    rows of the committed ``bench/paired_tables.json`` (so an auditor re-derives every README
    figure from it), and that JSON's family is the whole one: DeLong, every set and scorer, and
    the MLP comparisons of ``bench/probe_mlp.json`` (its sha256 recorded)."""
    doc = json.loads((ROOT / "bench" / "paired_tables.json").read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name, entry in doc["sets"].items():
        cells = entry["headline"]
        row = "| " + " | ".join(cells[c] for c in doc["headline_columns"]) + " |"
        assert row in readme, f"README's {name} row is not the committed evidence"
    family = doc["family"]
    assert family["test"] == "paired DeLong" and family["smallest_attainable_holm_p"] is None
    per_set = {
        name: sum(
            e.get(f"{c}_holm_p") is not None
            for e in entry["scorers"].values()
            for c in ("auroc_diff", "within_diff")
        )
        for name, entry in doc["sets"].items()
    }
    assert family["size"] == sum(per_set.values()) + len(doc["also"]) == 50
    mlp = ROOT / "bench" / "probe_mlp.json"
    digest = hashlib.sha256(mlp.read_bytes()).hexdigest()
    assert {"path": "bench/probe_mlp.json", "sha256": digest} in doc["sources"]
    assert f"Holm-adjusted over the {family['size']} comparisons" in readme
