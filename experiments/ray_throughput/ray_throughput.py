"""Answers per second of ``calibrate --executor ray`` generation with 1 and 2 local replicas.

    flock /tmp/model.lock python experiments/ray_throughput/ray_throughput.py --questions 40

For each replica count, a fresh local Ray cluster (``--cpus`` CPUs) starts that many replicas
of the embedded model (each with the driver's torch thread count, as ``calibrate`` does, so
the answers are bitwise the local run's), waits until they are loaded, then generates the
first ``--questions`` built-in probe questions through
:meth:`~abstain_guard.calibration.building.answering.executors.RayExecutor.generate` in the chunks a
local run uses (``batch_size`` questions, one kind per chunk; no capture, as train / held-out
generation without means). Model loading is timed apart. Also checks that both runs gave the
same answers (token ids), and, as the baseline, times the same chunks generated in this
process without Ray (what ``--executor local`` does). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

from abstain_guard.calibration.building.answering.answer_rows import plan_chunks
from abstain_guard.calibration.building.answering.answers import generate_chunk
from abstain_guard.calibration.building.answering.executors import RayExecutor, local_threads
from abstain_guard.calibration.building.answering.models import load_model
from abstain_guard.calibration.building.questions.datasets import QAItem
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig


def _timing(
    items: list[QAItem], token_ids: dict[str, Any], seconds: float, load_s: float
) -> dict[str, Any]:
    """One run's figures, with a digest of its answers' token ids (in ``items`` order)."""
    digest = hashlib.sha256(json.dumps([token_ids[it.id] for it in items]).encode()).hexdigest()
    return {
        "answers_per_s": round(len(items) / seconds, 3),
        "seconds": round(seconds, 1),
        "load_s": round(load_s, 1),
        "token_ids_sha256": digest[:16],
    }


def run(replicas: int, items: list[QAItem], args: argparse.Namespace) -> dict[str, Any]:
    """Start ``replicas`` replicas on a fresh local cluster and time generating ``items``."""
    import ray

    ray.init(
        num_cpus=args.cpus,
        include_dashboard=False,
        object_store_memory=200 * 1024**2,
        _temp_dir=f"/tmp/agray-bench-{os.getpid()}",
        log_to_driver=False,
    )
    try:
        config = CalibrationConfig(
            executor="ray",
            replicas=replicas,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
        )
        t = time.perf_counter()
        executor = RayExecutor.start(config)
        load_s = time.perf_counter() - t
        rows: dict[str, Any] = {}

        def done(index: int, chunk: list[QAItem], outputs: list[Any]) -> None:
            for it, (row, _) in zip(chunk, outputs, strict=True):
                rows[it.id] = row["metadata"]["token_ids"]

        t = time.perf_counter()
        executor.generate(
            plan_chunks(items, args.batch_size), capture="none", reference=None, on_done=done
        )
        seconds = time.perf_counter() - t
        executor.shutdown()
    finally:
        ray.shutdown()
    return _timing(items, rows, seconds, load_s)


def run_local(items: list[QAItem], args: argparse.Namespace) -> dict[str, Any]:
    """The same chunks through :func:`generate_chunk` in this process (no Ray)."""
    config = CalibrationConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    t = time.perf_counter()
    model = load_model(config)
    load_s = time.perf_counter() - t
    rows: dict[str, Any] = {}
    t = time.perf_counter()
    for _, chunk in plan_chunks(items, args.batch_size):
        outputs = generate_chunk(model, chunk, config, "none", None)
        for it, (row, _) in zip(chunk, outputs, strict=True):
            rows[it.id] = row["metadata"]["token_ids"]
    return _timing(items, rows, time.perf_counter() - t, load_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    items = builtin_probe_set()[: args.questions]
    local = run_local(items, args)
    results = {str(n): run(n, items, args) for n in (1, 2)}
    print(
        json.dumps(
            {
                "bench": "ray_throughput",
                "questions": len(items),
                "max_new_tokens": args.max_new_tokens,
                "batch_size": args.batch_size,
                "cpus": args.cpus,
                "torch_threads_per_replica": local_threads(),
                "local": local,
                "replicas": results,
                "ratio_2_over_1": round(
                    results["2"]["answers_per_s"] / results["1"]["answers_per_s"], 3
                ),
                "same_answers": len({r["token_ids_sha256"] for r in [local, *results.values()]})
                == 1,
            }
        )
    )


if __name__ == "__main__":
    main()
