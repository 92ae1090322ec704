"""`GuardArtifact`: what calibration produces and the guard loads.

An artifact holds the fitted scorer's state, the calibration scores and labels (so a new
target in the config re-thresholds instantly, with no model run), the model fingerprint
and free JSON metadata. On disk it is a directory::

    manifest.json      schema_version, created, model_fingerprint, scorer kind,
                       sha256 checksums and sizes of every other file, metadata,
                       and manifest_sha256 (a checksum of the manifest itself)
    calibration.npz    scores [n] float64, correct [n] bool   (allow_pickle=False)
    scorer.json        ScorerState kind, params, names of its arrays and files
    scorer.npz         ScorerState arrays                      (allow_pickle=False)
    <raw files>        ScorerState files, e.g. calibrator.ubj (XGBoost)

Loading never executes code: JSON, numpy arrays without pickle, and raw bytes handed to
the scorer's ``from_state``. A missing file raises ArtifactNotFoundError, a changed or
truncated file ArtifactIntegrityError, an unknown schema or malformed content (a manifest
nested too deeply included) ArtifactSchemaError, an array that would inflate past
``max_array_bytes`` (default :data:`MAX_ARRAY_BYTES`, read from each ``.npy`` header before
anything is allocated) ArtifactTooLargeError, another model's artifact ArtifactMismatchError.

Atomic replacement (readers never see a partial artifact). The artifact stays a plain
directory (no symlinks, no version folders: copy it with ``cp -r``, ship it in a wheel, and
any earlier loader reads it). :meth:`GuardArtifact.save`

1. writes every file into a staging directory beside the target
   (``.<name>.tmp-<pid>-<random>``, same file system), fsyncs each file and the directory;
2. publishes it with one atomic directory *exchange*: ``renameat2(RENAME_EXCHANGE)`` on
   Linux, ``renamex_np(RENAME_SWAP)`` on macOS. At every instant the target path is the
   complete old artifact or the complete new one; the old one, now under the staging name,
   is deleted and the parent directory fsynced. A first save (no target yet) is a plain
   ``rename``.
3. Where the file system cannot exchange, it falls back to rename-aside + rename-in
   (``.<name>.old-<pid>-<random>``); the target is missing for the instant between the two.

Readers are consistent in both cases: :meth:`GuardArtifact.load` opens the directory once and
reads every file relative to that descriptor, so it reads one artifact, never a mix of two.
If a concurrent save removes the directory it is reading (a file disappears), or the target
is missing while a save's staging or aside folder exists beside it, the load starts again
(for up to :data:`READ_RETRY_SECONDS`) and returns whichever complete artifact is current.

Concurrent writers: each exchange publishes a complete artifact, so the last save to finish
wins and nothing is left behind (each writer deletes what its exchange displaced; a staging
or aside folder left by a killed process is removed by the next save once that PID is gone).
Every failure is an :class:`~abstain_guard.errors.ArtifactError` (a read-only or full disk:
:class:`~abstain_guard.errors.ArtifactWriteError`).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import errno
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import ArrayLike

from abstain_guard._version import __version__
from abstain_guard.config import GuardConfig
from abstain_guard.decision import DecisionRule, decision_rule
from abstain_guard.errors import (
    AbstainGuardError,
    ArtifactError,
    ArtifactIntegrityError,
    ArtifactMismatchError,
    ArtifactNotFoundError,
    ArtifactSchemaError,
    ArtifactTooLargeError,
    ArtifactWriteError,
    InsufficientDataError,
    InvalidInputError,
)
from abstain_guard.scoring import Scorer, ScorerState, scorer_from_state
from abstain_guard.validation import check_labels, check_scores

__all__ = ["MAX_ARRAY_BYTES", "SCHEMA_VERSION", "GuardArtifact"]

logger = logging.getLogger("abstain_guard")

SCHEMA_VERSION = 1
FORMAT_NAME = "abstain_guard.artifact"
MANIFEST = "manifest.json"
CALIBRATION = "calibration.npz"
SCORER_JSON = "scorer.json"
SCORER_NPZ = "scorer.npz"
_RESERVED = {MANIFEST, CALIBRATION, SCORER_JSON, SCORER_NPZ}
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: Default cap on the uncompressed bytes of one ``.npz`` file's arrays at load (512 MiB).
#: Override per call (``GuardArtifact.load(..., max_array_bytes=...)``) or here.
MAX_ARRAY_BYTES = 512 * 2**20
#: How long a load retries while a concurrent save replaces the artifact it is reading.
READ_RETRY_SECONDS = 10.0


# --- helpers -----------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
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


def _load_npz(data: bytes, name: str, limit: int = MAX_ARRAY_BYTES) -> dict[str, np.ndarray]:
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


def _parse_json(raw: bytes, what: str) -> Any:
    """JSON from bytes; a document nested too deeply is malformed, not a crash."""
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError as exc:
        raise ArtifactSchemaError(
            f"{what} is nested too deeply to be an abstain_guard artifact file. Re-create the "
            "artifact."
        ) from exc


def _validate_calibration(scores: ArrayLike, correct: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    s = check_scores(scores)
    c = check_labels(correct, s.size).astype(bool)
    return s, c


def _check_json(obj: Any, what: str) -> None:
    try:
        _canonical(obj)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(
            f"{what} must be JSON-serializable (plain dicts, lists, strings, finite numbers): {exc}"
        ) from exc


# --- atomic publication (see the module docstring) -----------------------------------------

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


def _fsync_dir(path: Path) -> None:
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


def _sweep_leftovers(target: Path) -> None:
    """Remove staging/aside folders left by killed saves (their PID no longer runs)."""
    for entry, pid in _siblings(target):
        if not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def _write_staging(target: Path, files: Mapping[str, bytes]) -> Path:
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
        _fsync_dir(tmp)
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


def _publish(tmp: Path, target: Path, overwrite: bool) -> None:
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


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists():
        if not target.is_dir():
            raise ArtifactError(f"{str(target)!r} exists and is not a directory.")
        if any(target.iterdir()):
            if not overwrite:
                raise ArtifactError(
                    f"{str(target)!r} already exists; pass overwrite=True to replace it."
                )
            if not (target / MANIFEST).is_file():
                raise ArtifactError(
                    f"{str(target)!r} is a non-empty directory without {MANIFEST}; refusing "
                    "to replace something that is not an artifact."
                )


def _write_error(target: Path, exc: OSError) -> ArtifactWriteError:
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "The directory is not writable: save to a writable location or fix permissions."
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "The disk is full: free space or save elsewhere."
    else:
        hint = "Check the path and the disk, then save again."
    return ArtifactWriteError(f"Could not write the artifact {str(target)!r} ({reason}). {hint}")


# --- consistent reads ------------------------------------------------------------------------


class _Snapshot:
    """One artifact directory, opened once: every file is read relative to that descriptor,
    so a concurrent exchange cannot mix two artifacts into one load."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd: int | None = None
        if os.open in os.supports_dir_fd:
            self._fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            st = os.fstat(self._fd)
        else:  # pragma: no cover - platforms without dir_fd (Windows)
            st = os.stat(root)
        self.ident = (st.st_dev, st.st_ino)

    def read(self, name: str) -> bytes | None:
        """The file's bytes, or None when it does not exist (or is not a regular file)."""
        try:
            if self._fd is None:  # pragma: no cover
                return (self.root / name).read_bytes()
            fd = os.open(name, os.O_RDONLY, dir_fd=self._fd)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        with os.fdopen(fd, "rb") as fh:
            return fh.read()

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
        if root.is_dir() or _save_in_progress(root):  # the rename fallback of a save
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


