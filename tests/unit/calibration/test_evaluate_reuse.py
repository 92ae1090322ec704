"""``evaluate`` right after ``calibrate`` reuses the calibration run's cache, read-only.

On the tiny random-weight Llama (a geometry artifact of 60 questions): evaluating generates
no answer and asks no judge that calibration already did, and every file of the calibration
cache is byte-identical afterwards (no row, no journal file); ``--no-reuse-calibration-cache``
and a moved cache generate again (the counters can fail); ``--cache-dir`` uses that cache
alone. The read-only store and the layered store are checked on their own too.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import ITEMS, HashJudge, _judges
from test_calibration_capture import CountingChatModel, _counting, _geo_config

from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.calibration.building.judges.cache import CachedJudge, JudgmentCache
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.run.lock import RunLock, lock_holder, lock_path
from abstain_guard.calibration.building.run.store import LayeredStore, RunStore
from abstain_guard.calibration.measure import evaluate as evaluate_module
from abstain_guard.calibration.measure import held_out
from abstain_guard.calibration.measure.cache_reuse import evaluate_cache
from abstain_guard.calibration.measure.evaluate import EvaluateOptions, evaluate
from abstain_guard.cli import commands as cli
from abstain_guard.errors import CacheError


def _snapshot(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory`` (journal files included)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A geometry artifact ``geo`` calibrated from a file, its cache at the default place
    (``geo.cache``), and the snapshot of that cache right after calibration."""
    tmp = tmp_path_factory.mktemp("reuse")
    data = tmp / "questions.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": it.id, "question": it.question, "answer": it.answers[0]}) + "\n"
            for it in ITEMS
        ),
        encoding="utf-8",
    )
    model, judges = _counting(), _judges(tmp, "geo", HashJudge())
    calibrate(
        str(data),
        tmp / "geo",
        config=_geo_config(tmp, "geo"),
        model=model,
        judges=judges,
        progress=False,
    )
    assert model.generated() == 60  # every question answered once
    judges["open"].cache.close()  # as the calibrate command's exit does
    gc.collect()
    assert not list((tmp / "geo.cache").glob("*-wal"))  # every row is in the files
    return tmp, _snapshot(tmp / "geo.cache")


def _eval_judges(out: Path, cache: Any, judge: HashJudge) -> dict[str, Any]:
    """The calibration's (hash) judge behind the evaluation's judgment cache, reading the
    calibration's verdicts below it (what build_judges does for the artifact's judge)."""
    cached = CachedJudge(judge, JudgmentCache(out / "judgments.sqlite", read_from=cache.judgments))
    return {"open": cached, "choice": cached, "numeric": cached}


