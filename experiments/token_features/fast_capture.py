"""geometry_fast (fast-capture features) against geometry (full capture), on the same answers.

Two sources of scores, both on splits neither scorer was fitted on:

* ``features PATH`` — a features file of ``experiments/token_features/token_features.py`` (every
answer of a run
  replayed with full capture: Ω, Θ, Φ per token). Both scorers are fitted here on its
  reference and train splits (``fit_blocks``; ``geometry_fast`` reads the ω_dir columns, as
  it does from any full-capture response) and scored on the calibration and test splits.
* ``artifacts FULL FAST`` — two artifacts of ``abstain-guard calibrate`` on the same data
  and splits (``--scorer geometry`` / ``--scorer geometry_fast``): their stored calibration
  scores (the deployed guard's live scores) on the same calibration answers.

Per split: AUROC with a 95 % class-stratified bootstrap interval, the counts of correct and
incorrect answers, and the paired difference fast − full (the same resamples for both).
Prints one table row per split, then one JSON line.

    python experiments/token_features/fast_capture.py features runs/features/probe.npz --seed 0
    python experiments/token_features/fast_capture.py artifacts runs/fast_sciq_geometry \
        runs/fast_sciq_geometry_fast
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from within_type import _reference, _rows, load

from abstain_guard import GuardArtifact
from abstain_guard.calibration.measure import metrics
from abstain_guard.scorers import ReferenceInputs, TokenBlock
from abstain_guard.scorers.geometry import GeometryScorer

N_BOOT = 2000


def fast_block(block: TokenBlock, num_layers: int) -> TokenBlock:
    """A full token block ``[N, 8L−4]`` as ``geometry_fast`` reads the same answer:
    ``[N, 7L−3]`` (ω_dir = the even Ω columns, then Θ, Φ^in, Φ^out)."""
    k = 2 * num_layers - 1
    geometry = np.concatenate([block.geometry[:, 0:k:2], block.geometry[:, k:]], axis=1)
    return TokenBlock(geometry, block.logprob, block.entropy)


def compare(full: np.ndarray, fast: np.ndarray, correct: np.ndarray) -> dict[str, Any]:
    """AUROC of both score vectors ``[n]`` with 95 % stratified bootstrap intervals and the
    paired difference fast − full (the same resamples: same seed, same labels)."""
    draws = {
        name: metrics.bootstrap_draws(s, correct, n_boot=N_BOOT, seed=0)["auroc"]
        for name, s in (("geometry", full), ("geometry_fast", fast))
    }
    out: dict[str, Any] = {
        "correct": int(correct.sum()),
        "incorrect": int((~correct).sum()),
    }
    for name, s in (("geometry", full), ("geometry_fast", fast)):
        out[name] = {
            "auroc": metrics.auroc(s, correct),
            "interval": metrics.percentile_interval(draws[name]),
        }
    diff = draws["geometry_fast"] - draws["geometry"]
    out["difference"] = {
        "auroc": out["geometry_fast"]["auroc"] - out["geometry"]["auroc"],
        "interval": metrics.percentile_interval(diff),
    }
    return out


def _fast_reference(ref: ReferenceInputs) -> ReferenceInputs:
    blocks = [fast_block(b, ref.num_layers) for b in ref.blocks]
    return ReferenceInputs(ref.means, blocks, ref.labels, ref.num_layers)


def from_features(path: Path, artifact: str, seed: int) -> dict[str, Any]:
    """Fit both scorers on the file's reference + train splits; compare them per held-out
    split."""
    data = load(path, artifact)
    num_layers = data["num_layers"]
    ref = _reference(data)
    train = _rows(data, "train")
    blocks = [data["blocks"][i] for i in train]
    y = data["correct"]
    full = GeometryScorer(random_state=seed).fit_blocks(ref, blocks, y[train])
    fast = GeometryScorer(capture="fast", random_state=seed).fit_blocks(
        _fast_reference(ref), [fast_block(b, num_layers) for b in blocks], y[train]
    )
    out = {}
    for split in ("calibration", "test"):
        rows = _rows(data, split)
        held = [data["blocks"][i] for i in rows]
        out[split] = compare(
            full.scores_of(held),
            fast.scores_of([fast_block(b, num_layers) for b in held]),
            y[rows],
        )
    return out


def from_artifacts(full_path: str, fast_path: str) -> dict[str, Any]:
    """The two artifacts' stored calibration scores, on the same calibration answers."""
    full, fast = GuardArtifact.load(full_path), GuardArtifact.load(fast_path)
    kinds = (full.scorer.kind, fast.scorer.kind)
    if kinds != ("geometry", "geometry_fast"):
        raise SystemExit(f"expected a geometry and a geometry_fast artifact, got {kinds}")
    ids = (full.metadata["calibration_ids"], fast.metadata["calibration_ids"])
    if ids[0] != ids[1] or not np.array_equal(full.correct, fast.correct):
        raise SystemExit("the artifacts' calibration answers or labels differ")
    return {"calibration": compare(full.scores, fast.scores, np.asarray(full.correct, bool))}


def _row(split: str, r: dict[str, Any]) -> str:
    def cell(name: str) -> str:
        lo, hi = r[name]["interval"]
        return f"{r[name]['auroc']:.3f} [{lo:.3f}, {hi:.3f}]"

    lo, hi = r["difference"]["interval"]
    return (
        f"| {split} | {r['correct']} / {r['incorrect']} | {cell('geometry')} | "
        f"{cell('geometry_fast')} | {r['difference']['auroc']:+.3f} [{lo:+.3f}, {hi:+.3f}] |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="source", required=True)
    f = sub.add_parser("features")
    f.add_argument("path", type=Path)
    f.add_argument("--artifact", default="abstain_guard/default_guard")
    f.add_argument("--seed", type=int, default=0)
    a = sub.add_parser("artifacts")
    a.add_argument("full")
    a.add_argument("fast")
    args = ap.parse_args()
    if args.source == "features":
        result = from_features(args.path, args.artifact, args.seed)
    else:
        result = from_artifacts(args.full, args.fast)
    for split, r in result.items():
        print(_row(split, r))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
