"""What the CPU kernel settings cost and how far they move the shipped guard's scores.

One worker process per setting (the settings are read once per process, so they cannot be
switched inside one), each loading the embedded model once; the parent interleaves them, so
every repeat times every setting back to back:

* ``portable``: the library's default (``ATEN_CPU_CAPABILITY=avx2``, ``MKL_CBWR=AVX2``);
* ``native``: nothing forced (``ABSTAIN_GUARD_NATIVE_KERNELS=1``): what torch picks here;
* ``aten_default``: ATen's scalar kernels (``ATEN_CPU_CAPABILITY=default``), a stand-in for
  "another machine's ATen";
* ``mkl_avx2``: MKL's reproducibility on with the ``AVX2`` branch (``MKL_CBWR=AVX2``: the
  same bits on every Intel CPU with AVX2; MKL runs its ``AUTO`` branch on other vendors');
* ``mkl_compatible``: MKL's ``COMPATIBLE`` branch, the only one MKL keeps equal across CPU
  vendors.

Per setting: the kernel facts that decide the bits, ``prefill_ms`` (one 256-token prompt
pass on one thread, as the engine runs it), ``decode_ms`` (one decode step of 1 and of 4
rows on one thread), the median and min-max over ``--repeats`` interleaved repeats, their
ratios to ``portable``; ``rows_independent`` (shared decode steps possible); and the scores
of the shipped guard's first ``--answers`` calibration answers through the deployed chain
(``on_mismatch="warn"``): max |Δ| to the stored scores and to ``portable``'s.

Run: ``flock /tmp/heavy.lock .venv/bin/python bench/speed/kernel_settings.py`` (``--settings
portable,mkl_avx2`` for some of them; ``portable`` always runs, it is the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SETTINGS: dict[str, dict[str, str]] = {
    "portable": {},
    "native": {"ABSTAIN_GUARD_NATIVE_KERNELS": "1"},
    "aten_default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl_avx2": {"MKL_CBWR": "AVX2"},
    "mkl_compatible": {"MKL_CBWR": "COMPATIBLE"},
}


# ---- worker (one process per setting) ---------------------------------------------------


def _worker() -> None:
    import torch
    from transformers import DynamicCache

    from abstain_guard import GuardArtifact, GuardConfig, default_artifact_path
    from abstain_guard.adapters import load_default_model
    from abstain_guard.adapters.engine.kernels import kernel_facts
    from abstain_guard.adapters.engine.threads import model_independent_rows
    from abstain_guard.calibration.measure.held_out import artifact_items
    from abstain_guard.contract.kernels import bit_deciding
    from abstain_guard.guard.chains import load_guard_chain

    model = load_default_model(max_new_tokens=24)
    hf = model.hf_model
    torch.set_num_threads(1)

    def prefill_s() -> float:
        ids = torch.randint(100, 1000, (1, 256), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            start = time.perf_counter()
            hf(input_ids=ids, use_cache=False, logits_to_keep=1)
            return time.perf_counter() - start

    def decode_s(rows: int, steps: int = 12) -> float:
        ids = torch.randint(100, 1000, (rows, 40), generator=torch.Generator().manual_seed(rows))
        cache = DynamicCache(config=hf.config)
        with torch.inference_mode():
            tok = hf(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:]
            tok = tok.argmax(-1)
            start = time.perf_counter()
            for _ in range(steps):
                out = hf(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            return (time.perf_counter() - start) / steps

    def scores(n: int) -> list[float]:
        artifact = GuardArtifact.load(default_artifact_path())
        _, held_out, _ = artifact_items(artifact)
        by_id = {item.id: item for item in held_out}
        out = []
        for item_id in list(artifact.metadata["calibration_ids"])[:n]:
            item = by_id[item_id]
            chain, _, _ = load_guard_chain(
                artifact, GuardConfig(on_mismatch="warn"), model=model, kind=item.kind
            )
            message = chain.invoke({"question": item.prompt_text()})
            out.append(float(message.response_metadata["abstention"]["score"]))
        return out

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["do"] == "time":
            reply: dict[str, Any] = {
                "prefill": prefill_s(),
                "decode1": decode_s(1),
                "decode4": decode_s(4),
            }
        elif cmd["do"] == "facts":
            reply = {
                "facts": bit_deciding(kernel_facts("cpu")),
                "rows_independent": model_independent_rows(hf, 4, 8) >= 8,
            }
        else:
            reply = {"scores": scores(int(cmd["n"]))}
        print(json.dumps(reply), flush=True)


# ---- parent ----------------------------------------------------------------------------


def _start(name: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    env.update(SETTINGS[name])
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{") and json.loads(line).get("ready"):
            return proc
    raise RuntimeError(f"worker {name} did not start")


def _ask(proc: subprocess.Popen[str], cmd: dict[str, Any]) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError("worker ended")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--answers", type=int, default=8)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker()
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _measure import spread

    from abstain_guard import GuardArtifact, default_artifact_path

    stored = GuardArtifact.load(default_artifact_path()).scores[: args.answers].tolist()
    names = [
        "portable",
        *(n for n in args.settings.split(",") if n in SETTINGS and n != "portable"),
    ]
    workers = {name: _start(name) for name in names}
    times: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    try:
        for _ in range(args.repeats):
            for name, proc in workers.items():
                for key, value in _ask(proc, {"do": "time"}).items():
                    times[name].setdefault(key, []).append(value)
        facts = {name: _ask(proc, {"do": "facts"}) for name, proc in workers.items()}
        scored = {
            name: _ask(proc, {"do": "scores", "n": args.answers})["scores"]
            for name, proc in workers.items()
        }
    finally:
        for proc in workers.values():
            proc.kill()
    base = {k: statistics.median(v) for k, v in times["portable"].items()}
    result: dict[str, Any] = {"repeats": args.repeats, "answers": args.answers, "settings": {}}
    for name in names:
        result["settings"][name] = {
            "env": SETTINGS[name],
            **facts[name],
            **{f"{k}_ms": spread([1e3 * t for t in v], 1) for k, v in times[name].items()},
            "ratio_to_portable": {
                k: round(statistics.median(v) / base[k], 3) for k, v in times[name].items()
            },
            "max_abs_vs_stored": max(abs(a - b) for a, b in zip(scored[name], stored, strict=True)),
            "max_abs_vs_portable": max(
                abs(a - b) for a, b in zip(scored[name], scored["portable"], strict=True)
            ),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
