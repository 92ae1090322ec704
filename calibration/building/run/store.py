"""A small durable key-value store (SQLite) for resumable calibration runs.

Every expensive step of :func:`~abstain_guard.calibration.building.pipeline.calibrate` writes its
results here in transactions, so a run killed at any point and started again with the same
command resumes without repeating finished work and without duplicates. A cache is never
silently trusted nor silently discarded (checksummed rows and arrays, read-only stores and
layers: docs/architecture.md, "Run cache"); :class:`~.lock.RunLock` keeps one calibration per
output.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import sqlite3
import tempfile
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard.errors import CacheError

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
        timeout: seconds to wait for another process's write lock.
        read_only: open an existing file without writing anything next to it or in it;
            writes raise :class:`~abstain_guard.errors.CacheError`.

    Raises:
        CacheError: the file is not SQLite, is damaged or truncated, or cannot be opened;
            read-only: it does not exist; any: it has another format version.
    """

    def __init__(self, path: str | Path, *, timeout: float = 60.0, read_only: bool = False) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.read_only = read_only
        self._snapshot_dir: tempfile.TemporaryDirectory[str] | None = None
        self._local = threading.local()
        if read_only:
            if not self.path.is_file():
                raise CacheError(f"The cache {self.path} does not exist (opened read-only).")
        else:
            self._make_parent()
        if not self.path.exists():
            self._create()
        elif self.path.stat().st_size == 0:
            raise _damaged(self.path, "is empty (0 bytes): it was truncated")
        try:
            conn = self._connect()
            self._check(conn)
            self._check_format(conn)
        except sqlite3.Error as exc:
            self.close()
            raise _db_error(self.path, exc, "open") from exc
        except CacheError:
            self.close()
            raise

    # --- opening -----------------------------------------------------------------------

    def _make_parent(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(
                f"Could not create the cache folder {self.path.parent} ({exc}). Choose a "
                "writable cache directory."
            ) from exc

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
            if self.read_only:
                conn = sqlite3.connect(self._read_only_uri(), uri=True, timeout=self.timeout)
                self._local.conn = conn
                return conn
            conn = sqlite3.connect(self.path, timeout=self.timeout)
            self._local.conn = conn
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _read_only_uri(self) -> str:
        """``immutable=1``: SQLite reads the file as it is, takes no lock and creates no
        ``-wal``/``-shm`` file. When a write-ahead log is beside it (its writer is still open,
        or was killed), the file and its log are first copied to a temporary snapshot, which
        is opened instead: its rows are read too and the cache itself is still never touched.
        A page left half-written reads as damage (a CacheError), never as another row (each
        row is checked against its checksum)."""
        target = self.path
        wal = self.path.with_name(self.path.name + "-wal")
        if wal.is_file() and wal.stat().st_size > 0:
            target = self._snapshot(wal)
        mode = "mode=ro" if target != self.path else "immutable=1"
        return f"file:{urllib.parse.quote(str(target.absolute()))}?{mode}"

    def _snapshot(self, wal: Path) -> Path:
        """A private copy of the file and its write-ahead log (made once per store)."""
        if self._snapshot_dir is None:
            self._snapshot_dir = tempfile.TemporaryDirectory(prefix="abstain-guard-cache-")
            copy = Path(self._snapshot_dir.name) / self.path.name
            shutil.copyfile(self.path, copy)
            shutil.copyfile(wal, copy.with_name(copy.name + "-wal"))
        return Path(self._snapshot_dir.name) / self.path.name

    def _check(self, conn: sqlite3.Connection) -> None:
        problems = [str(row[0]) for row in conn.execute("PRAGMA quick_check(5)").fetchall()]
        if problems != ["ok"]:
            found = "; ".join(problems)
            raise _damaged(self.path, f"is damaged (SQLite quick_check: {found})")

    def _check_format(self, conn: sqlite3.Connection) -> None:
        """Check the format version and the tables."""
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version != SCHEMA_VERSION:
            raise CacheError(
                f"The cache {self.path} has format version {version}; this abstain_guard reads "
                f"version {SCHEMA_VERSION}. {_delete_hint(self.path)}"
            )
        for table, needed in _TABLES.items():
            info = conn.execute(f"PRAGMA table_info({table})").fetchall()
            columns = {str(r[1]) for r in info}
            if needed - columns:
                raise _damaged(self.path, f"has no valid {table} table (columns {sorted(columns)})")

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
        return self._get_own(ns, keys)

    def _get_own(self, ns: str, keys: Sequence[str]) -> dict[str, Any]:
        """:meth:`get_many` of this file alone (never a layer below it)."""
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
        self._check_writable()
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

    def _check_writable(self) -> None:
        if self.read_only:
            raise CacheError(
                f"The cache {self.path} was opened read-only; nothing may be written to it."
            )

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
        self._check_writable()
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
        row = self._get_own(ns, [key]).get(key)
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
        rows = self._get_own(ns, keys)
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


class LayeredStore(RunStore):
    """A writable :class:`RunStore` at ``path`` that also reads the read-only stores of
    ``read_from`` (e.g. the calibration run's cache, under ``evaluate``).

    A value missing in its own file is looked up in ``read_from``, in order; every write goes
    to its own file only. Keys are content keys (model fingerprint, prompt, generation
    settings), so a value found below is exactly the one this run would have written. A store
    below that fails a read (an edited or damaged row: :class:`~abstain_guard.errors.
    CacheError`) is not read again, with a warning; its values are then made anew.

    Attributes:
        reused: per namespace, how many values were served from the stores below.
    """

    def __init__(
        self, path: str | Path, *, read_from: Sequence[RunStore], timeout: float = 60.0
    ) -> None:
        super().__init__(path, timeout=timeout)
        self.read_from = list(read_from)
        self.reused: dict[str, int] = {}

    def get_many(self, ns: str, keys: Sequence[str]) -> dict[str, Any]:
        """Values for ``keys``: this file's, then those of the stores below for the rest."""
        out = self._get_own(ns, keys)
        for lower in list(self.read_from):
            missing = [k for k in keys if k not in out]
            if not missing:
                break
            found = self._from(lower, lower.get_many, ns, missing) or {}
            out.update(found)
            self.reused[ns] = self.reused.get(ns, 0) + len(found)
        return out

    def get_arrays(self, ns: str, key: str) -> dict[str, np.ndarray] | None:
        """This file's arrays under ``ns/key``, else the first store below that has them."""
        own = super().get_arrays(ns, key)
        for lower in list(self.read_from):
            if own is not None:
                break
            own = self._from(lower, lower.get_arrays, ns, key)
        return own

    def has_arrays(self, ns: str, keys: Sequence[str]) -> set[str]:
        """The keys whose arrays are stored here or in a store below."""
        found = super().has_arrays(ns, keys)
        for lower in list(self.read_from):
            found |= self._from(lower, lower.has_arrays, ns, keys) or set()
        return found

    def _from(self, lower: RunStore, read: Callable[..., Any], *args: Any) -> Any:
        """``read(*args)`` of ``lower``; on a CacheError, drop ``lower`` (warned), give None."""
        try:
            return read(*args)
        except CacheError as exc:
            logger.warning("Not reading %s any more (values are made anew): %s", lower.path, exc)
            self.read_from.remove(lower)
            return None

    def close(self) -> None:
        """Close this thread's connections (its own and those of the stores below)."""
        super().close()
        for lower in self.read_from:
            lower.close()
