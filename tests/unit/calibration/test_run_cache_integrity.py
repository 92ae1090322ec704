"""One calibration per output (the run lock) and integrity-checked run/judgment caches:
a damaged, truncated or edited cache is a typed error naming the file, raised before any
model loads; never silently trusted, never silently discarded."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from abstain_guard.calibration.building import pipeline
from abstain_guard.calibration.building.judges import Judge, Judgment
from abstain_guard.calibration.building.judges.cache import CachedJudge, JudgmentCache
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.building.run.lock import RunLock, run_locks
from abstain_guard.calibration.building.run.store import RunStore
from abstain_guard.errors import CacheError, CalibrationError, CalibrationLockedError


class ModelWouldLoad(Exception):
    """Raised by the patched load_model: everything before the model load passed."""


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise ModelWouldLoad

    monkeypatch.setattr(pipeline, "load_model", fail)


def _items(n: int = 200) -> list[QAItem]:
    return [QAItem(id=f"q{i}", question=f"Question {i}?", answers=(f"a{i}",)) for i in range(n)]


def _calibrate(tmp: Path) -> None:
    calibrate(_items(), tmp / "guard", progress=False)


def _no_lock_files(tmp: Path) -> bool:
    return not list(tmp.glob("*.lock"))


# --- the run lock ----------------------------------------------------------------------------

# Another run, holding both locks the way RunLock takes them (flock + its PID in the file),
# without importing abstain_guard (so the test does not wait for a second interpreter's imports).
_HOLDER = """
import fcntl, os, sys, time
fds = []
for target in sys.argv[1:]:
    fd = os.open(target.rstrip("/") + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"{os.getpid()}\\n".encode())
    fds.append(fd)
