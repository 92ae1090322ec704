"""The guard on stock vLLM against stock vLLM.

On the embedded model, the same built-in probe questions (the last ``--questions`` of the
set, greedy, the artifact's system prompt and budget), at 1, 8 and 32 requests in flight:

(a) **stock, default**: vLLM's OpenAI server (``vllm serve``: ``vllm.entrypoints.openai.
    api_server``) with its default settings — compiled graphs on the CPU — asked for the
    chat completion a user asks for (messages, ``max_tokens``, ``temperature: 0``);
(b) **stock, --enforce-eager**: the same with eager execution (reference only);
(c) **guarded**: the guard as a user deploys it — ``load_guard_chain`` on a probe guard
    calibrated on vLLM: :class:`~abstain_guard.backends.vllm_chat.VLLMChatModel` on the same
    stock server started with the guard's connector flag (default settings otherwise), the
    probe scoring every response, the guard deciding.

Every side is called the same way: through one ``httpx.Client`` per process (a connection
pool with keep-alive and one TLS context, as the guard's client does), from as many threads as
requests in flight. Phases interleave (each repeat runs every level on
every side, the side order rotating), and the JSON keeps each repeat's ratio beside the
medians: throughput (answers/s over the phase's wall time) and p95 latency (``p95_over_solo``:
p95 at a level over the median latency alone). Server start-up (vLLM compiles) is not timed.

Then live = stored: the guard chain on ``--live`` of the artifact's calibration questions at
8 and 32 in flight against the scores calibration stored (max |live − stored|, decisions that
differ and how far their scores sit from τ).

``--gpu`` (one script, under 8 minutes on one GPU): a random-weight Qwen3-8B shape in
bfloat16 (``--load-format dummy``, token-id prompts, ``--skip-tokenizer-init``), CUDA graphs
on, on three servers started **one after the other** (vLLM's memory profiling assumes no
other process on the device frees memory while it runs): stock ``vllm serve`` on the V1
model runner the guard's connector runs on, the same server with the connector, and stock
with vLLM's default runner (V2 where vLLM picks it). Tokens/s at batch 1 and 32 (256-token
prompts, 128 tokens each, ``ignore_eos``), each median over ``--repeats`` rounds, every
guarded response's capture checked (signed, bound to its tokens), and the KV-cache size each
server's profiling left (the capture's memory shows there). ``--gpu --smoke``: the same
script on a toy width of the same architecture, eager, on the CPU (``--out FILE`` writes the
JSON, ``$OUT/vllm_backend_gpu.json`` on a lent device). A side not started before
``--budget-s`` (default 450 s) is recorded as skipped, so the script ends in time.

Run (idle machine; vLLM's environment from ``make install``)::

    .venv/bin/abstain-guard calibrate --data builtin --config configs/vllm_probe.yaml \\
        --out runs/vllm_probe --limit 400
    ABSTAIN_GUARD_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python \\
        bench/serving/vllm_backend.py --artifact runs/vllm_probe --repeats 3 \\
        > runs/vllm_backend.log
    tail -1 runs/vllm_backend.log > bench/serving/vllm_backend.json
    # on one GPU (vLLM's environment, the vllm package):
    python bench/serving/vllm_backend.py --gpu --out $OUT/vllm_backend_gpu.json
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

LEVELS = (1, 8, 32)
REQUESTS = {1: 16, 8: 48, 32: 96}


def completion_tokens(reply: Any) -> int:
    """Tokens generated for one reply: the OpenAI body's ``usage`` (stock), or the guarded
    message's token ids (answered, or withheld when the guard abstained)."""
    if isinstance(reply, dict):
        return int(reply["usage"]["completion_tokens"])
    meta = reply.response_metadata
    ids = meta.get("token_ids")
    if ids is None:
        ids = (meta.get("withheld_response") or {}).get("response_metadata", {})["token_ids"]
    return len(ids)


def drive(call: Callable[[str], Any], questions: Sequence[str], concurrency: int) -> dict:
    """``call`` on every question, ``concurrency`` at once: throughput, latencies and the
    tokens each question's reply generated (so the sides are seen to do the same work)."""
    latencies: list[float] = []
    tokens: dict[str, int] = {}

    def timed(q: str) -> None:
        t = time.perf_counter()
        reply = call(q)
        latencies.append(time.perf_counter() - t)
        tokens[q] = completion_tokens(reply)

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
        "completion_tokens": [tokens[q] for q in questions],
    }


