"""The same scorer calibrated on vLLM and on the project's engine, on the same questions.

Two artifacts calibrated on the same data with the same seed and ratios (so the same
calibration questions: checked), e.g. ``runs/vllm_probe`` (``configs/vllm_probe.yaml``) and
the shipped guard (``abstain_guard/default_guard``, ``probe_mid`` on the project's engine).
Each engine generated, judged and scored its own answers, so a question's label may differ
between them (the answers differ where the engines' last bits turn a greedy choice).

Prints one JSON object: per artifact the calibration AUROC (uncertainty vs wrong) with its
95 % bootstrap interval and the correct / incorrect counts behind it, the participation each
certifies at ε = 0.35, δ = 0.1 alone (``conformal.risk_threshold``, the guard's procedure;
the shipped guard's own certificate pays δ/13 for its scorer choice, reported beside it), the
smallest ε certified at δ = 0.1; the **paired** AUROC difference (vLLM − exact: the same
question resamples for both, each AUROC on its own engine's labels) with its interval; and
how often the two engines' answers got the same label.

Run: ``.venv/bin/python experiments/vllm/vllm_vs_exact.py runs/vllm_probe
abstain_guard/default_guard``
"""

from __future__ import annotations

import argparse
import json
import warnings

import numpy as np

from abstain_guard import GuardArtifact
from abstain_guard.calibration.measure.metrics import auroc
from abstain_guard.guarantee import conformal
from abstain_guard.guarantee.frontier import smallest_certifiable_risk

B = 2000
EPS, DELTA = 0.35, 0.1


def certified(scores: np.ndarray, correct: np.ndarray, delta: float) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        res = conformal.risk_threshold(scores, correct, EPS, delta)
    return float(res.participation) if res.feasible else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("vllm_artifact")
    p.add_argument("exact_artifact")
    args = p.parse_args()
    arts = {"vllm": GuardArtifact.load(args.vllm_artifact)}
    arts["exact"] = GuardArtifact.load(args.exact_artifact)
    ids = {k: list(a.metadata["calibration_ids"]) for k, a in arts.items()}
    if ids["vllm"] != ids["exact"]:
        raise SystemExit("the artifacts' calibration questions differ: same data, seed, ratios?")
    scores = {k: np.asarray(a.scores, dtype=np.float64) for k, a in arts.items()}
    correct = {k: np.asarray(a.correct, dtype=bool) for k, a in arts.items()}
    rng = np.random.default_rng(0)
    n = len(ids["vllm"])
    draws = rng.integers(0, n, size=(B, n))
    out: dict = {"n_calibration": n, "epsilon": EPS, "delta": DELTA, "resamples": B}
    boot = {}
    for k in arts:
        s, c = scores[k], correct[k]
        boot[k] = np.array([auroc(s[d], c[d]) for d in draws])
        selection = arts[k].metadata.get("selection") or {}
        k_candidates = len(selection.get("candidates", [])) or 1
        out[k] = {
            "artifact": str(args.vllm_artifact if k == "vllm" else args.exact_artifact),
            "auroc": auroc(s, c),
            "auroc_ci": [float(np.percentile(boot[k], 2.5)), float(np.percentile(boot[k], 97.5))],
            "correct": int(c.sum()),
            "incorrect": int((~c).sum()),
            "certified_participation_alone": certified(s, c, DELTA),
            "certified_participation_as_shipped": certified(s, c, DELTA / k_candidates),
            "delta_divided_by": k_candidates,
            "smallest_epsilon": smallest_certifiable_risk(s, c, DELTA),
        }
    diff = boot["vllm"] - boot["exact"]
    out["auroc_diff_vllm_minus_exact"] = out["vllm"]["auroc"] - out["exact"]["auroc"]
    out["auroc_diff_ci"] = [float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))]
    out["same_label"] = float(np.mean(correct["vllm"] == correct["exact"]))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