def test_evaluate_after_calibrate_generates_and_judges_nothing_new(
    calibrated: tuple[Path, dict[str, str]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tmp, before = calibrated
    art = GuardArtifact.load(tmp / "geo")
    model, judge = _counting(), HashJudge()
    cache = evaluate_cache(tmp_path / "rep" / "cache", art, tmp / "geo")
    assert cache.reused_from == tmp / "geo.cache"
    caplog.set_level(logging.INFO, logger="abstain_guard.calibration")
    results = evaluate(
        tmp / "geo",
        tmp_path / "rep",
        options=EvaluateOptions(baselines="none", n_resplits=20, importance_repeats=1),
        progress=False,
        model=model,
        judges=_eval_judges(tmp_path / "rep" / "cache", cache, judge),
    )
    assert model.generated() == 0  # held-out (12) and train (18) answers all reused
    assert judge.calls == 0  # and their verdicts
    assert _snapshot(tmp / "geo.cache") == before  # the calibration cache was only read
    own = RunStore(tmp_path / "rep" / "cache" / "run.sqlite")
    assert own.count("generation") == 0  # nothing new to write
    assert any("Reused 30 answers" in r.getMessage() for r in caplog.records)
    entry = results["datasets"]["questions"]
    assert entry["n"] == 12  # the artifact's calibration + test questions


def test_cli_reuses_by_default_and_not_when_told(
    calibrated: tuple[Path, dict[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``abstain-guard evaluate``: no answer generated and no verdict asked by default; with
    ``--no-reuse-calibration-cache`` all 30 are; the calibration cache is byte-identical
    throughout; ``--cache-dir`` is read and written alone. (The tiny model answers random
    characters: the hash judge stands in for the artifact's lexical one, built as
    ``build_judges`` builds it, over the calibration verdicts it is handed.)"""
    tmp, before = calibrated
    models: list[CountingChatModel] = []
    judges: list[HashJudge] = []

    def load(cfg: Any) -> CountingChatModel:
        models.append(_counting())
        return models[-1]

    def hash_judges(cfg: Any, path: Path, chat_models: Any = None, *, read_from: Any = ()):
        judges.append(HashJudge())
        cached = CachedJudge(judges[-1], JudgmentCache(path, read_from=read_from))
        return {"open": cached, "choice": cached, "numeric": cached}

    monkeypatch.setattr(evaluate_module, "load_model", load)
    monkeypatch.setattr(held_out, "build_judges", hash_judges)
    monkeypatch.chdir(tmp_path)
    base = ["evaluate", "--artifact", str(tmp / "geo"), "--baselines", "none", "--quiet"]
    base += ["--resplits", "20"]
    assert cli.run([*base, "--out", "rep"]) == 0
    assert models[-1].generated() == 0 and judges[-1].calls == 0
    assert cli.run([*base, "--out", "rep2", "--no-reuse-calibration-cache"]) == 0
    assert models[-1].generated() == 30  # 12 held-out one per call + 18 train
    assert judges[-1].calls == 30
    assert RunStore(tmp_path / "rep2" / "cache" / "run.sqlite").count("generation") == 30
    assert cli.run([*base, "--out", "rep3", "--cache-dir", "mine"]) == 0
    assert models[-1].generated() == 30  # an explicit cache is the only one read
    assert (tmp_path / "mine" / "run.sqlite").is_file() and not (
        tmp_path / "rep3" / "cache"
    ).exists()
    assert _snapshot(tmp / "geo.cache") == before
    first = json.loads((tmp_path / "rep" / "results.json").read_text())
    again = json.loads((tmp_path / "rep2" / "results.json").read_text())
    scores = first["datasets"]["questions"]["scorers"]
    assert scores == again["datasets"]["questions"]["scorers"]  # same answers, same numbers


def test_a_moved_or_busy_calibration_cache_is_not_read(
    calibrated: tuple[Path, dict[str, str]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tmp, _ = calibrated
    art = GuardArtifact.load(tmp / "geo")
    moved = tmp_path / "elsewhere.cache"
    shutil.copytree(tmp / "geo.cache", moved)
    gone = GuardArtifact(
        art.scorer,
        CalibrationSet(art.scores, art.correct),
        model_fingerprint=art.model_fingerprint,
        metadata={**art.metadata, "cache_dir": str(tmp_path / "missing")},
    )
    with caplog.at_level(logging.WARNING, logger="abstain_guard.calibration"):
        cache = evaluate_cache(tmp_path / "ev", gone, tmp_path / "art")
    assert cache.reused_from is None and not cache.runs
    assert any("is not at" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "missing").exists()
    # the default place beside the artifact is found when the recorded one is gone
    beside = evaluate_cache(tmp_path / "ev", gone, tmp_path / "elsewhere")
    assert beside.reused_from == moved
    # a running calibration holds the cache's lock: not read
    caplog.clear()
    with RunLock(lock_path(moved), "the cache"), caplog.at_level(logging.WARNING):
        assert lock_holder(lock_path(moved)) == os.getpid()
        busy = evaluate_cache(tmp_path / "ev", gone, tmp_path / "elsewhere")
    assert busy.reused_from is None
    assert any("running calibration" in r.getMessage() for r in caplog.records)
    assert lock_holder(lock_path(moved)) is None
    assert evaluate_cache(tmp_path / "ev", art, tmp / "geo", reuse=False).reused_from is None


# --- the stores on their own ----------------------------------------------------------------


def test_read_only_store_writes_nothing(tmp_path: Path) -> None:
    below = RunStore(tmp_path / "cal" / "run.sqlite")
    below.put_many("generation", {"a": {"text": "x"}, "b": {"text": "y"}})
    below.put_arrays("states", "a", {"omega": np.arange(3.0)})
    below.close()
    del below
    before = _snapshot(tmp_path / "cal")
    read_only = RunStore(tmp_path / "cal" / "run.sqlite", read_only=True)
    layered = LayeredStore(tmp_path / "ev" / "run.sqlite", read_from=[read_only])
    assert layered.get_many("generation", ["a", "b", "c"]) == {
        "a": {"text": "x"},
        "b": {"text": "y"},
    }
    assert layered.reused == {"generation": 2}
    np.testing.assert_array_equal(layered.get_arrays("states", "a")["omega"], np.arange(3.0))
    assert layered.has_arrays("states", ["a", "z"]) == {"a"}
    layered.put_many("generation", {"c": {"text": "z"}})
    assert layered.count() == 1 and read_only.count("generation") == 2  # writes: top only
    with pytest.raises(CacheError, match="read-only"):
        read_only.put_many("generation", {"d": 1})
    with pytest.raises(CacheError, match="read-only"):
        read_only.put_arrays("states", "d", {"omega": np.zeros(1)})
    layered.close()
    assert _snapshot(tmp_path / "cal") == before  # not even a -wal / -shm file
    with pytest.raises(CacheError, match="does not exist"):
        RunStore(tmp_path / "nowhere" / "run.sqlite", read_only=True)
    assert not (tmp_path / "nowhere").exists()


def test_an_edited_lower_row_is_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    below = RunStore(tmp_path / "cal.sqlite")
    below.put_many("generation", {"a": 1})
    below.close()
    conn = sqlite3.connect(tmp_path / "cal.sqlite")
    with conn:
        conn.execute("UPDATE kv SET value = '2' WHERE key = 'a'")
    conn.close()  # the edit checkpointed into the file
    layered = LayeredStore(
        tmp_path / "ev.sqlite", read_from=[RunStore(tmp_path / "cal.sqlite", read_only=True)]
    )
    with caplog.at_level(logging.WARNING):
        assert layered.get_many("generation", ["a"]) == {}  # never the edited value
    assert not layered.read_from
    assert any("Not reading" in r.getMessage() for r in caplog.records)


def test_a_cache_of_another_format_is_not_read_read_only(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "old.sqlite")
    with conn:
        conn.execute("CREATE TABLE kv (ns TEXT, key TEXT, value TEXT, PRIMARY KEY (ns, key))")
        conn.execute("INSERT INTO kv VALUES ('generation', 'a', '1')")
    conn.close()
    before = (tmp_path / "old.sqlite").read_bytes()
    with pytest.raises(CacheError, match="format version 0"):
        RunStore(tmp_path / "old.sqlite", read_only=True)
    assert (tmp_path / "old.sqlite").read_bytes() == before


def test_rows_still_in_a_write_ahead_log_are_read_from_a_snapshot(tmp_path: Path) -> None:
    """A writer still open (or killed) leaves rows in ``run.sqlite-wal``: they are read from a
    private copy, and the cache's files (log and index included) stay byte-identical."""
    writer = RunStore(tmp_path / "cal" / "run.sqlite")
    writer.put_many("generation", {"a": {"text": "x"}})  # committed, not yet checkpointed
    assert (tmp_path / "cal" / "run.sqlite-wal").stat().st_size > 0
    before = _snapshot(tmp_path / "cal")
    read_only = RunStore(tmp_path / "cal" / "run.sqlite", read_only=True)
    assert read_only.get_many("generation", ["a"]) == {"a": {"text": "x"}}
    read_only.close()
    assert _snapshot(tmp_path / "cal") == before
    writer.close()
