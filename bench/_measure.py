"""What the benchmarks share: the spread of repeated measurements and the peak resident memory
of a run. A script imports it after ``sys.path.insert(0, <bench/>)``."""

from __future__ import annotations

import os
import statistics
import threading
import time


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    """Median, min and max of ``values``, rounded to ``digits``."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def rss_bytes() -> int:
    """This process's resident memory (Linux ``/proc``)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident memory above the level at entry, sampled in a thread every ms."""

    def __enter__(self) -> PeakRSS:
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20