print("locked", flush=True)
time.sleep(60)
"""


def _hold_locks(out: Path, cache: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out), str(cache)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_second_run_on_the_same_output_fails_fast_naming_the_pid(tmp_path: Path) -> None:
    holder = _hold_locks(tmp_path / "guard", tmp_path / "guard.cache")
    try:
        start = time.monotonic()
        with pytest.raises(CalibrationLockedError, match=f"PID {holder.pid}") as info:
            _calibrate(tmp_path)
        assert time.monotonic() - start < 2.0
        assert info.value.pid == holder.pid
        assert info.value.lock_path == str(tmp_path / "guard.lock")
        assert "--out" in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    # killed without cleanup: its lock file stays, but holds no lock: taken over
    assert (tmp_path / "guard.lock").read_text().strip() == str(holder.pid)
    with pytest.raises(ModelWouldLoad):
        _calibrate(tmp_path)
    assert _no_lock_files(tmp_path)


def test_same_cache_dir_with_another_output_is_locked_too(tmp_path: Path) -> None:
    cache = tmp_path / "shared.cache"
    holder = _hold_locks(tmp_path / "other", cache)
    try:
        cfg = CalibrationConfig(cache_dir=str(cache))
        with pytest.raises(CalibrationLockedError, match=str(holder.pid)):
            calibrate(_items(), tmp_path / "guard", config=cfg, progress=False)
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_file_with_a_dead_pid_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "guard.lock").write_text(f"{dead.pid}\n")
    (tmp_path / "guard.cache.lock").write_text(f"{dead.pid}\n")
    with pytest.raises(ModelWouldLoad):
        _calibrate(tmp_path)
    assert _no_lock_files(tmp_path)


def test_lock_released_on_keyboard_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "load_model", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _calibrate(tmp_path)
    assert _no_lock_files(tmp_path)
    with pytest.raises(KeyboardInterrupt):  # and can be taken again
        _calibrate(tmp_path)


def test_lock_in_the_same_process_is_exclusive(tmp_path: Path) -> None:
    locked = pytest.raises(CalibrationLockedError, match=f"PID {os.getpid()}")
    with RunLock(tmp_path / "x.lock", "x"), locked:
        RunLock(tmp_path / "x.lock", "x").acquire()
    with run_locks(tmp_path / "x", tmp_path / "x.cache"):
        pass
    assert _no_lock_files(tmp_path)


def test_unwritable_lock_location_is_typed(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CalibrationError, match="lock file"):
        RunLock(blocker / "sub" / "x.lock", "x").acquire()


# --- damaged caches: typed, before the model loads -------------------------------------------


@pytest.mark.parametrize("name", ["run.sqlite", "judgments.sqlite"])
def test_random_bytes_cache_is_an_error_before_the_model_loads(tmp_path: Path, name: str) -> None:
    cache = tmp_path / "guard.cache"
    cache.mkdir()
    (cache / name).write_bytes(os.urandom(16384))
    with pytest.raises(CacheError, match=f"{name} is not a usable SQLite.*delete it: .*{name}"):
        _calibrate(tmp_path)
    assert _no_lock_files(tmp_path)


@pytest.mark.parametrize("name", ["run.sqlite", "judgments.sqlite"])
def test_zero_byte_cache_is_an_error_not_a_fresh_start(tmp_path: Path, name: str) -> None:
    cache = tmp_path / "guard.cache"
    cache.mkdir()
    (cache / name).write_bytes(b"")
    with pytest.raises(CacheError, match=r"empty \(0 bytes\).*delete it"):
        _calibrate(tmp_path)
    assert (cache / name).stat().st_size == 0  # left for the user to inspect or delete


def test_first_run_creates_complete_caches(tmp_path: Path) -> None:
    with pytest.raises(ModelWouldLoad):
        _calibrate(tmp_path)
    cache = tmp_path / "guard.cache"
    for name in ("run.sqlite", "judgments.sqlite"):
        assert (cache / name).stat().st_size > 0
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []
    with pytest.raises(ModelWouldLoad):  # and a second run opens them fine
        _calibrate(tmp_path)


def _filled_store(path: Path, n: int = 400) -> None:
    store = RunStore(path)
    store.put_many("gen", {f"k{i}": {"text": "x" * 200, "i": i} for i in range(n)})
    store.close()


def test_damaged_page_fails_quick_check(tmp_path: Path) -> None:
    path = tmp_path / "run.sqlite"
    _filled_store(path)
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page : 3 * page] = os.urandom(page)  # a b-tree page in the middle
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"run\.sqlite") as info:
        RunStore(path)
    assert "delete it" in str(info.value)


# --- edited rows -------------------------------------------------------------------------------


def _edit(path: Path, sql: str, *args: object) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(sql, args)
    conn.close()


def test_edited_cached_answer_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.sqlite"
    store = RunStore(path)
    store.put_many("gen", {"k1": {"text": "Lima"}, "k2": {"text": "Quito"}})
    store.close()
    _edit(path, "UPDATE kv SET value = ? WHERE key = 'k1'", json.dumps({"text": "Paris"}))
    store = RunStore(path)
    assert store.get_many("gen", ["k2"]) == {"k2": {"text": "Quito"}}
    with pytest.raises(CacheError, match=f"gen/k1.*checksum.*delete it: {path}"):
        store.get_many("gen", ["k1", "k2"])
    store.close()


def test_row_with_its_checksum_removed_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "run.sqlite"
    store = RunStore(path)
    store.put_many("gen", {"k1": {"text": "Lima"}})
    store.close()
    _edit(path, "DELETE FROM kv_sha256")
    with pytest.raises(CacheError, match="checksum"):
        RunStore(path).get_many("gen", ["k1"])


def test_row_moved_to_another_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "run.sqlite"
    store = RunStore(path)
    store.put_many("gen", {"k1": {"text": "Lima"}})
    store.close()
    _edit(path, "UPDATE kv SET key = 'k9'")
    with pytest.raises(CacheError, match="gen/k9"):
        RunStore(path).get_many("gen", ["k9"])


class CountingJudge(Judge):
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def judge(self, question, gold_answers, prediction, *, choices=()) -> Judgment:  # type: ignore[no-untyped-def]
        self.calls += 1
        return Judgment(correct=True, score=1.0, rationale="ok")


def test_edited_verdict_is_an_error_not_a_silent_flip(tmp_path: Path) -> None:
    path = tmp_path / "judgments.sqlite"
    inner = CountingJudge()
    judge = CachedJudge(inner, JudgmentCache(path))
    assert judge.judge("Q?", ["a"], "a").correct is True
    judge.cache.close()
    _edit(path, "UPDATE kv SET value = replace(value, 'true', 'false')")
    judge = CachedJudge(inner, JudgmentCache(path))
    with pytest.raises(CacheError, match=r"judgments\.sqlite"):
        judge.judge("Q?", ["a"], "a")
    assert inner.calls == 1


# --- the format version ------------------------------------------------------------------


def test_newer_cache_format_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "run.sqlite"
    RunStore(path).close()
    _edit(path, "PRAGMA user_version = 7")
    with pytest.raises(CacheError, match="format version 7"):
        RunStore(path)
