"""Reading one consistent artifact while a save may be replacing it (docs/architecture.md,
"Artifact"): the directory is opened once and every file read relative to that descriptor;
a load that finds its directory replaced starts again. Also: appending to its ledger.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from abstain_guard.artifact.files import (
    CALIBRATION,
    FORMAT_NAME,
    LEDGER,
    MANIFEST,
    READ_RETRY_SECONDS,
    SAFE_FILE_NAME,
    SCHEMA_VERSION,
    SCORER_JSON,
    SCORER_NPZ,
    canonical_json,
    parse_json,
    save_in_progress,
    sha256_hex,
    write_error,
)
from abstain_guard.errors import (
    ArtifactError,
    ArtifactIntegrityError,
    ArtifactNotFoundError,
    ArtifactSchemaError,
)


class _Snapshot:
    """One artifact directory, opened once: every file is read relative to that descriptor,
    so a concurrent exchange cannot mix two artifacts into one load."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd: int | None = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        st = os.fstat(self._fd)
        self.ident = (st.st_dev, st.st_ino)

    def read(self, name: str) -> bytes | None:
        """The file's bytes, or None when it does not exist (or is not a regular file).

        Raises:
            OSError: it exists but cannot be read (permissions, I/O).
        """
        try:
            fd = os.open(name, os.O_RDONLY, dir_fd=self._fd)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory: fdopen would refuse it
            os.close(fd)
            return None
        with os.fdopen(fd, "rb") as fh:
            return fh.read()

    def exists(self, name: str) -> bool:
        """True when ``name`` exists in the directory, whatever it is."""
        try:
            os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def replaced(self) -> bool:
        """True when the path no longer names the directory this snapshot reads."""
        try:
            st = os.stat(self.root)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.ident

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _not_found(root: Path) -> ArtifactNotFoundError:
    return ArtifactNotFoundError(
        f"No artifact directory at {str(root)!r}. Run calibration first (abstain-guard "
        "calibrate) or pass the directory GuardArtifact.save wrote."
    )


def _open_snapshot(root: Path) -> _Snapshot:
    """Open ``root``; raises _Retry when it is missing only because a save is replacing it."""
    if not root.is_dir():
        # the rename fallback of a save: the directory is missing between its two renames.
        # Siblings first, then the directory again: a save that finished between the two
        # looks (no siblings left) has put the directory back.
        if save_in_progress(root) or root.is_dir():
            raise _Retry(_not_found(root))
        raise _not_found(root)
    try:
        return _Snapshot(root)
    except FileNotFoundError as exc:
        raise _Retry(_not_found(root)) from exc
    except OSError as exc:
        raise ArtifactNotFoundError(
            f"Could not open the artifact directory {str(root)!r} ({exc.strerror or exc})."
        ) from exc


class _Retry(Exception):
    """A read failed because a concurrent save replaced the directory: read again."""

    def __init__(self, error: ArtifactError) -> None:
        super().__init__(str(error))
        self.error = error


