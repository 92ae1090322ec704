"""GuardArtifact.save is atomic: concurrent writers and a reader never produce or see a
partial artifact, and every failure (read-only disk, hostile manifest or arrays) is typed."""

from __future__ import annotations

import errno
import io
import json
import multiprocessing as mp
import os
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from abstain_guard import GuardArtifact
from abstain_guard.artifact import files as artifact_files
from abstain_guard.artifact import guard_artifact as artifact_module
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.errors import (
    AbstainGuardError,
    ArtifactError,
    ArtifactNotFoundError,
    ArtifactSchemaError,
    ArtifactTooLargeError,
    ArtifactWriteError,
)
from abstain_guard.scorers import PerplexityScorer

N_CAL = 40


def _artifact(writer: int) -> GuardArtifact:
    rng = np.random.default_rng(writer)
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(rng.uniform(1.0, 3.0, N_CAL), rng.uniform(size=N_CAL) > 0.4),
        metadata={"writer": writer, "pad": "x" * (500 * writer)},
    )


def _expected_scores(writer: int) -> np.ndarray:
    return np.random.default_rng(writer).uniform(1.0, 3.0, N_CAL)


def _no_exchange(a: Path, b: Path) -> bool:
    return False


def _writer(path: str, writer: int, saves: int, exchange: bool, queue: Any) -> None:
    if not exchange:
        artifact_files._exchange = _no_exchange  # type: ignore[assignment]
    art = _artifact(writer)
    errors: list[str] = []
    for _ in range(saves):
        try:
            art.save(path, overwrite=True)
        except BaseException as exc:  # recorded: the test asserts there are none
            errors.append(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
    queue.put(("writer", writer, errors))


def _reader(path: str, stop: Any, queue: Any) -> None:
    loads = 0
    bad: list[str] = []
    while not stop.is_set() or loads == 0:
        loads += 1
        try:
            art = GuardArtifact.load(path)
            writer = art.metadata["writer"]
            if not np.array_equal(art.scores, _expected_scores(writer)):
                bad.append(f"scores of writer {writer} do not match its manifest")
        except BaseException as exc:
            typed = isinstance(exc, AbstainGuardError)
            bad.append(f"{'typed' if typed else 'UNTYPED'} {type(exc).__name__}: {exc}")
    queue.put(("reader", loads, bad))


def _context() -> Any:
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


@pytest.mark.parametrize(("exchange", "saves"), [(True, 120), (False, 60)])
def test_concurrent_writers_and_a_reader(tmp_path: Path, exchange: bool, saves: int) -> None:
    """Two processes save different artifacts into one path while a third loads it."""
    target = tmp_path / "guard"
    _artifact(0).save(target)
    ctx = _context()
    queue = ctx.Queue()
    stop = ctx.Event()
    reader = ctx.Process(target=_reader, args=(str(target), stop, queue))
    writers = [
        ctx.Process(target=_writer, args=(str(target), w, saves, exchange, queue)) for w in (1, 2)
    ]
    start = time.monotonic()
    reader.start()
    for proc in writers:
        proc.start()
    for proc in writers:
        proc.join(timeout=120)
    stop.set()
    reader.join(timeout=60)
    results = [queue.get(timeout=10) for _ in range(3)]
    elapsed = time.monotonic() - start

    writer_errors = [e for kind, _, errs in results if kind == "writer" for e in errs]
    (loads, bad) = next((n, errs) for kind, n, errs in results if kind == "reader")
    assert writer_errors == [], writer_errors[:5]
    assert bad == [], f"{len(bad)} of {loads} loads failed: {bad[:5]}"
    assert loads > 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["guard"]  # no staging/aside left
    final = GuardArtifact.load(target)
    assert final.metadata["writer"] in (1, 2)
    assert elapsed < 60


def test_a_killed_save_leaves_nothing_the_next_save_keeps(tmp_path: Path) -> None:
    target = tmp_path / "guard"
    _artifact(1).save(target)
    proc = _context().Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join()
    dead = proc.pid
    for name in (f".guard.tmp-{dead}-abc123", f".guard.old-{dead}", f".guard.old-{dead}-ff00"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{")
    alive = tmp_path / f".guard.tmp-{os.getpid()}-keepme"
    alive.mkdir()
    # a load is not confused by the leftovers
    assert GuardArtifact.load(target).metadata["writer"] == 1
    _artifact(2).save(target, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, "guard"]
    assert GuardArtifact.load(target).metadata["writer"] == 2


def test_saved_layout_is_a_plain_directory(tmp_path: Path) -> None:
    """What today's loader reads: a real directory with the same files, no links."""
    target = _artifact(1).save(tmp_path / "guard")
    _artifact(2).save(target, overwrite=True)
    assert target.is_dir() and not target.is_symlink()
    assert sorted(p.name for p in target.iterdir()) == [
        "calibration.npz",
        "manifest.json",
        "scorer.json",
        "scorer.npz",
    ]
    assert all(p.is_file() and not p.is_symlink() for p in target.iterdir())


def test_missing_artifact_fails_at_once(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ArtifactNotFoundError, match="No artifact directory"):
        GuardArtifact.load(tmp_path / "nothing")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ArtifactNotFoundError, match="No artifact directory"):
        GuardArtifact.load(tmp_path / "a_file")
    (tmp_path / "incomplete").mkdir()
    with pytest.raises(ArtifactNotFoundError, match=r"no manifest\.json"):
        GuardArtifact.load(tmp_path / "incomplete")
    assert time.monotonic() - start < 1.0  # no waiting for a save that is not happening


def test_overwrite_false_still_refuses(tmp_path: Path) -> None:
    _artifact(1).save(tmp_path / "guard")
    with pytest.raises(ArtifactError, match="overwrite=True"):
        _artifact(2).save(tmp_path / "guard")
    assert GuardArtifact.load(tmp_path / "guard").metadata["writer"] == 1


# --- write failures ------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_a_typed_error(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ArtifactWriteError, match="not writable"):
            _artifact(1).save(ro / "guard")
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize(
    ("code", "hint"),
    [(errno.EACCES, "not writable"), (errno.EROFS, "not writable"), (errno.ENOSPC, "disk is full")],
)
def test_os_write_failures_are_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, hint: str
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> str:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(ArtifactWriteError, match=hint) as info:
        _artifact(1).save(tmp_path / "guard")
    assert not isinstance(info.value, OSError)
    assert list(tmp_path.iterdir()) == []


def test_failure_while_publishing_removes_the_staging_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _artifact(1).save(tmp_path / "guard")

    def broken(a: Path, b: Path) -> bool:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(artifact_files, "_exchange", broken)
    with pytest.raises(ArtifactWriteError, match="I/O error"):
        _artifact(2).save(tmp_path / "guard", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["guard"]
    assert GuardArtifact.load(tmp_path / "guard").metadata["writer"] == 1


# --- hostile content -------------------------------------------------------------------------


def test_deeply_nested_manifest_is_a_schema_error(tmp_path: Path) -> None:
    root = _artifact(1).save(tmp_path / "guard")
    text = (root / "manifest.json").read_text().rstrip()
    depth = 200_000
    (root / "manifest.json").write_text(text[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ArtifactSchemaError, match="nested too deeply"):
        GuardArtifact.load(root)


def _forge_calibration(root: Path, npz: bytes) -> None:
    """Replace calibration.npz and re-sign the manifest, as a forger would."""
    import hashlib

    (root / "calibration.npz").write_bytes(npz)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.pop("manifest_sha256")
    manifest["checksums"]["calibration.npz"] = hashlib.sha256(npz).hexdigest()
    manifest["sizes"]["calibration.npz"] = len(npz)
    canon = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    manifest["manifest_sha256"] = hashlib.sha256(canon).hexdigest()
    (root / "manifest.json").write_text(json.dumps(manifest))


def _npz_with_header_only(shape: tuple[int, ...]) -> bytes:
    """A tiny npz whose 'scores' header claims ``shape`` float64 (the data never follows)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": shape}
    )
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("scores.npy", header.getvalue())
        archive.writestr("correct.npy", header.getvalue())
    return buf.getvalue()


def test_npz_claiming_a_gigabyte_is_refused_before_allocating(tmp_path: Path) -> None:
    root = _artifact(1).save(tmp_path / "guard")
    _forge_calibration(root, _npz_with_header_only((2**27,)))  # 1 GiB of float64
    with pytest.raises(ArtifactTooLargeError, match="max_array_bytes") as info:
        GuardArtifact.load(root)
    assert isinstance(info.value, ArtifactSchemaError)


def test_highly_compressed_npz_over_the_limit(tmp_path: Path) -> None:
    root = _artifact(1).save(tmp_path / "guard")
    buf = io.BytesIO()
    np.savez_compressed(buf, scores=np.ones(2_000_000), correct=np.ones(2_000_000, dtype=bool))
    _forge_calibration(root, buf.getvalue())  # ~18 MB inflated from ~40 kB
    with pytest.raises(ArtifactTooLargeError, match="inflate"):
        GuardArtifact.load(root, max_array_bytes=10 * 2**20)


def test_limit_is_configurable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _artifact(1).save(tmp_path / "guard")
    with pytest.raises(ArtifactTooLargeError):
        GuardArtifact.load(root, max_array_bytes=100)
    assert GuardArtifact.load(root).n == N_CAL
    monkeypatch.setattr(artifact_module, "MAX_ARRAY_BYTES", 100)
    with pytest.raises(ArtifactTooLargeError):
        GuardArtifact.load(root)


def test_a_target_moved_aside_mid_check_counts_as_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename fallback moves the artifact aside for a moment; a concurrent save that
    checks the target in that moment must not call it "not a directory"."""
    target = tmp_path / "guard"
    _artifact(1).save(target)
    real_iterdir = Path.iterdir

    def vanishing_iterdir(self: Path) -> Any:
        if self == target:
            os.rename(target, tmp_path / ".guard.old-moved")  # another writer, mid-check
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", vanishing_iterdir)
    artifact_files.check_target(target, overwrite=True)  # no error: the target is absent
    monkeypatch.undo()
    _artifact(2).save(target, overwrite=True)
    assert GuardArtifact.load(target).metadata["writer"] == 2