def _save_in_progress(root: Path) -> bool:
    return any(_pid_alive(pid) for _, pid in _siblings(root))


# --- reading a manifest and its files from one snapshot ------------------------------------


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
        manifest = _parse_json(raw, f"{MANIFEST} in {str(root)!r}")
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
        actual = _sha256(_canonical(manifest))
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
        if not _SAFE_NAME.match(name) or name == MANIFEST:
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
        if _sha256(blob) != digest:
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
        return manifest, (_read_files(snap, manifest) if with_files else {})
    except (ArtifactNotFoundError, ArtifactIntegrityError) as exc:
        if snap.replaced():  # a concurrent save replaced (and removed) what we were reading
            raise _Retry(exc) from exc
        raise
    finally:
        snap.close()


def _read_consistent(root: Path, with_files: bool) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The verified manifest (and files) of one complete artifact at ``root``, read again
    while concurrent saves replace it (up to READ_RETRY_SECONDS)."""
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


# --- the artifact --------------------------------------------------------------------------


class GuardArtifact:
    """A fitted scorer plus its calibration scores and labels.

    Build one with :meth:`from_calibration`, write it with :meth:`save`, read it with
    :meth:`load`, and ask it for the threshold of any target with :meth:`decision_rule`.

    Attributes:
        scorer: the fitted :class:`~abstain_guard.scoring.Scorer`.
        scores: calibration scores, shape ``[n]`` (float64).
        correct: calibration labels, shape ``[n]`` (bool).
        model_fingerprint: identity of the model the scores came from (or None).
        metadata: free JSON dict (judge identity, data set, split sizes, ...).
        created: ISO-8601 UTC creation time.
        schema_version: the on-disk schema version.
        path: where it was loaded from or last saved to (None for an in-memory artifact).
    """

    def __init__(
        self,
        scorer: Scorer,
        scores: ArrayLike,
        correct: ArrayLike,
        model_fingerprint: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        created: str | None = None,
    ) -> None:
        if not isinstance(scorer, Scorer):
            raise InvalidInputError(
                f"scorer must be an abstain_guard Scorer, got {type(scorer).__name__}."
            )
        self.scorer = scorer
        self.scores, self.correct = _validate_calibration(scores, correct)
        self.scores.setflags(write=False)
        self.correct.setflags(write=False)
        if model_fingerprint is not None and not isinstance(model_fingerprint, str):
            raise InvalidInputError("model_fingerprint must be a string or None.")
        self.model_fingerprint = model_fingerprint
        meta = dict(metadata or {})
        _check_json(meta, "metadata")
        self.metadata: dict[str, Any] = meta
        self.created = created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.schema_version = SCHEMA_VERSION
        self.path: Path | None = None
        self._rules: dict[tuple[Any, ...], DecisionRule] = {}

    @classmethod
    def from_calibration(
        cls,
        *,
        scorer: Scorer,
        scores: ArrayLike,
        correct: ArrayLike,
        model_fingerprint: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> GuardArtifact:
        """Create an artifact from a fitted scorer and its calibration scores and labels.

        Args:
            scorer: the fitted scorer that produced ``scores``.
            scores: calibration uncertainty scores, shape ``[n]``, finite.
            correct: calibration labels (0/1 or bool), shape ``[n]``.
            model_fingerprint: identity of the chat model (checked by the guard).
            metadata: free JSON metadata stored in the manifest.
        """
        return cls(scorer, scores, correct, model_fingerprint=model_fingerprint, metadata=metadata)

    @property
    def n(self) -> int:
        """Number of calibration samples."""
        return int(self.scores.size)

    @property
    def scorer_kind(self) -> str:
        """The scorer's registry kind."""
        return self.scorer.kind

    def decision_rule(self, config: GuardConfig | None = None) -> DecisionRule:
        """The threshold and guarantee for ``config``'s target, from the stored scores.

        Raises:
            ArtifactMismatchError: when ``config.scorer`` names another scorer kind.
        """
        cfg = config if config is not None else GuardConfig()
        if cfg.scorer is not None and cfg.scorer != self.scorer.kind:
            raise ArtifactMismatchError(
                f"The config asks for scorer {cfg.scorer!r} but this artifact was calibrated "
                f"with {self.scorer.kind!r}. Use an artifact for {cfg.scorer!r} or drop the "
                "scorer setting."
            )
        key = (cfg.mode, cfg.participation, cfg.risk_target, cfg.delta, cfg.on_infeasible)
        rule = self._rules.get(key)
        if rule is None:
            rule = decision_rule(self.scores, self.correct, cfg)
            self._rules[key] = rule
        return rule

    def check_fingerprint(self, fingerprint: str | None) -> None:
        """Raise ArtifactMismatchError when both fingerprints are set and differ."""
        if fingerprint is None or self.model_fingerprint is None:
            return
        if str(fingerprint) != self.model_fingerprint:
            raise ArtifactMismatchError(
                f"This artifact was calibrated for model {self.model_fingerprint!r}, but the "
                f"model in use is {str(fingerprint)!r}. Its thresholds do not transfer to "
                "another model: calibrate again for this model, or load the matching model."
            )

    def __repr__(self) -> str:
        return (
            f"GuardArtifact(scorer={self.scorer.kind!r}, n={self.n}, "
            f"accuracy={float(self.correct.mean()):.3f}, "
            f"model_fingerprint={self.model_fingerprint!r})"
        )

    # --- save --------------------------------------------------------------------------

    def _files(self) -> dict[str, bytes]:
        state: ScorerState = self.scorer.get_state()
        if not isinstance(state, ScorerState):
            raise InvalidInputError(
                f"{type(self.scorer).__name__}.get_state() must return a ScorerState."
            )
        for name in state.files:
            if not _SAFE_NAME.match(name) or name in _RESERVED:
                raise InvalidInputError(
                    f"Scorer file name {name!r} is not allowed (use letters, digits, '.', '_', "
                    f"'-', not one of {sorted(_RESERVED)})."
                )
        _check_json(state.params, "ScorerState.params")
        scorer_json = {
            "kind": state.kind,
            "params": state.params,
            "arrays": sorted(state.arrays),
            "files": sorted(state.files),
        }
        files: dict[str, bytes] = {
            CALIBRATION: _npz_bytes({"scores": self.scores, "correct": self.correct}),
            SCORER_JSON: json.dumps(scorer_json, indent=2, sort_keys=True).encode(),
            SCORER_NPZ: _npz_bytes(state.arrays),
        }
        for name, data in state.files.items():
            files[name] = bytes(data)
        return files

    def _manifest(self, files: Mapping[str, bytes]) -> dict[str, Any]:
        manifest: dict[str, Any] = {
            "format": FORMAT_NAME,
            "schema_version": SCHEMA_VERSION,
            "created": self.created,
            "library_version": __version__,
            "model_fingerprint": self.model_fingerprint,
            "scorer": {"kind": self.scorer.kind, "name": self.scorer.name},
            "n_calibration": self.n,
            "accuracy": float(self.correct.mean()),
            "checksums": {name: _sha256(data) for name, data in sorted(files.items())},
            "sizes": {name: len(data) for name, data in sorted(files.items())},
            "metadata": self.metadata,
        }
        manifest["manifest_sha256"] = _sha256(_canonical(manifest))
        return manifest

    def save(self, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """Write the artifact directory atomically (see the module docstring): a reader of
        ``path`` sees the complete old artifact or the complete new one, never a mix, and of
        concurrent saves the last to finish wins.

        Args:
            path: the directory to create.
            overwrite: replace an existing artifact directory at ``path``. A non-empty
                directory that is not an artifact is never replaced.

        Returns:
            The directory path.

        Raises:
            ArtifactError: ``path`` exists and may not be replaced.
            ArtifactWriteError: the files could not be written (read-only or full disk, ...).
        """
        target = Path(path)
        _check_target(target, overwrite)
        files = self._files()
        manifest = self._manifest(files)
        files[MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _sweep_leftovers(target)
            tmp = _write_staging(target, files)
        except OSError as exc:
            raise _write_error(target, exc) from exc
        try:
            _publish(tmp, target, overwrite)
            _fsync_dir(target.parent)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _write_error(target, exc) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.path = target
        return target

    # --- load --------------------------------------------------------------------------

    @classmethod
    def read_manifest(cls, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Read and verify ``manifest.json`` (schema and self-checksum) without loading data."""
        manifest, _ = _read_consistent(Path(path), with_files=False)
        return manifest

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        expected_fingerprint: str | None = None,
        *,
        max_array_bytes: int | None = None,
    ) -> GuardArtifact:
        """Load and verify an artifact directory.

        Args:
            path: the directory written by :meth:`save`.
            expected_fingerprint: when given (and the artifact has a fingerprint), they
                must be equal.
            max_array_bytes: the most bytes the arrays of one ``.npz`` file may inflate to
                (default :data:`MAX_ARRAY_BYTES`, 512 MiB), checked before allocating.

        Raises:
            ArtifactNotFoundError: the directory or a file is missing.
            ArtifactIntegrityError: a file's checksum or size does not match the manifest.
            ArtifactSchemaError: unsupported schema version or malformed content.
            ArtifactTooLargeError: an array would inflate past ``max_array_bytes``.
            ArtifactMismatchError: the artifact belongs to another model.
        """
        root = Path(path)
        limit = MAX_ARRAY_BYTES if max_array_bytes is None else int(max_array_bytes)
        manifest, data = _read_consistent(root, with_files=True)

        fingerprint = manifest.get("model_fingerprint")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise ArtifactSchemaError("manifest model_fingerprint must be a string or null.")

        calib = _load_npz(data[CALIBRATION], CALIBRATION, limit)
        if set(calib) != {"scores", "correct"}:
            raise ArtifactSchemaError(
                f"{CALIBRATION} must hold exactly 'scores' and 'correct', has {sorted(calib)}."
            )
        try:
            scorer_json = _parse_json(data[SCORER_JSON], SCORER_JSON)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactSchemaError(f"{SCORER_JSON} is not valid JSON: {exc}") from exc
        if not isinstance(scorer_json, dict) or not isinstance(scorer_json.get("kind"), str):
            raise ArtifactSchemaError(f"{SCORER_JSON} must be an object with a string 'kind'.")
        arrays = _load_npz(data[SCORER_NPZ], SCORER_NPZ, limit)
        if sorted(arrays) != sorted(scorer_json.get("arrays", [])):
            raise ArtifactSchemaError(
                f"{SCORER_NPZ} holds arrays {sorted(arrays)} but {SCORER_JSON} lists "
                f"{scorer_json.get('arrays')}."
            )
        file_names = scorer_json.get("files", [])
        if not isinstance(file_names, list) or any(n not in data for n in file_names):
            raise ArtifactSchemaError(
                f"{SCORER_JSON} lists scorer files {file_names!r} that the manifest does not."
            )
        params = scorer_json.get("params", {})
        if not isinstance(params, dict):
            raise ArtifactSchemaError(f"{SCORER_JSON} 'params' must be an object.")
        state = ScorerState(
            kind=scorer_json["kind"],
            params=params,
            arrays=arrays,
            files={n: data[n] for n in file_names},
        )
        manifest_kind = (manifest.get("scorer") or {}).get("kind")
        if manifest_kind != state.kind:
            raise ArtifactSchemaError(
                f"Manifest scorer kind {manifest_kind!r} differs from {SCORER_JSON} kind "
                f"{state.kind!r}."
            )
        try:
            scorer = scorer_from_state(state)
        except AbstainGuardError:
            raise
        except Exception as exc:
            raise ArtifactSchemaError(
                f"Could not rebuild the {state.kind!r} scorer from the artifact: {exc}"
            ) from exc
        metadata = manifest.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ArtifactSchemaError("manifest metadata must be an object.")
        try:
            artifact = cls(
                scorer,
                calib["scores"],
                calib["correct"],
                model_fingerprint=fingerprint,
                metadata=metadata,
                created=manifest.get("created"),
            )
        except (InvalidInputError, InsufficientDataError) as exc:
            raise ArtifactSchemaError(f"Invalid calibration data in the artifact: {exc}") from exc
        artifact.path = root
        if expected_fingerprint is not None:
            if fingerprint is None:
                logger.warning(
                    "Artifact %s has no model fingerprint; cannot check it against %r.",
                    root,
                    expected_fingerprint,
                )
            artifact.check_fingerprint(expected_fingerprint)
        return artifact