def stock_server(
    python: str, folder: Path, extra: Sequence[str], env: dict[str, str] | None = None
) -> Any:
    """vLLM's OpenAI server, stock settings plus ``extra`` flags, in vLLM's environment
    (started; :meth:`~abstain_guard.backends.vllm_engine.ServerProcess.wait` for it)."""
    from abstain_guard.backends.vllm_engine import ServerProcess, free_port

    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    cmd += ["--max-model-len", "2048", "--seed", "0", "--gpu-memory-utilization", "0.15"]
    return ServerProcess([*cmd, *extra], port, env)


def processor() -> dict[str, Any]:
    from abstain_guard.adapters.engine.kernels import kernel_facts

    return {
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        **kernel_facts(),
    }


def _ratio_stats(ratios: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def cpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    from abstain_guard import GuardArtifact
    from abstain_guard.adapters.model.vllm_folder import vllm_model_folder
    from abstain_guard.backends.vllm_chat import stop_engines
    from abstain_guard.backends.vllm_engine import engine_python
    from abstain_guard.calibration.building.questions.items import load_items
    from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
    from abstain_guard.guard.chains import load_guard_chain

    artifact = GuardArtifact.load(args.artifact)
    record = artifact.metadata["deployment"]
    system = record["prompts"]["open"]["system_prompt"]
    budget = int(record["prompts"]["open"]["max_new_tokens"])
    items, _ = load_items("builtin", CalibrationConfig())
    pool = [it.prompt_text() for it in items[-args.questions :]]
    python = engine_python(None)
    folder = vllm_model_folder("default")
    servers = {
        "stock_default": stock_server(python, folder, []),
        "stock_eager": stock_server(python, folder, ["--enforce-eager"]),
    }
    for server in servers.values():  # a failing run leaves no stock server behind
        atexit.register(server.close)
    chain, guard, _ = load_guard_chain(args.artifact)  # starts the guarded server
    engine = guard.runnable.bound if hasattr(guard.runnable, "bound") else None
    record_engine = engine.engine_record() if engine is not None else None
    for server in servers.values():
        server.wait(900.0)

    client = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def plain(url: str) -> Callable[[str], Any]:
        def call(q: str) -> Any:
            body = {
                "model": str(folder),
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                "max_tokens": budget,
                "temperature": 0.0,
            }
            got = client.post(url + "/v1/chat/completions", json=body, timeout=600.0)
            return got.raise_for_status().json()

        return call

    def guarded(q: str) -> Any:
        message = chain.invoke({"question": q})
        decision = message.response_metadata["abstention"]
        if decision.get("error"):
            raise RuntimeError(f"the guard could not score: {decision}")
        return message

    sides: dict[str, Callable[[str], Any]] = {
        "stock_default": plain(servers["stock_default"].url),
        "stock_eager": plain(servers["stock_eager"].url),
        "guarded": guarded,
    }
    for call in sides.values():  # warm: each server's first request pays one-off costs
        call(pool[0])
        call(pool[1])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    order = list(sides)
    for repeat in range(args.repeats):
        turn = order[repeat % len(order) :] + order[: repeat % len(order)]
        for name in turn:
            runs[name].append({str(c): drive(sides[name], pool[: REQUESTS[c]], c) for c in LEVELS})
        print(json.dumps({"repeat": repeat, "order": turn}), file=sys.stderr, flush=True)
    summary: dict[str, Any] = {}
    for level in map(str, LEVELS):
        per = {name: [r[level]["throughput_rps"] for r in runs[name]] for name in sides}
        summary[level] = {
            "throughput_rps_median": {n: statistics.median(v) for n, v in per.items()},
            "guarded_over_stock_default": _ratio_stats(
                [g / s for g, s in zip(per["guarded"], per["stock_default"], strict=True)]
            ),
            "guarded_over_stock_default_each_repeat": [
                g / s for g, s in zip(per["guarded"], per["stock_default"], strict=True)
            ],
            "guarded_over_stock_eager_each_repeat": [
                g / s for g, s in zip(per["guarded"], per["stock_eager"], strict=True)
            ],
            "p95_s_median": {
                n: statistics.median(r[level]["p95_s"] for r in runs[n]) for n in sides
            },
        }
    first = {n: runs[n][0]["32"]["completion_tokens"] for n in sides}
    summary["completion_tokens"] = {
        "total": {n: sum(v) for n, v in first.items()},
        "questions_with_other_count_than_stock_default": {
            n: sum(a != b for a, b in zip(v, first["stock_default"], strict=True))
            for n, v in first.items()
        },
    }
    solo = {n: statistics.median(r["1"]["p50_s"] for r in runs[n]) for n in sides}
    for level in map(str, LEVELS):
        summary[level]["p95_over_solo"] = {
            n: summary[level]["p95_s_median"][n] / solo[n] for n in sides
        }
    live = live_bound(args) if args.live else None
    for server in servers.values():
        server.close()
    stop_engines()
    return {
        "bench": "vllm_backend",
        "questions": len(pool),
        "budget": budget,
        "repeats": args.repeats,
        "requests": REQUESTS,
        "summary": summary,
        "live": live,
        "guarded_engine": record_engine,
        "runs": runs,
        "processor": processor(),
    }


def live_bound(args: argparse.Namespace) -> dict[str, Any]:
    """Live = stored on the artifact's calibration questions at 8 and 32 in flight."""
    from abstain_guard.calibration.measure.deployment_check import live_check

    out: dict[str, Any] = {}
    for level in (8, 32):
        result = live_check(
            args.artifact, limit=args.live, progress=False, concurrency=level, split="calibration"
        )
        rows = result["rows"]
        moved = [r for r in rows if r["stored_answers"] == r["abstained"]]
        out[str(level)] = {
            "n": result["summary"]["n"],
            "max_abs_diff": result["summary"]["abs_score_diff_max"],
            "same_tokens": result["summary"]["same_tokens"],
            "decisions_differ": len(moved),
            "their_distance_to_tau": [abs(r["stored_score"] - result["threshold"]) for r in moved],
        }
    return out


#: A Qwen3-8B shape (random weights: vLLM's ``--load-format dummy``).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
#: The same architecture at toy width (``--smoke``: the GPU script end to end on a CPU).
QWEN3_TINY = {
    **QWEN3_8B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: The three servers, started one after the other (vLLM's memory profiling assumes no other
#: process on the device frees memory while it runs): stock vLLM on the runner the guard
#: uses (V1), the guarded server (V1, the connector), stock vLLM with its default runner.
GPU_SIDES = {
    "stock_v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    "guarded": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    "stock_default": {},
}


def _gpu_call(url: str, model: str, guarded: bool, key: bytes, new_tokens: int) -> Any:
    from abstain_guard.backends.vllm_payload import PAYLOAD_KEY, decode_capture, request_token

    client = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def one(prompt: list[int]) -> int:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if guarded:
            body["kv_transfer_params"] = {PAYLOAD_KEY: {"token": request_token(key)}}
        reply = client.post(url + "/v1/completions", json=body, timeout=600.0)
        reply = reply.raise_for_status().json()
        choice = reply["choices"][0]
        ids = choice["token_ids"]
        if guarded:  # every guarded response's capture, signed and bound to its tokens
            prompt_ids = reply.get("prompt_token_ids") or choice.get("prompt_token_ids")
            decode_capture(reply.get("kv_transfer_params"), prompt_ids, ids, key)
        return len(ids)

    return one


def _measure(one: Any, prompts: list[list[int]], batches: Sequence[int], repeats: int) -> dict:
    """Tokens/s at each batch size, ``repeats`` interleaved rounds (median and each)."""
    runs: dict[str, list[float]] = {str(b): [] for b in batches}
    for _ in range(repeats):
        for batch in batches:
            work = prompts[: max(batch, 4)] if batch > 1 else prompts[:4]
            start = time.perf_counter()
            with ThreadPoolExecutor(batch) as pool:
                total = sum(pool.map(one, work))
            runs[str(batch)].append(total / (time.perf_counter() - start))
    return {b: {"median": statistics.median(v), "each": v} for b, v in runs.items()}


def _kv_tokens(log: Path) -> int | None:
    """The KV-cache size the server's profiling left it (its log), in tokens."""
    import re

    text = log.read_text(errors="replace") if log.exists() else ""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", text)
    return int(found[-1].replace(",", "")) if found else None


def gpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The Qwen3-8B shape in bfloat16, CUDA graphs on (vLLM's defaults otherwise), on three
    servers one after the other; ``--smoke``: a toy width on the CPU, eager."""
    from abstain_guard.backends.vllm_engine import engine_python
    from abstain_guard.backends.vllm_payload import PAYLOAD_KEY_ENV, connector_flag, payload_key

    t0 = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="qwen3_shape_"))
    (folder / "config.json").write_text(json.dumps(QWEN3_TINY if args.smoke else QWEN3_8B))
    common = ["--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16"]
    common += ["--max-model-len", "1024", "--gpu-memory-utilization", "0.85"]
    if args.smoke:  # compiling costs minutes on a CPU and says nothing of a GPU
        common += ["--enforce-eager", "--dtype", "float32", "--gpu-memory-utilization", "0.1"]
    batches, new_tokens = ((1, 4), 8) if args.smoke else ((1, 32), 128)
    prompt_len = 32 if args.smoke else 256
    vocab = int((QWEN3_TINY if args.smoke else QWEN3_8B)["vocab_size"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab - 10, size=prompt_len).tolist() for _ in range(64)]
    key = payload_key(generate=True)
    python = engine_python(None)
    sides: dict[str, Any] = {}
    for name, env in GPU_SIDES.items():
        left = args.budget_s - (time.monotonic() - t0)
        if left < 60:  # not enough for a start and a measurement: the script ends in time
            sides[name] = {"error": f"skipped: {args.budget_s:.0f} s budget spent"}
            continue
        extra = [*common, *connector_flag()] if name == "guarded" else list(common)
        started = time.monotonic()
        environ = {**os.environ, **env, PAYLOAD_KEY_ENV: key.decode()}
        if args.smoke:  # vLLM's CPU core binding as stock's on every side (docs/vllm.md)
            environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        server = stock_server(python, folder, extra, env=environ)
        try:
            server.wait(left)
            start_s = time.monotonic() - started
            one = _gpu_call(server.url, str(folder), name == "guarded", key, new_tokens)
            one(prompts[0])  # warm
            sides[name] = {
                "start_s": round(start_s, 1),
                "kv_cache_tokens": _kv_tokens(server.log),
                "tokens_per_s": _measure(one, prompts, batches, args.repeats),
            }
        except Exception as exc:  # recorded; the next server still runs
            sides[name] = {
                "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "log": str(server.log),
            }
        finally:
            server.close(keep_log=args.keep_logs or "error" in sides.get(name, {}))
        print(json.dumps({"side": name, **sides[name]}), file=sys.stderr, flush=True)
    speed = {n: v["tokens_per_s"] for n, v in sides.items() if "tokens_per_s" in v}
    ratios = {
        f"guarded_over_{base}": {
            b: speed["guarded"][b]["median"] / speed[base][b]["median"] for b in map(str, batches)
        }
        for base in ("stock_v1", "stock_default")
        if "guarded" in speed and base in speed
    }
    return {
        "bench": "vllm_backend_gpu",
        "command": "python bench/serving/vllm_backend.py --gpu"
        + (" --smoke" if args.smoke else ""),
        "shape": ("Qwen3 toy width" if args.smoke else "Qwen3-8B") + " (random weights)",
        "dtype": "float32" if args.smoke else "bfloat16",
        "cuda_graphs": not args.smoke,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "sides": sides,
        **ratios,
        "elapsed_s": round(time.monotonic() - t0, 1),
        "processor": processor(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", default="runs/vllm_probe")
    parser.add_argument("--questions", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--live", type=int, default=64, help="calibration questions asked live")
    parser.add_argument("--requests", default=None, help="requests per level, e.g. 16,48,96")
    parser.add_argument("--gpu", action="store_true", help="the Qwen3-8B shape on a GPU")
    parser.add_argument("--smoke", action="store_true", help="with --gpu: a toy width, CPU")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    parser.add_argument("--out", default=None, help="with --gpu: write the JSON here too")
    parser.add_argument("--budget-s", type=float, default=450.0, help="with --gpu: seconds")
    args = parser.parse_args(argv)
    if args.gpu:
        result = json.dumps(gpu_bench(args))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(result + "\n")
        print(result)
        return 0
    if args.requests:
        REQUESTS.update(dict(zip(LEVELS, map(int, args.requests.split(",")), strict=True)))
    print(json.dumps(cpu_bench(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
