"""calibrate() rejects bad input before any model is loaded."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest

from abstain_guard.calibration.building import pipeline
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.questions.items import (
    check_split_sizes,
    load_items,
    min_calibration_size,
)
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.building.run.store import RunStore, content_key
from abstain_guard.cli import main
from abstain_guard.errors import ConfigError, DatasetError, InsufficientDataError, JudgeError
from abstain_guard.guarantee.conformal import ConformalWarning


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before validation finished")

    monkeypatch.setattr(pipeline, "load_model", fail)


def _items(n: int) -> list[QAItem]:
    return [QAItem(id=f"q{i}", question=f"Question {i}?", answers=(f"a{i}",)) for i in range(n)]


def test_missing_data_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        calibrate(tmp_path / "nope.jsonl", tmp_path / "out", progress=False)


def test_unknown_judge_name(tmp_path: Path) -> None:
    with pytest.raises(JudgeError, match="lexical"):
        calibrate(_items(200), tmp_path / "out", config=CalibrationConfig(judge="oracle"))


def test_too_small_for_participation(tmp_path: Path) -> None:
    cfg = CalibrationConfig(participation=0.95)
    with pytest.raises(InsufficientDataError, match="at least 19"):
        calibrate(_items(60), tmp_path / "out", config=cfg, progress=False)


def test_malformed_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "calib.yaml"
    bad.write_text("judge: lexical\nbatch_sise: 4\n")
    with pytest.raises(ConfigError, match="batch_sise"):
        CalibrationConfig.from_file(bad)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError):
        CalibrationConfig.from_file(broken)


def test_config_file_overrides(tmp_path: Path) -> None:
    path = tmp_path / "calib.json"
    path.write_text(json.dumps({"judge": "lexical", "seed": 3, "batch_size": 4}))
    cfg = CalibrationConfig.from_file(path, seed=7, limit=None)
    assert (cfg.seed, cfg.batch_size, cfg.limit) == (7, 4, None)


def test_unknown_scorer_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="unknown scorer"):
        CalibrationConfig(scorer="vibes")


@pytest.mark.parametrize(("participation", "n"), [(0.5, 1), (0.8, 4), (0.9, 9), (0.95, 19)])
def test_min_calibration_size_is_the_finite_threshold_boundary(participation, n) -> None:
    assert min_calibration_size(participation) == n
    # n gives a finite rank, n - 1 does not
    assert math.ceil(participation * (n + 1) - 1e-9) <= n
    if n > 1:
        assert math.ceil(participation * n - 1e-9) > n - 1


def test_check_split_sizes_message_says_how_many() -> None:
    splits = {"reference": _items(10), "train": _items(6), "calibration": _items(2), "test": []}
    with pytest.raises(InsufficientDataError, match="needs at least 4"):
        check_split_sizes(splits, CalibrationConfig(participation=0.8))


def test_check_split_sizes_warns_when_no_scorer_could_certify_the_risk_target() -> None:
    splits = {"reference": _items(10), "train": _items(6), "calibration": _items(20), "test": []}
    with pytest.warns(ConformalWarning, match=r"too few to certify risk_target=0\.05"):
        check_split_sizes(splits, CalibrationConfig(risk_target=0.05, delta=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConformalWarning)
        check_split_sizes(splits, CalibrationConfig(risk_target=0.5, delta=0.1))
        check_split_sizes(splits, CalibrationConfig())


def test_calibrate_cli_warns_before_loading_the_model(tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text(
        "".join(f'{{"question": "Q{i}?", "answer": "A{i}"}}\n' for i in range(60)),
        encoding="utf-8",
    )
    argv = ["calibrate", "--data", str(data), "--out", str(tmp_path / "g"), "--quiet"]
    # the autouse fixture fails any model load: the warning must come first
    with (
        pytest.raises(AssertionError, match="model was loaded"),
        pytest.warns(ConformalWarning, match="too few to certify"),
    ):
        main([*argv, "--risk-target", "0.05", "--delta", "0.1"])


def test_run_store_roundtrip_and_atomic_batches(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "run.sqlite")
    key = content_key("gen", "fp", [{"role": "human", "content": "hi"}], {"max_new_tokens": 4})
    assert key == content_key(
        "gen", "fp", [{"role": "human", "content": "hi"}], {"max_new_tokens": 4}
    )
    store.put_many("generation", {key: {"text": "hello"}, "k2": {"text": "x"}})
    assert store.get_many("generation", [key, "missing"]) == {key: {"text": "hello"}}
    assert store.count("generation") == 2
    again = RunStore(tmp_path / "run.sqlite")
    assert again.get_many("generation", ["k2"]) == {"k2": {"text": "x"}}


def test_unjudgeable_gold_is_an_error_with_its_line(tmp_path: Path) -> None:
    rows = [{"question": f"Question {i}?", "answer": f"a{i}"} for i in range(40)]
    rows[6]["answer"] = "The"
    rows[17]["answer"] = "---"
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(DatasetError, match=r"2 questions .*q\.jsonl:7, .*q\.jsonl:18"):
        calibrate(path, tmp_path / "out", progress=False)
    with pytest.raises(DatasetError, match="only articles"):
        calibrate(
            [*_items(39), QAItem(id="bad", question="Q?", answers=("the", ""))],
            tmp_path / "out",
            progress=False,
        )


def test_named_public_sets_drop_broken_golds_and_count_them(tmp_path: Path) -> None:
    root = tmp_path / "nq"
    root.mkdir()
    rows = [{"question": f"question {i}", "answer": [f"a{i}"]} for i in range(30)]
    rows[3]["answer"] = ["---"]
    (root / "NQ-open.dev.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8"
    )
    items, skipped = load_items(f"nq_open={root}", CalibrationConfig())
    assert len(items) == 29 and skipped == 1
    assert all(it.line != 4 for it in items)


def test_small_reference_and_train_splits_only_matter_to_a_fitted_scorer() -> None:
    splits = {"reference": _items(1), "train": _items(1), "calibration": _items(6), "test": []}
    with pytest.raises(InsufficientDataError, match="reference split has only 1"):
        check_split_sizes(splits, CalibrationConfig(participation=0.5, scorer="geometry"))
    check_split_sizes(splits, CalibrationConfig(participation=0.5, scorer="perplexity"))
