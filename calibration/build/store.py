"""A small durable key-value store (SQLite) for resumable calibration runs.

Every expensive step of :func:`~abstain_guard.calibration.build.pipeline.calibrate` writes its
results here in transactions, so a run killed at any point and started again with the same
command resumes without repeating finished work and without duplicates.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def content_key(*parts: Any) -> str:
    """Stable sha256 of JSON-serialisable parts (sorted keys), used as a cache key."""
    payload = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class RunStore:
    """Namespaced JSON values in one SQLite file (WAL mode; one connection per thread).

    Args:
        path: the database file; its parent directory is created.
    """

    def __init__(self, path: str | Path, *, timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        with self._connect() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS kv (ns TEXT NOT NULL, key TEXT NOT NULL, "
                "value TEXT NOT NULL, PRIMARY KEY (ns, key))"
            )

    def _connect(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=self.timeout)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
        return conn

    def get_many(self, ns: str, keys: Sequence[str]) -> dict[str, Any]:
        """Values present for ``keys`` in namespace ``ns`` (missing keys are absent)."""
        out: dict[str, Any] = {}
        conn = self._connect()
        for start in range(0, len(keys), 500):
            chunk = list(keys[start : start + 500])
            marks = ",".join("?" * len(chunk))
            rows = conn.execute(
                f"SELECT key, value FROM kv WHERE ns = ? AND key IN ({marks})", [ns, *chunk]
            ).fetchall()
            out.update((k, json.loads(v)) for k, v in rows)
        return out

    def put_many(self, ns: str, items: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Write several values atomically (all or none)."""
        pairs = items.items() if isinstance(items, Mapping) else items
        rows = [(ns, k, json.dumps(v, ensure_ascii=False)) for k, v in pairs]
        conn = self._connect()
        with conn:
            conn.executemany("INSERT OR REPLACE INTO kv (ns, key, value) VALUES (?, ?, ?)", rows)

    def count(self, ns: str | None = None) -> int:
        """Number of values in a namespace (in all namespaces when ``ns`` is None)."""
        conn = self._connect()
        if ns is None:
            row = conn.execute("SELECT COUNT(*) FROM kv").fetchone()
        else:
            row = conn.execute("SELECT COUNT(*) FROM kv WHERE ns = ?", [ns]).fetchone()
        return int(row[0])

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
