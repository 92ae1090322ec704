"""A small durable key-value store (SQLite) for resumable calibration runs, and the run lock.

Every expensive step of :func:`~abstain_guard.calibration.building.pipeline.calibrate` writes its
results here in transactions, so a run killed at any point and started again with the same
command resumes without repeating finished work and without duplicates.

Integrity: a cache is never silently trusted nor silently discarded.

* At open, ``PRAGMA quick_check`` runs; a file that is not SQLite or is damaged raises
  :class:`~abstain_guard.errors.CacheError` naming the file to delete.
* A new cache is created complete (schema written in a temporary file, then linked into
  place), so a valid cache file is never empty: an existing 0-byte file is a truncated cache
  and also a :class:`~abstain_guard.errors.CacheError` (nothing in it can be recovered; delete
  it and the run regenerates everything).
* Every row of ``kv (ns, key, value)`` has a checksum in ``kv_sha256 (ns, key, sha256)`` =
  sha256 of ``[ns, key, value]`` as canonical JSON, written in the same transaction and checked
  on every read: an edited, moved or damaged value is a :class:`~abstain_guard.errors.CacheError`,
  never used. (A separate table keeps ``kv`` as it was, so older code still reads the file.)
  Caches written before these checksums (``PRAGMA user_version`` 0) are *adopted once* at open:
  their rows are hashed as they are (a warning says how many; they could not be verified) and
  the file is marked as version 1, after which a row without a checksum is an error like an
  edited one.

Arrays (per-token hidden states of reference answers, which a geometry scorer fits its means
on) are too large for JSON rows: :meth:`RunStore.put_arrays` writes them as an ``.npz`` file
beside the database (``<db>.arrays/<ns>/<key>.npz``) and a row ``{"file", "sha256", "bytes"}``
whose checksum covers the file's; :meth:`RunStore.get_arrays` checks the file against it and
loads it without pickle. The file is written (atomically) before its row, so a row always
names a complete file; a file without a row is never read.

:class:`RunLock` keeps one calibration per output: an exclusive ``flock`` on a lock file
holding the owner's PID. The kernel releases it when its process dies, so a stale lock file
(left by a killed run) is simply taken over; a live one makes the second run fail at once with
:class:`~abstain_guard.errors.CalibrationLockedError` naming the other run's PID.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import sqlite3
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard.errors import CacheError, CalibrationError, CalibrationLockedError

logger = logging.getLogger("abstain_guard.calibration")

SCHEMA_VERSION = 1
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv (ns TEXT NOT NULL, key TEXT NOT NULL, "
    "value TEXT NOT NULL, PRIMARY KEY (ns, key))",
    "CREATE TABLE IF NOT EXISTS kv_sha256 (ns TEXT NOT NULL, key TEXT NOT NULL, "
    "sha256 TEXT NOT NULL, PRIMARY KEY (ns, key))",
)
_TABLES = {"kv": {"ns", "key", "value"}, "kv_sha256": {"ns", "key", "sha256"}}


def content_key(*parts: Any) -> str:
    """Stable sha256 of JSON-serialisable parts (sorted keys), used as a cache key."""
    payload = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def row_digest(ns: str, key: str, value: Any) -> str:
    """The checksum stored with a row: sha256 of the canonical JSON of ``[ns, key, value]``."""
    payload = json.dumps(
        [ns, key, value], sort_keys=True, ensure_ascii=False, separators=(",", ":")
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _delete_hint(path: Path) -> str:
    return (
        f"To start a fresh cache, delete it: {path} (and any {path.name}-wal / {path.name}-shm "
        "beside it); the run then regenerates what it held."
    )


def _damaged(path: Path, what: str) -> CacheError:
    return CacheError(f"The cache {path} {what}. {_delete_hint(path)}")


def _db_error(path: Path, exc: sqlite3.Error, action: str) -> CacheError:
    """A typed error for a SQLite failure: damage, or an access problem (lock, disk, rights)."""
    if isinstance(exc, sqlite3.OperationalError):
        return CacheError(
            f"Could not {action} the cache {path} ({exc}). Check that it is writable, that the "
            "disk is not full and that no other process holds it, then run again."
        )
    return _damaged(path, f"is not a usable SQLite database ({exc})")


class RunStore:
    """Namespaced JSON values in one SQLite file (WAL mode; one connection per thread), each
    row checksummed (see the module docstring).

    Args:
        path: the database file; its parent directory is created.

    Raises:
        CacheError: the file is not SQLite, is damaged or truncated, or cannot be opened.
    """

    def __init__(self, path: str | Path, *, timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._local = threading.local()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(
                f"Could not create the cache folder {self.path.parent} ({exc}). Choose a "
                "writable cache directory."
            ) from exc
        if not self.path.exists():
            self._create()
        elif self.path.stat().st_size == 0:
            raise _damaged(self.path, "is empty (0 bytes): it was truncated")
        try:
            conn = self._connect()
            self._check(conn)
            self._migrate(conn)
        except sqlite3.Error as exc:
            self.close()
            raise _db_error(self.path, exc, "open") from exc
        except CacheError:
            self.close()
            raise

    # --- opening -----------------------------------------------------------------------

    def _create(self) -> None:
        """Write a complete empty cache beside the target, then link it into place (so a
        cache file is never seen half-initialised and never legitimately empty)."""
        tmp = self.path.with_name(f".{self.path.name}.new-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            conn = sqlite3.connect(tmp)
            try:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.commit()
                conn.execute("PRAGMA journal_mode=WAL")
            finally:
                conn.close()
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                pass  # another process created it first: use theirs
            except OSError:
                if not self.path.exists():  # no hard links on this file system
                    os.replace(tmp, self.path)
        except (OSError, sqlite3.Error) as exc:
            raise CacheError(
                f"Could not create the cache {self.path} ({exc}). Choose a writable cache "
                "directory with free space."
            ) from exc
        finally:
            for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()

    def _connect(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=self.timeout)
            self._local.conn = conn
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _check(self, conn: sqlite3.Connection) -> None:
        problems = [str(row[0]) for row in conn.execute("PRAGMA quick_check(5)").fetchall()]
        if problems != ["ok"]:
            found = "; ".join(problems)
            raise _damaged(self.path, f"is damaged (SQLite quick_check: {found})")

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Check the table, or adopt a cache written before row checksums (hashed once)."""
        if self._user_version(conn) == SCHEMA_VERSION:
            self._check_columns(conn)
            return
        conn.execute("BEGIN IMMEDIATE")  # one process migrates; the others then see version 1
        try:
            adopted = self._adopt(conn) if self._user_version(conn) != SCHEMA_VERSION else 0
            self._check_columns(conn)
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        if adopted:
            logger.warning(
                "Adopted %d rows of %s written before cache checksums; they are trusted as they "
                "are (delete the file to regenerate them instead).",
                adopted,
                self.path,
            )

    @staticmethod
    def _user_version(conn: sqlite3.Connection) -> int:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])

    def _check_columns(self, conn: sqlite3.Connection) -> None:
        for table, needed in _TABLES.items():
            info = conn.execute(f"PRAGMA table_info({table})").fetchall()
            columns = {str(r[1]) for r in info}
            if needed - columns:
                raise _damaged(self.path, f"has no valid {table} table (columns {sorted(columns)})")

    def _adopt(self, conn: sqlite3.Connection) -> int:
        """Version 0 (before checksums): add the column, hash the rows as they are."""
        version = self._user_version(conn)
        if version != 0:
            raise CacheError(
                f"The cache {self.path} has format version {version}; this abstain_guard reads "
                f"version {SCHEMA_VERSION}. Upgrade abstain_guard. {_delete_hint(self.path)}"
            )
        for statement in _SCHEMA:
            conn.execute(statement)
        rows = conn.execute(
            "SELECT kv.ns, kv.key, kv.value FROM kv LEFT JOIN kv_sha256 AS s "
            "ON s.ns = kv.ns AND s.key = kv.key WHERE s.sha256 IS NULL"
        ).fetchall()
        sums = [
            (ns, key, row_digest(ns, key, self._decode(ns, key, value))) for ns, key, value in rows
        ]
        conn.executemany(
            "INSERT OR REPLACE INTO kv_sha256 (ns, key, sha256) VALUES (?, ?, ?)", sums
        )
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return len(sums)

    # --- rows --------------------------------------------------------------------------

    def _decode(self, ns: str, key: str, value: str) -> Any:
        try:
            return json.loads(value)
        except (ValueError, RecursionError) as exc:
            what = f"holds a value for {ns}/{key} that is not JSON ({exc})"
            raise _damaged(self.path, what) from exc

    def _verified(self, ns: str, key: str, value: str, digest: str | None) -> Any:
        decoded = self._decode(ns, key, value)
        if digest is None or row_digest(ns, key, decoded) != digest:
            raise _damaged(
                self.path,
                f"holds a value for {ns}/{key} that does not match its checksum (the file was "
                "edited or damaged)",
            )
        return decoded

    def get_many(self, ns: str, keys: Sequence[str]) -> dict[str, Any]:
        """Values present for ``keys`` in namespace ``ns`` (missing keys are absent).

        Raises:
            CacheError: a value was edited or damaged, or the file cannot be read.
        """
        out: dict[str, Any] = {}
        conn = self._connect()
        for start in range(0, len(keys), 500):
            chunk = list(keys[start : start + 500])
            marks = ",".join("?" * len(chunk))
            try:
                rows = conn.execute(
                    "SELECT kv.key, kv.value, s.sha256 FROM kv LEFT JOIN kv_sha256 AS s "
                    f"ON s.ns = kv.ns AND s.key = kv.key WHERE kv.ns = ? AND kv.key IN ({marks})",
                    [ns, *chunk],
                ).fetchall()
            except sqlite3.Error as exc:
                raise _db_error(self.path, exc, "read") from exc
            out.update((k, self._verified(ns, k, v, d)) for k, v, d in rows)
        return out

    def put_many(self, ns: str, items: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Write several values atomically (all or none), each with its checksum."""
        pairs = items.items() if isinstance(items, Mapping) else items
        rows: list[tuple[str, str, str]] = []
        sums: list[tuple[str, str, str]] = []
        for k, v in pairs:
            text = json.dumps(v, ensure_ascii=False)
            rows.append((ns, k, text))
            sums.append((ns, k, row_digest(ns, k, json.loads(text))))
        conn = self._connect()
        try:
            with conn:
                conn.executemany(
                    "INSERT OR REPLACE INTO kv (ns, key, value) VALUES (?, ?, ?)", rows
                )
                conn.executemany(
                    "INSERT OR REPLACE INTO kv_sha256 (ns, key, sha256) VALUES (?, ?, ?)", sums
                )
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc, "write to") from exc

    # --- arrays beside the rows -----------------------------------------------------------

    @property
    def arrays_dir(self) -> Path:
        """Where :meth:`put_arrays` writes its files (``<db>.arrays``)."""
        return self.path.with_name(self.path.name + ".arrays")

    def put_arrays(self, ns: str, key: str, arrays: Mapping[str, np.ndarray]) -> None:
        """Store ``arrays`` (numeric, no pickle) under ``ns/key``: the ``.npz`` file first
        (atomically), then its row (checksum of the file included).

        Raises:
            CacheError: the file or the row cannot be written.
        """
        buffer = io.BytesIO()
        named: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
        np.savez(buffer, **named)
        data = buffer.getvalue()
        name = f"{ns}/{key}.npz"
        target = self.arrays_dir / name
        tmp = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise CacheError(
                f"Could not write {target} ({exc}). Check that the cache directory is writable "
                "and the disk is not full, then run again."
            ) from exc
        digest = hashlib.sha256(data).hexdigest()
        self.put_many(ns, {key: {"file": name, "sha256": digest, "bytes": len(data)}})

    def get_arrays(self, ns: str, key: str) -> dict[str, np.ndarray] | None:
        """The arrays stored under ``ns/key``, or None when there are none (no row, or its
        file was deleted to save space).

        Raises:
            CacheError: the file does not match its checksum or is not a valid ``.npz``.
        """
        row = self.get_many(ns, [key]).get(key)
        if not isinstance(row, Mapping) or not {"file", "sha256"} <= set(row):
            return None
        path = self.arrays_dir / str(row["file"])
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheError(f"Could not read {path} ({exc}). {_delete_hint(self.path)}") from exc
        if hashlib.sha256(data).hexdigest() != row["sha256"]:
            raise CacheError(
                f"The cache file {path} does not match its checksum (it was edited or damaged). "
                f"Delete it (the run recomputes it) or the whole cache. {_delete_hint(self.path)}"
            )
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        except (ValueError, OSError) as exc:
            raise CacheError(f"The cache file {path} is not a valid .npz ({exc}).") from exc

    def has_arrays(self, ns: str, keys: Sequence[str]) -> set[str]:
        """The keys of ``keys`` whose arrays are stored (row present and file on disk)."""
        rows = self.get_many(ns, keys)
        return {
            k
            for k, row in rows.items()
            if isinstance(row, Mapping) and (self.arrays_dir / str(row.get("file"))).is_file()
        }

    def count(self, ns: str | None = None) -> int:
        """Number of values in a namespace (in all namespaces when ``ns`` is None)."""
        conn = self._connect()
        try:
            if ns is None:
                row = conn.execute("SELECT COUNT(*) FROM kv").fetchone()
            else:
                row = conn.execute("SELECT COUNT(*) FROM kv WHERE ns = ?", [ns]).fetchone()
        except sqlite3.Error as exc:
            raise _db_error(self.path, exc, "read") from exc
        return int(row[0])

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


# --- one run per output ------------------------------------------------------------------


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


class RunLock:
    """An exclusive, non-blocking lock on ``path`` (``fcntl.flock``), holding our PID.

    Use as a context manager. Acquiring fails at once with
    :class:`~abstain_guard.errors.CalibrationLockedError` when a live process holds it; a lock
    file left by a dead process holds no lock and is taken over. Released (and the file
    removed) on exit, whatever the exit (exception, KeyboardInterrupt).

    Args:
        path: the lock file (its parent is created).
        what: what the lock protects, for the error message (e.g. ``"the artifact runs/x"``).
    """

    def __init__(self, path: str | Path, what: str) -> None:
        self.path = Path(path)
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise CalibrationLockedError / CalibrationError."""
        import fcntl  # POSIX only; imported here so the module imports everywhere

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for _ in range(10):
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise self._locked_error() from None
                if self._is_current(fd):
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
                    self._fd = fd
                    return
                os.close(fd)  # the holder removed the file as we opened it: try again
        except OSError as exc:
            raise CalibrationError(
                f"Could not create the lock file {self.path} ({exc}). The output and cache "
                "directories must be writable."
            ) from exc
        raise CalibrationError(f"Could not take the lock {self.path}; run again.")

    def _is_current(self, fd: int) -> bool:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)

    def _locked_error(self) -> CalibrationLockedError:
        pid = _read_pid(self.path)
        who = f"PID {pid}" if pid is not None else "another process (PID not yet recorded)"
        return CalibrationLockedError(
            f"Another calibration ({who}) is already running on {self.what} (lock "
            f"{self.path}). Wait for it to finish or stop it, or choose another --out / "
            "--cache-dir.",
            pid=pid,
            lock_path=str(self.path),
        )

    def release(self) -> None:
        """Remove the lock file and release the lock (no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            if self._is_current(fd):
                self.path.unlink()
        os.close(fd)  # closing the descriptor releases the flock

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock_path(path: str | Path) -> Path:
    target = Path(path).absolute()
    return target.with_name(target.name + ".lock")


@contextlib.contextmanager
def run_locks(out: str | Path, cache_dir: str | Path) -> Iterator[None]:
    """Hold the locks of one calibration run: ``<out>.lock`` beside the artifact and
    ``<cache_dir>.lock`` beside the cache directory (a second run on either fails fast).
    Both files are removed on exit; nothing is created inside the cache directory."""
    out_lock = RunLock(_lock_path(out), f"the artifact {out}")
    cache_lock = RunLock(_lock_path(cache_dir), f"the cache {cache_dir}")
    with out_lock, cache_lock:
        yield
