"""Time the vectorised conformal resplit simulation and the bootstrap AUROC interval;
print the timings as JSON.

    .venv/bin/python bench/resplit_speed.py [--sizes 500 2000] [--resplits 1000] [--repeats 5]

Synthetic scores (no model): the simulation's cost depends only on n, the number of
resplits and the number of participation levels (9, as in the paper).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from abstain_guard.calibration.measure.metrics import auroc_interval
from abstain_guard.calibration.measure.simulation import DEFAULT_LEVELS, resplit_simulation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--resplits", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    rows = []
    for n in args.sizes:
        rng = np.random.default_rng(n)
        correct = (rng.random(n) < 0.6).astype(int)
        scores = rng.normal(size=n) - correct
        resplit_simulation(scores, correct, n_resplits=10)  # warm-up
        times = []
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            resplit_simulation(scores, correct, n_resplits=args.resplits, seed=rep)
            times.append(time.perf_counter() - t0)
        interval_times = []
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            auroc_interval(scores, correct, n_boot=2000, seed=rep)
            interval_times.append(time.perf_counter() - t0)
        rows.append(
            {
                "n": n,
                "auroc_interval_b2000_median_s": statistics.median(interval_times),
                "n_resplits": args.resplits,
                "n_levels": len(DEFAULT_LEVELS),
                "repeats": args.repeats,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "resplit_simulation",
                "machine": {
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "numpy": np.__version__,
                    "cpu_count": os.cpu_count(),
                    "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                },
                "results": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
