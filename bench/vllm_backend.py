"""The vLLM backend side by side with plain vLLM and the project's engine (issue 47).

On the embedded model, the same built-in probe questions (the last ``--questions`` of the
set, greedy, the artifact's system prompt and budget), at 1, 8 and 32 requests in flight:

(a) **plain vLLM**: the engine (:mod:`abstain_guard.backends.vllm_engine`) started with
    ``--no-capture`` — no hooks, no hidden states, no entropies — asked over HTTP;
(b) **the guarded vLLM backend**: the guard chain of a vLLM-calibrated artifact
    (``load_guard_chain``: VLLMChatModel on a capturing engine, the probe scores every
    response, the guard decides), called from as many threads;
(c) **the shipped guard on the project's engine** (``abstain_guard/default_guard``) at 8.

Phases interleave (plain, guarded, project; ``--repeats`` times) and each reports the
median over repeats: throughput (requests/s over the phase's wall time) and p95 latency;
``p95_over_solo`` is the p95 at each level over the median latency at 1. Engine start-up is
not timed. Then ``evaluate --live`` at 8 concurrent on the artifact's held-out questions:
``live_max_abs_diff`` (live − stored score) and ``live_same_decision``.

The last line is one JSON object: ``guarded_over_plain`` and ``p95_over_solo`` (keyed by
concurrency), ``guarded_over_project_engine`` (at 8), ``live_max_abs_diff``,
``live_same_decision``, every measurement, and the processor's facts.

``--gpu``: a random-weight Qwen3-8B shape in bfloat16 (vLLM ``load_format=dummy``), plain vs
guarded tokens/s at batch 1 and 32 and the engine's extra memory (run where a GPU is lent).

Run (idle machine; vLLM's environment from ``make install``)::

    ABSTAIN_GUARD_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python bench/vllm_backend.py \\
        --artifact runs/vllm_probe > bench/vllm_backend.log
    tail -1 bench/vllm_backend.log > bench/vllm_backend.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

LEVELS = (1, 8, 32)
REQUESTS = {1: 16, 8: 48, 32: 96}


def drive(call: Callable[[str], Any], questions: Sequence[str], concurrency: int) -> dict:
    """``call`` on every question, ``concurrency`` at once: throughput and latencies."""
    latencies: list[float] = []

    def timed(q: str) -> None:
        t = time.perf_counter()
        call(q)
        latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(timed, questions))
    wall = time.perf_counter() - start
    return {
        "requests": len(questions),
        "wall_s": wall,
        "throughput_rps": len(questions) / wall,
        "p50_s": float(np.percentile(latencies, 50)),
        "p95_s": float(np.percentile(latencies, 95)),
    }


def levels(call: Callable[[str], Any], pool: Sequence[str], which: Sequence[int]) -> dict:
    call(pool[0])  # warm: the first request of an engine pays one-off costs
    return {str(c): drive(call, list(pool[: REQUESTS[c]]), c) for c in which}


def set_requests(spec: str) -> None:
    """``--requests 16,48,96``: requests per level (1, 8, 32)."""
    counts = [int(x) for x in spec.split(",")]
    REQUESTS.update(dict(zip(LEVELS, counts, strict=True)))


def processor() -> dict[str, Any]:
    from abstain_guard.adapters.engine.kernels import kernel_facts

    return {"machine": platform.machine(), "python": sys.version.split()[0], **kernel_facts()}


def cpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    from abstain_guard import GuardArtifact
    from abstain_guard.adapters.model.vllm_folder import vllm_model_folder as folder_of
    from abstain_guard.backends.vllm_chat import _Engine, engine_python, stop_engines
    from abstain_guard.calibration.building.questions.items import load_items
    from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
    from abstain_guard.calibration.measure.deployment_check import live_check
    from abstain_guard.default import default_artifact_path
    from abstain_guard.guard.chains import load_guard_chain

    artifact = GuardArtifact.load(args.artifact)
    record = artifact.metadata["deployment"]
    system = record["prompts"]["open"]["system_prompt"]
    budget = int(record["prompts"]["open"]["max_new_tokens"])
    items, _ = load_items("builtin", CalibrationConfig())
    pool = [it.prompt_text() for it in items[-args.questions :]]

    def plain_phase() -> dict:
        engine = _Engine(
            engine_python(None),
            folder_of("default"),
            {
                "dtype": "float32",
                "memory_fraction": 0.15,
                "max_model_len": 2048,
                "extra_args": ["--no-capture"],
            },
        )
        try:
            engine.wait(600)
            client = httpx.Client(timeout=600)

            def ask(q: str) -> Any:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                body = {"messages": messages, "max_tokens": budget, "top_logprobs": 5}
                return client.post(engine.url + "/generate", json=body).raise_for_status()

            return levels(ask, pool, LEVELS)
        finally:
            engine.close()

    def guarded_phase() -> dict:
        chain = load_guard_chain(args.artifact)[0]
        try:
            return levels(lambda q: chain.invoke({"question": q}), pool, LEVELS)
        finally:
            stop_engines()

    def project_phase() -> dict:
        chain = load_guard_chain(default_artifact_path())[0]
        return levels(lambda q: chain.invoke({"question": q}), pool, (8,))

    runs: dict[str, list[dict]] = {"plain": [], "guarded": [], "project_engine": []}
    for r in range(args.repeats):
        for name, phase in (
            ("plain", plain_phase),
            ("guarded", guarded_phase),
            ("project_engine", project_phase),
        ):
            t = time.perf_counter()
            runs[name].append(phase())
            print(
                json.dumps({"repeat": r, "phase": name, "s": time.perf_counter() - t}),
                file=sys.stderr,
                flush=True,
            )

    def median(name: str, level: str, key: str) -> float:
        return float(statistics.median(run[level][key] for run in runs[name]))

    out: dict[str, Any] = {"medians": {}}
    for name, which in (("plain", LEVELS), ("guarded", LEVELS), ("project_engine", (8,))):
        out["medians"][name] = {
            str(c): {k: median(name, str(c), k) for k in ("throughput_rps", "p50_s", "p95_s")}
            for c in which
        }
    m = out["medians"]
    out["guarded_over_plain"] = {
        str(c): m["guarded"][str(c)]["throughput_rps"] / m["plain"][str(c)]["throughput_rps"]
        for c in LEVELS
    }
    out["p95_over_solo"] = {
        str(c): m["guarded"][str(c)]["p95_s"] / m["guarded"]["1"]["p50_s"] for c in LEVELS
    }
    out["plain_p95_over_solo"] = {
        str(c): m["plain"][str(c)]["p95_s"] / m["plain"]["1"]["p50_s"] for c in LEVELS
    }
    out["guarded_over_project_engine"] = (
        m["guarded"]["8"]["throughput_rps"] / m["project_engine"]["8"]["throughput_rps"]
    )
    live = live_check(args.artifact, limit=args.live, progress=False, concurrency=8)
    stop_engines()
    summary = live["summary"]
    out["live_max_abs_diff"] = summary["abs_score_diff_max"]
    out["live_same_decision"] = summary["same_decision"]
    out["live_same_tokens"] = summary["same_tokens"]
    out["live_n"] = summary["n"]
    out["runs"] = runs
    out["artifact"] = str(args.artifact)
    out["decode_path"] = record["decoding"].get("decode_path")
    out["questions"] = len(pool)
    out["repeats"] = args.repeats
    out["processor"] = processor()
    return out


def gpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Random-weight Qwen3-8B shape, bfloat16: plain vs capturing engine, tokens/s at batch
    1 and 32, and the memory the engine process holds (the capture's rows are per request)."""
    import tempfile

    from abstain_guard.backends.vllm_chat import _Engine, engine_python

    folder = Path(tempfile.mkdtemp(prefix="qwen3-8b-shape-"))
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (folder / "config.json").write_text(json.dumps(config))
    from abstain_guard.adapters.model.vllm_folder import vllm_model_folder

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = vllm_model_folder("default") / name
        if src.exists():
            (folder / name).write_bytes(src.read_bytes())
    prompt = [{"role": "user", "content": "Write about the history of the printing press."}]
    result: dict[str, Any] = {}
    for mode, extra in (("plain", ["--no-capture"]), ("guarded", [])):
        engine = _Engine(
            engine_python(None),
            folder,
            {
                "dtype": "bfloat16",
                "memory_fraction": 0.85,
                "max_model_len": 4096,
                "extra_args": ["--load-format", "dummy", *extra],
            },
        )
        try:
            engine.wait(1200)
            client = httpx.Client(timeout=1200)

            def ask(_: str, client: httpx.Client = client, url: str = engine.url) -> Any:
                body = {"messages": prompt, "max_tokens": 256, "top_logprobs": 0}
                return client.post(url + "/generate", json=body).raise_for_status().json()

            ask("")
            for batch in (1, 32):
                t = time.perf_counter()
                with ThreadPoolExecutor(batch) as pool:
                    outs = list(pool.map(ask, [""] * batch))
                wall = time.perf_counter() - t
                tokens = sum(len(o["token_ids"]) for o in outs)
                result[f"{mode}_tokens_per_s_batch{batch}"] = tokens / wall
        finally:
            engine.close()
    for b in (1, 32):
        result[f"guarded_over_plain_batch{b}"] = (
            result[f"guarded_tokens_per_s_batch{b}"] / result[f"plain_tokens_per_s_batch{b}"]
        )
    result["processor"] = processor()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", default="runs/vllm_probe", help="a vLLM-calibrated artifact")
    p.add_argument("--questions", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--live", type=int, default=40, help="held-out questions for the live check")
    p.add_argument("--requests", default="16,48,96", help="requests at 1, 8 and 32 at once")
    p.add_argument("--gpu", action="store_true")
    args = p.parse_args()
    set_requests(args.requests)
    out = gpu_bench(args) if args.gpu else cpu_bench(args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
