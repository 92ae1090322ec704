"""How an artifact lives on disk: the file names and their encodings (canonical JSON, ``.npz``
without pickle, size checks from the headers) and atomic publication of a new version
(docs/architecture.md, "Artifact"; reading: :mod:`.reading`). Every failure is an
:class:`~abstain_guard.errors.ArtifactError` (a read-only or full disk:
:class:`~abstain_guard.errors.ArtifactWriteError`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from abstain_guard.errors import (
    ArtifactError,
    ArtifactSchemaError,
    ArtifactTooLargeError,
    ArtifactWriteError,
    InvalidInputError,
)

logger = logging.getLogger("abstain_guard")

SCHEMA_VERSION = 1
FORMAT_NAME = "abstain_guard.artifact"
MANIFEST = "manifest.json"
CALIBRATION = "calibration.npz"
SCORER_JSON = "scorer.json"
SCORER_NPZ = "scorer.npz"
LEDGER = "ledger.jsonl"
"""Optional, outside the checksums: the selection ledger, appended to after publication."""


@dataclass(frozen=True)
class SideFile:
    """An optional ``.npz`` beside ``calibration.npz`` holding one field of the calibration
    set under ``key``."""

    field: str
    name: str
    key: str


SIDE_FILES = (
    SideFile("action_statistic", "action_risk.npz", "statistic"),
    SideFile("stream_first", "stream.npz", "first"),
    SideFile("human", "review.npz", "human"),
)
"""The calibration set's optional arrays, one file each (shapes: :class:`~abstain_guard.
artifact.calibration_set.CalibrationSet`)."""
RESERVED_FILE_NAMES = {
    LEDGER,
    MANIFEST,
    CALIBRATION,
    SCORER_JSON,
    SCORER_NPZ,
    *(side.name for side in SIDE_FILES),
}
SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: Default cap on the uncompressed bytes of one ``.npz`` file's arrays at load (512 MiB).
#: Override per call (``GuardArtifact.load(..., max_array_bytes=...)``) or here.
MAX_ARRAY_BYTES = 512 * 2**20
#: How long a load retries while a concurrent save replaces the artifact it is reading.
READ_RETRY_SECONDS = 10.0


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    for name, arr in arrays.items():
        if np.asarray(arr).dtype.hasobject:
            raise InvalidInputError(
                f"Array {name!r} has dtype object, which cannot be stored without pickle. "
                "Convert it to a numeric or fixed-width string array."
            )
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})  # type: ignore[arg-type]
    return buf.getvalue()


def _npy_nbytes(member: IO[bytes]) -> int:
    """Bytes the array in one ``.npy`` member would occupy, from its header alone."""
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(member)
    else:
        raise ValueError(f"unsupported .npy format version {version}")
    return math.prod(int(d) for d in shape) * int(dtype.itemsize)


def _check_npz_size(data: bytes, name: str, limit: int) -> None:
    """Raise ArtifactTooLargeError when the archive's arrays would inflate past ``limit``."""
    total = 0
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            with archive.open(info) as member:
                size = _npy_nbytes(member) if info.filename.endswith(".npy") else info.file_size
            total += max(size, 0)
            if total > limit:
                raise ArtifactTooLargeError(
                    f"{name} would inflate to more than {limit:,} bytes (member "
                    f"{info.filename!r} alone: {size:,} bytes; {len(data):,} bytes on disk). "
                    "An artifact this large is damaged or hostile: re-create it. If you trust it, "
                    "load it with GuardArtifact.load(..., max_array_bytes=<bytes>)."
                )


def load_npz(data: bytes, name: str, limit: int = MAX_ARRAY_BYTES) -> dict[str, np.ndarray]:
    try:
        _check_npz_size(data, name, limit)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except ArtifactError:
        raise
    except Exception as exc:  # ValueError (pickled objects), zipfile errors, ...
        raise ArtifactSchemaError(
            f"{name} is not a plain numpy archive ({exc}). Artifacts never contain pickled "
            "objects; re-create the artifact with abstain_guard."
        ) from exc


def parse_json(raw: bytes, what: str) -> Any:
    """JSON from bytes; a document nested too deeply is malformed, not a crash."""
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError as exc:
        raise ArtifactSchemaError(
            f"{what} is nested too deeply to be an abstain_guard artifact file. Re-create the "
            "artifact."
        ) from exc


def check_json(obj: Any, what: str) -> None:
    try:
        canonical_json(obj)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(
            f"{what} must be JSON-serializable (plain dicts, lists, strings, finite numbers): {exc}"
        ) from exc


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # Linux renameat2 flag
_RENAME_SWAP = 2  # macOS renamex_np flag
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}
_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>[0-9]+)(?:-[A-Za-z0-9_]+)?$")


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # pragma: no cover - no C library to ask
        return None


_LIBC = _libc()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries. False where the OS or file system cannot."""
    libc = _LIBC
    src, dst = os.fsencode(a), os.fsencode(b)
    if sys.platform.startswith("linux") and libc is not None and hasattr(libc, "renameat2"):
        rc = libc.renameat2(_AT_FDCWD, src, _AT_FDCWD, dst, _RENAME_EXCHANGE)
    elif sys.platform == "darwin" and libc is not None and hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(src, dst, _RENAME_SWAP)
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(b))


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some platforms cannot fsync a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists
        return True
    return True


def _siblings(target: Path) -> list[tuple[Path, int]]:
    """Staging (``.tmp-``) and aside (``.old-``) folders of saves of ``target``, with PIDs."""
    found: list[tuple[Path, int]] = []
    with contextlib.suppress(OSError):
        for entry in target.parent.iterdir():
            m = _SIBLING.match(entry.name)
            if m and m.group("name") == target.name:
                found.append((entry, int(m.group("pid"))))
    return found


def sweep_leftovers(target: Path) -> None:
    """Remove staging/aside folders left by killed saves (their PID no longer runs)."""
    for entry, pid in _siblings(target):
        if not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def write_staging(target: Path, files: Mapping[str, bytes]) -> Path:
    """Every file written and fsynced in a new folder beside ``target``."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        for name, data in files.items():
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                with os.fdopen(fd, "wb", closefd=False) as fh:
                    fh.write(data)
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _publish_by_renames(tmp: Path, target: Path) -> None:
    """Fallback without an exchange: rename the current artifact aside, rename ours in."""
    asides: list[Path] = []
    try:
        for _ in range(100):
            aside = target.with_name(f".{target.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
            with contextlib.suppress(FileNotFoundError):  # another writer moved it already
                os.rename(target, aside)
                asides.append(aside)
            try:
                os.rename(tmp, target)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        raise ArtifactWriteError(
            f"Could not replace {str(target)!r}: other processes kept replacing it. Save when "
            "no other process writes the same artifact."
        )
    finally:
        for aside in asides:
            shutil.rmtree(aside, ignore_errors=True)


def publish(tmp: Path, target: Path, overwrite: bool) -> None:
    """Make the complete staging folder ``tmp`` the artifact at ``target``."""
    try:
        os.rename(tmp, target)  # no target yet (or an empty folder)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if not overwrite:
        raise ArtifactError(
            f"{str(target)!r} was created by another process meanwhile; pass overwrite=True "
            "to replace it."
        )
    if _exchange(tmp, target):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the displaced artifact
    else:
        _publish_by_renames(tmp, target)


def check_target(target: Path, overwrite: bool) -> None:
    """Refuse a target that is not (or may not be replaced by) an artifact; a path another
    writer moves aside meanwhile counts as absent."""
    try:
        info = target.stat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        raise ArtifactError(f"{str(target)!r} exists and is not a directory.")
    try:
        empty = not any(target.iterdir())
    except FileNotFoundError:
        return
    if empty:
        return
    if not overwrite:
        raise ArtifactError(f"{str(target)!r} already exists; pass overwrite=True to replace it.")
    manifest = target / MANIFEST
    if not manifest.is_file() and target.exists() and not manifest.is_file():
        raise ArtifactError(
            f"{str(target)!r} is a non-empty directory without {MANIFEST}; refusing "
            "to replace something that is not an artifact."
        )


def write_error(target: Path, exc: OSError) -> ArtifactWriteError:
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "The directory is not writable: save to a writable location or fix permissions."
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "The disk is full: free space or save elsewhere."
    else:
        hint = "Check the path and the disk, then save again."
    return ArtifactWriteError(f"Could not write the artifact {str(target)!r} ({reason}). {hint}")


def save_in_progress(root: Path) -> bool:
    """True while a live save's staging or aside folder sits beside ``root``."""
    return any(_pid_alive(pid) for _, pid in _siblings(root))
