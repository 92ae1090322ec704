"""paired_tables.py: the tables and the audited JSON from ``abstain-guard evaluate`` results, one
Holm family across every results.json and every ``--also`` comparison.

The inputs are hand-written paired entries with known p-values, so the Holm-adjusted values
and verdicts below are worked out by hand (how ``evaluate`` computes the entries is tested in
tests/unit/calibration/test_paired_evidence.py).

    .venv/bin/pytest -p no:cacheprovider -q bench
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paired_tables import main

NOT_SIGNIFICANT = "not significant after Holm at family-wise 0.05"

#: Per set and scorer: the AUROC, and the (overall, within-type) paired DeLong p-values of
#: geometry − scorer. Twelve comparisons in one family.
SETS: dict[str, dict[str, tuple[float, tuple[float, float] | None]]] = {
    "builtin": {
        "geometry": (0.80, None),
        "probe_mid": (0.79, (0.30, 0.50)),
        "perplexity": (0.60, (0.001, 0.002)),
        "probe_upper": (0.90, (0.004, 0.20)),
    },
    "sciq": {
        "geometry": (0.80, None),
        "probe_mid": (0.79, (0.60, 0.90)),
        "perplexity": (0.60, (0.003, 0.010)),
        "probe_upper": (0.90, (0.0005, 0.04)),
    },
}
#: Holm over the twelve, by hand: sorted p_(i) times (13 − i), running maximum, capped at 1:
#: 0.0005·12, 0.001·11, 0.002·10, 0.003·9, 0.004·8, 0.010·7, 0.04·6, then 0.20·5 ≥ 1.
HOLM: dict[str, dict[str, tuple[float, float]]] = {
    "builtin": {"probe_mid": (1.0, 1.0), "perplexity": (0.011, 0.02), "probe_upper": (0.032, 1.0)},
    "sciq": {"probe_mid": (1.0, 1.0), "perplexity": (0.027, 0.07), "probe_upper": (0.006, 0.24)},
}
#: At family-wise 0.05; the sign of geometry − scorer says which is better.
VERDICTS: dict[str, dict[str, tuple[str, str]]] = {
    "builtin": {
        "probe_mid": (NOT_SIGNIFICANT, NOT_SIGNIFICANT),
        "perplexity": ("reference better", "reference better"),
        "probe_upper": ("baseline better", NOT_SIGNIFICANT),
    },
    "sciq": {
        "probe_mid": (NOT_SIGNIFICANT, NOT_SIGNIFICANT),
        "perplexity": ("reference better", NOT_SIGNIFICANT),
        "probe_upper": ("baseline better", NOT_SIGNIFICANT),
    },
}


def _ci(value: float) -> list[float]:
    return [round(value - 0.05, 4), round(value + 0.05, 4)]


def _scorer(auroc: float, ref_auroc: float, p: tuple[float, float] | None) -> dict[str, Any]:
    """One scorer's paired entry as ``evaluate`` writes it."""
    entry: dict[str, Any] = {
        "auroc": auroc,
        "auroc_ci": _ci(auroc),
        "within_auroc": auroc - 0.01,
        "within_auroc_ci": _ci(auroc - 0.01),
        "selective": {
            "error_at": {"0.1": 0.1, "0.2": 0.15, "0.3": 0.2, "0.5": 0.3},
            "aurc": 0.25,
            "base_error": 0.65,
        },
        "certified": {
            "n": 120,
            "n_correct": 42,
            "smallest_risk_target": 0.3,
            "participation_at_target": 0.2,
            "risk_target": 0.35,
            "delta": 0.1,
        },
    }
    if p is not None:
        diff = round(ref_auroc - auroc, 4)
        for comp, p_value in zip(("auroc_diff", "within_diff"), p, strict=True):
            entry.update({comp: diff, f"{comp}_ci": _ci(diff), f"{comp}_p": p_value})
    return entry


def _paired(scorers: dict[str, tuple[float, tuple[float, float] | None]]) -> dict[str, Any]:
    ref_auroc = scorers["geometry"][0]
    return {
        "reference": "geometry",
        "n_correct": 84,
        "n_incorrect": 156,
        "n_groups_used": 2,
        "n_boot": 1000,
        "scorers": {name: _scorer(a, ref_auroc, p) for name, (a, p) in scorers.items()},
    }


