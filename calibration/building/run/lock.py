"""One calibration per output: :class:`RunLock`, an exclusive ``flock`` on a lock file holding
the owner's PID, and :func:`run_locks` (the two locks of one run).

The kernel releases a lock when its process dies, so a stale lock file (left by a killed run)
is simply taken over; a live one makes the second run fail at once with
:class:`~abstain_guard.errors.CalibrationLockedError` naming the other run's PID.
:func:`lock_holder` tells, without creating or taking anything, whether a live run holds a
lock (``evaluate`` does not read a calibration cache that a running calibration writes).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from abstain_guard.errors import CalibrationError, CalibrationLockedError


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


def lock_path(path: str | Path) -> Path:
    """The lock file of an artifact or cache directory: ``<path>.lock`` beside it."""
    target = Path(path).absolute()
    return target.with_name(target.name + ".lock")


@contextlib.contextmanager
def run_locks(out: str | Path, cache_dir: str | Path) -> Iterator[None]:
    """Hold the locks of one calibration run: ``<out>.lock`` beside the artifact and
    ``<cache_dir>.lock`` beside the cache directory (a second run on either fails fast).
    Both files are removed on exit; nothing is created inside the cache directory."""
    out_lock = RunLock(lock_path(out), f"the artifact {out}")
    cache_lock = RunLock(lock_path(cache_dir), f"the cache {cache_dir}")
    with out_lock, cache_lock:
        yield


def lock_holder(path: str | Path) -> int | None:
    """The PID of the live process holding the lock file ``path`` (``-1`` when held but the
    PID is not yet recorded), or None when nobody holds it or it does not exist.

    Nothing is created, written or removed: the file is opened read-only and a shared lock
    is tried (and released at once).
    """
    import fcntl  # POSIX only; imported here so the module imports everywhere

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(Path(path))
        return -1 if pid is None else pid
    except OSError:
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
