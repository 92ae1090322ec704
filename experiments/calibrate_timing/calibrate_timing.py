"""Wall time of ``abstain-guard calibrate`` on the first N built-in probe questions.

    python experiments/calibrate_timing/calibrate_timing.py --limit 300 --label after
    python experiments/calibrate_timing/calibrate_timing.py --limit 300 --label after_batch_decode \
        --set batch_decode=true
    PYTHONPATH=/tmp/before_pkg python experiments/calibrate_timing/calibrate_timing.py --limit 300 \
        --label before

Each run starts from an empty output and run cache (nothing reused), in a subprocess of this
Python (so ``PYTHONPATH`` can point it at another checkout of the package, e.g. the code
before a change), with the shipped guard's settings (``configs/default_guard.yaml``: scorer,
split ratios, risk-target size check) and any ``--set key=value`` overrides. Run it on a
quiet machine, one at a time: calibration uses every core.

Prints the calibrate summary's own phase timings and, last, one JSON object:
``{"label", "limit", "wall_s", "seconds": {phase: s}, "split_sizes", "accuracy",
"scores_digest"}`` (sha256 prefix of the stored calibration scores, to compare runs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set takes key=value, got {text!r}")
    return key, yaml.safe_load(value)


def run(
    limit: int, config: Path, overrides: dict[str, Any], label: str, keep: Path | None = None
) -> dict[str, Any]:
    """One calibrate run in a fresh folder; its wall time and summary (the artifact copied to
    ``keep`` if given)."""
    settings = {**yaml.safe_load(config.read_text()), **overrides, "limit": limit}
    with tempfile.TemporaryDirectory(prefix="calibrate_timing_") as tmp:
        cfg = Path(tmp) / "config.yaml"
        cfg.write_text(yaml.safe_dump(settings))
        out, cache = Path(tmp) / "guard", Path(tmp) / "guard.cache"
        cmd = [
            sys.executable,
            "-m",
            "abstain_guard.cli",
            "calibrate",
            "--data",
            "builtin",
            "--config",
            str(cfg),
            "--out",
            str(out),
            "--cache-dir",
            str(cache),
        ]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
        wall = time.perf_counter() - t0
        summary = json.loads((cache / "summary.json").read_text())
        with np.load(out / "calibration.npz") as cal:
            digest = hashlib.sha256(np.ascontiguousarray(cal["scores"]).tobytes()).hexdigest()
        if keep is not None:
            shutil.copytree(out, keep)
    return {
        "label": label,
        "limit": limit,
        "wall_s": round(wall, 1),
        "seconds": {k: round(float(v), 1) for k, v in summary["seconds"].items()},
        "split_sizes": summary["split_sizes"],
        "accuracy": summary["accuracy"],
        "scores_digest": digest[:16],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default_guard.yaml")
    parser.add_argument("--set", type=_override, action="append", default=[], dest="overrides")
    parser.add_argument("--label", default="run")
    parser.add_argument("--keep", type=Path, default=None, help="copy the artifact here")
    args = parser.parse_args()
    result = run(args.limit, args.config, dict(args.overrides), args.label, args.keep)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
