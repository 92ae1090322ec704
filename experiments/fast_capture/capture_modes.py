"""Full capture, fast capture and no capture on the embedded model, side by side (one JSON line).

The twelve load-test questions (``bench/serving/serve_load.py``) as the shipped guard asks them,
``--repeats`` interleaved rounds per mode: ``solo_s`` (the twelve one call after another) and
``batch_s`` (the twelve twice, through ``batch``: concurrent calls sharing decode steps), the
medians, their ratios to full capture, and whether the residual-stream summary the probes
read (``geometry["hidden"]``), the log-probabilities and the tokens are bitwise the same in
full and fast capture (why a probe guard runs fast: ``ProbeScorerBase.capture``).

Run: ``flock /tmp/heavy.lock .venv/bin/python experiments/fast_capture/capture_modes.py``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from langchain_core.messages import HumanMessage, SystemMessage

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "serving"))
from serve_load import QUESTIONS

from abstain_guard.adapters import load_default_model
from abstain_guard.adapters.engine.kernels import kernel_facts
from abstain_guard.contract.prompts import system_prompt_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    full = load_default_model(max_new_tokens=24)
    models: dict[str, Any] = {"full": full}
    for name, update in (("fast", {"capture": "fast"}), ("none", {"capture_geometry": False})):
        models[name] = full.model_copy(update=update)
        models[name]._shared = full._shared
    convs = [[SystemMessage(system_prompt_for("open")), HumanMessage(q)] for q in QUESTIONS]
    for m in models.values():
        m.invoke(convs[0])  # warm-up (the prefix store, first-call costs)
    solo: dict[str, list[float]] = {k: [] for k in models}
    batch: dict[str, list[float]] = {k: [] for k in models}
    answers: dict[str, list[Any]] = {}
    for _ in range(args.repeats):
        for name, m in models.items():
            t = time.perf_counter()
            answers[name] = [m.invoke(c) for c in convs]
            solo[name].append(time.perf_counter() - t)
        for name, m in models.items():
            t = time.perf_counter()
            m.batch(convs * 2)
            batch[name].append(time.perf_counter() - t)
    meta = {k: [a.response_metadata for a in v] for k, v in answers.items()}
    same = {
        key: all(a[key] == b[key] for a, b in zip(meta["full"], meta["fast"], strict=True))
        for key in ("token_ids", "logprobs", "entropy")
    }
    same["hidden"] = all(
        a["geometry"]["hidden"] == b["geometry"]["hidden"]
        for a, b in zip(meta["full"], meta["fast"], strict=True)
    )
    out: dict[str, Any] = {
        "bench": "capture_modes",
        "model": full.model_name,
        "kernel_facts": kernel_facts("cpu"),
        "questions": len(QUESTIONS),
        "repeats": args.repeats,
        "decode_path": full.decode_path(),
    }
    for name in models:
        out[name] = {
            "solo_s": round(statistics.median(solo[name]), 2),
            "batch_s": round(statistics.median(batch[name]), 2),
        }
    for name in ("fast", "none"):
        out[f"{name}_over_full"] = {
            k: round(out[name][k] / out["full"][k], 3) for k in ("solo_s", "batch_s")
        }
    out["fast_equals_full_bitwise"] = same
    print(json.dumps(out))


if __name__ == "__main__":
    main()