def _results_json(tmp_path: Path, names: tuple[str, ...]) -> list[Path]:
    paths = []
    for name in names:
        paired = _paired(SETS[name])
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
    paths = _results_json(tmp_path, ("builtin", "sciq"))
    out = tmp_path / "paired_tables.json"
    main([*map(str, paths), "--json", str(out)])
    md = capsys.readouterr().out
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert [s["path"] for s in doc["sources"]] == [str(p) for p in paths]
    for src, path in zip(doc["sources"], paths, strict=True):
        assert src["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert doc["family"]["size"] == 2 * 3 * 2 and doc["family"]["method"] == "holm"
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
                holm = (g["auroc_diff_holm_p"], g["within_diff_holm_p"])
                assert holm == pytest.approx(HOLM[entry["name"]][name]), name
                verdicts = (g["auroc_diff_verdict"], g["within_diff_verdict"])
                assert verdicts == VERDICTS[entry["name"]][name], name
        row = "| " + " | ".join(got["headline"][c] for c in doc["headline_columns"]) + " |"
        assert row in md and "Holm p" in md
        assert got["best_probe"] == "probe_upper"


def test_results_without_p_values_are_refused(tmp_path: Path) -> None:
    [path] = _results_json(tmp_path, ("builtin",))
    doc = json.loads(path.read_text())
    for p in doc["datasets"]["builtin"]["paired"]["scorers"].values():
        p.pop("auroc_diff_p", None)
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="no paired p-values"):
        main([str(path)])


def _mlp_report(diff: float, p: float) -> dict[str, Any]:
    """An ``experiments/probe_mlp/probe_mlp.py`` paired report: mlp − logistic, overall only."""
    return {
        "reference": "mlp",
        "n_correct": 90,
        "n_incorrect": 210,
        "n_groups_used": 0,
        "scorers": {
            "mlp": {"auroc": 0.85, "auroc_ci": _ci(0.85)},
            "logistic": {
                "auroc": 0.85 - diff,
                "auroc_ci": _ci(0.85 - diff),
                "auroc_diff": diff,
                "auroc_diff_ci": _ci(diff),
                "auroc_diff_p": p,
            },
        },
    }


def test_comparisons_outside_the_tables_join_the_holm_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """experiments/probe_mlp/probe_mlp.py's MLP − logistic comparisons were made on the same
    held-out answers; ``--also`` puts them in the one Holm family with the tables'."""
    paths = _results_json(tmp_path, ("builtin", "sciq"))
    features = {
        "probe_concat": {"paired": _mlp_report(0.05, 0.0001)},
        "probe_concat_last": {"paired": _mlp_report(0.01, 0.5)},
    }
    mlp = tmp_path / "probe_mlp.json"
    mlp.write_text(json.dumps({"artifact": "runs/x", "data": "builtin", "features": features}))
    out = tmp_path / "paired_tables.json"
    main([*map(str, paths), "--also", str(mlp), "--json", str(out)])
    md = capsys.readouterr().out
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["family"]["size"] == 2 * 3 * 2 + 2 and "mlp − logistic" in doc["family"]["members"]
    assert doc["sources"][-1]["sha256"] == hashlib.sha256(mlp.read_bytes()).hexdigest()
    # fourteen now: 0.0001·14, 0.0005·13, 0.001·12, ...; the 0.5 of probe_concat_last ≥ 1
    also = [doc["also"][f"builtin {k}: mlp − logistic"]["compared"]["logistic"] for k in features]
    assert [a["auroc_diff_holm_p"] for a in also] == pytest.approx([0.0014, 1.0])
    assert doc["sets"]["builtin"]["scorers"]["perplexity"]["auroc_diff_holm_p"] == pytest.approx(
        0.012
    )
    assert doc["sets"]["sciq"]["scorers"]["probe_upper"]["auroc_diff_holm_p"] == pytest.approx(
        0.0065
    )
    assert also[0]["verdict"] == "reference better" and also[0]["better"] == "mlp"
    assert also[1]["verdict"] == NOT_SIGNIFICANT and also[1]["better"] is None
    assert "builtin probe_concat_last: mlp − logistic" in md
    # a probe_mlp.json without paired reports is refused, not skipped
    for f in features.values():
        f.pop("paired")
    mlp.write_text(json.dumps({"data": "builtin", "features": features}))
    with pytest.raises(SystemExit, match=r"rerun experiments/probe_mlp/probe_mlp\.py"):
        main([*map(str, paths), "--also", str(mlp)])
