"""paired_tables.py: the tables and the audited JSON from ``abstain-guard evaluate`` results, one
Holm family across every results.json and every ``--also`` comparison.

    .venv/bin/pytest -p no:cacheprovider -q bench
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paired_tables import main

from abstain_guard.calibration.measure.paired import holm_adjust, paired_report


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
    paths = _results_json(tmp_path, ("builtin", "sciq"))
    out = tmp_path / "paired_tables.json"
    main([*map(str, paths), "--json", str(out)])
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
    [path] = _results_json(tmp_path, ("builtin",))
    doc = json.loads(path.read_text())
    for p in doc["datasets"]["builtin"]["paired"]["scorers"].values():
        p.pop("auroc_diff_p", None)
        p.pop("within_diff_p", None)
    path.write_text(json.dumps(doc))
    out = tmp_path / "t.json"
    main([str(path), "--json", str(out)])
    assert "no paired p-values" in capsys.readouterr().err
    got = json.loads(out.read_text())
    assert got["family"]["size"] == 0
    assert got["sets"]["builtin"]["scorers"]["perplexity"]["auroc_diff_holm_p"] is None


def test_comparisons_outside_the_tables_join_the_holm_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """experiments/probe_mlp/probe_mlp.py's MLP − logistic comparisons were made on the same
    held-out answers; ``--also`` puts them in the one Holm family with the tables'."""
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
    main([*map(str, paths), "--also", str(mlp), "--json", str(out)])
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
    with pytest.raises(SystemExit, match=r"rerun experiments/probe_mlp/probe_mlp\.py"):
        main([*map(str, paths), "--also", str(mlp)])
