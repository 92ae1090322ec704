"""within_type.py: the paired within-type gain and the train/calibration/test redraw.

.venv/bin/pytest -p no:cacheprovider -q experiments
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from abstain_guard.calibration.measure.ranking import scorer_table


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parent / "within_type.py"
    spec = importlib.util.spec_from_file_location("bench_within_type", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


wt = _bench()


def _data(seed: int = 0, n: int = 240) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    groups = np.array(["a", "b", "c", "d"])[rng.integers(0, 4, n)]
    y = rng.random(n) < 0.35
    return groups, y, rng


def test_gain_point_is_the_difference_of_within_type_means() -> None:
    groups, y, rng = _data()
    a = -y.astype(float) + rng.normal(scale=0.8, size=y.size)
    b = -y.astype(float) + rng.normal(scale=1.5, size=y.size)
    table = scorer_table({"a": a, "b": b}, y, groups=groups, n_boot=0)
    expected = table["a"]["within_group"]["mean_auroc"] - table["b"]["within_group"]["mean_auroc"]
    gain = wt.within_type_gain(a, b, y, groups, n_boot=300, seed=0)
    assert gain["delta"] == pytest.approx(expected, abs=1e-3)
    low, high = gain["ci"]
    assert low <= gain["delta"] <= high


def test_gain_of_a_scorer_over_itself_is_exactly_zero() -> None:
    groups, y, rng = _data(1)
    a = rng.normal(size=y.size)
    gain = wt.within_type_gain(a, a, y, groups, n_boot=100, seed=0)
    assert gain == {"delta": 0.0, "ci": [0.0, 0.0]}


def test_gain_skips_types_with_one_class() -> None:
    groups, y, rng = _data(2)
    y[groups == "d"] = True
    a = -y.astype(float) + rng.normal(size=y.size)
    b = rng.normal(size=y.size)
    table = scorer_table({"a": a, "b": b}, y, groups=groups, n_boot=0)
    assert table["a"]["within_group"]["n_groups_used"] == 3
    expected = table["a"]["within_group"]["mean_auroc"] - table["b"]["within_group"]["mean_auroc"]
    assert wt.within_type_gain(a, b, y, groups, 50, 0)["delta"] == pytest.approx(expected, abs=1e-3)


def test_resplit_keeps_reference_and_split_sizes() -> None:
    split = np.array(["reference"] * 5 + ["train"] * 4 + ["calibration"] * 6 + ["test"] * 3)
    data = {"split": split, "correct": np.zeros(split.size, dtype=bool)}
    redrawn = wt.resplit(data, seed=3)["split"]
    assert (redrawn[:5] == "reference").all()
    for name in ("train", "calibration", "test"):
        assert (redrawn == name).sum() == (split == name).sum()
    assert not (redrawn == split).all()
    assert (data["split"] == split).all()  # the input is not modified
    assert (wt.resplit(data, seed=3)["split"] == redrawn).all()


def test_candidates_are_valid_feature_sets() -> None:
    from abstain_guard.scorers.geometry_plus import GeometryPlusScorer

    assert "all" in wt.CANDIDATES
    for family in wt.FAMILIES:
        assert f"-{family}" in wt.CANDIDATES
    for params in wt.CANDIDATES.values():
        GeometryPlusScorer(**params)  # raises on an unknown feature


def test_gain_without_bootstrap_has_no_interval() -> None:
    groups, y, rng = _data(3)
    a = rng.normal(size=y.size)
    assert wt.within_type_gain(a, -a, y, groups, n_boot=0, seed=0)["ci"] is None