def _verified_manifest(snap: _Snapshot) -> dict[str, Any]:
    root = snap.root
    raw = snap.read(MANIFEST)
    if raw is None:
        raise ArtifactNotFoundError(
            f"{str(root)!r} has no {MANIFEST}: it is not an artifact, or it is incomplete."
        )
    try:
        manifest = parse_json(raw, f"{MANIFEST} in {str(root)!r}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactIntegrityError(
            f"{MANIFEST} in {str(root)!r} is not valid JSON ({exc}): the artifact is "
            "corrupted or truncated. Re-create or re-copy it."
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ArtifactSchemaError(
            f"{MANIFEST} in {str(root)!r} is not an abstain_guard artifact manifest."
        )
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactSchemaError(
            f"Artifact schema version {version!r} is not supported (this abstain_guard reads "
            f"version {SCHEMA_VERSION}). Upgrade abstain_guard or re-create the artifact."
        )
    claimed = manifest.pop("manifest_sha256", None)
    try:
        actual = sha256_hex(canonical_json(manifest))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ArtifactSchemaError(f"{MANIFEST} holds non-JSON values: {exc}") from exc
    if claimed != actual:
        raise ArtifactIntegrityError(
            f"{MANIFEST} in {str(root)!r} was modified (its checksum does not match). "
            "Re-create or re-copy the artifact."
        )
    _check_manifest_files(manifest)
    return manifest


def _check_manifest_files(manifest: Mapping[str, Any]) -> None:
    checksums = manifest.get("checksums")
    if not isinstance(checksums, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
    ):
        raise ArtifactSchemaError(f"{MANIFEST} has no valid 'checksums' mapping.")
    missing_required = sorted({CALIBRATION, SCORER_JSON, SCORER_NPZ} - set(checksums))
    if missing_required:
        raise ArtifactSchemaError(f"{MANIFEST} does not list required files {missing_required}.")
    for name in checksums:
        if not SAFE_FILE_NAME.match(name) or name == MANIFEST:
            raise ArtifactSchemaError(f"{MANIFEST} lists an invalid file name {name!r}.")


def _read_files(snap: _Snapshot, manifest: Mapping[str, Any]) -> dict[str, bytes]:
    data: dict[str, bytes] = {}
    for name, digest in sorted(manifest["checksums"].items()):
        blob = snap.read(name)
        if blob is None:
            raise ArtifactNotFoundError(
                f"Artifact file {name!r} is missing from {str(snap.root)!r}. Re-copy the whole "
                "artifact directory."
            )
        if sha256_hex(blob) != digest:
            raise ArtifactIntegrityError(
                f"Artifact file {name!r} in {str(snap.root)!r} does not match its checksum (it "
                "was modified or truncated). Re-create or re-copy the artifact."
            )
        data[name] = blob
    return data


def _read_once(root: Path, with_files: bool) -> tuple[dict[str, Any], dict[str, bytes]]:
    snap = _open_snapshot(root)
    try:
        manifest = _verified_manifest(snap)
        files = _read_files(snap, manifest) if with_files else {}
        ledger = _read_ledger(snap) if with_files else None
        if ledger is not None:  # unchecked: appended to after publication
            files[LEDGER] = ledger
        return manifest, files
    except (ArtifactNotFoundError, ArtifactIntegrityError) as exc:
        if snap.replaced():  # a concurrent save replaced (and removed) what we were reading
            raise _Retry(exc) from exc
        raise
    finally:
        snap.close()


def _read_ledger(snap: _Snapshot) -> bytes | None:
    """The selection ledger's bytes, None when the artifact has none. One that exists but
    cannot be read is refused: the looks it records would go uncounted (K too small, the
    certificate stated at a level it does not hold)."""
    path = str(snap.root / LEDGER)
    try:
        blob = snap.read(LEDGER)
    except OSError as exc:
        reason = exc.strerror or str(exc)
    else:
        if blob is not None or not snap.exists(LEDGER):
            return blob
        reason = "it is not a regular file"
    raise ArtifactSchemaError(
        f"The selection ledger {path!r} exists but cannot be read ({reason}); the scorers it "
        "records cannot be counted in K, so no certificate can be stated. Make it a readable "
        "file of JSON lines (docs/guarantees.md, the selection ledger) or restore it from a "
        "copy of the artifact."
    )


def read_consistent(root: Path, with_files: bool) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The verified manifest (and files, with the unchecked :data:`LEDGER` when there is one)
    of one complete artifact at ``root``, read again while concurrent saves replace it (up to
    READ_RETRY_SECONDS)."""
    deadline = time.monotonic() + READ_RETRY_SECONDS
    delay = 0.001
    while True:
        try:
            return _read_once(root, with_files)
        except _Retry as retry:
            if time.monotonic() > deadline:
                raise retry.error from None
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def append_ledger(root: Path, text: str) -> None:
    """Append ``text`` (whole JSON lines) to the artifact's :data:`LEDGER` and fsync it.

    Raises:
        ArtifactNotFoundError: ``root`` is not an artifact directory.
        ArtifactWriteError: the file cannot be written (a read-only install, a full disk).
    """
    if not (root / MANIFEST).is_file():
        raise _not_found(root)
    try:
        with open(root / LEDGER, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise write_error(root / LEDGER, exc) from exc
