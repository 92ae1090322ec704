"""Live scores of the shipped guard on in-distribution and shifted traffic (model runs).

Runs the shipped guard (``abstain_guard/default_guard``: SmolLM2-135M-Instruct, geometry_plus
scorer, calibrated on 960 built-in probe questions) exactly as deployed
(:func:`~abstain_guard.guard.chains.load_guard_chain`, one question per call) on four pools and
writes, per question, the live score, the decision and the artifact judge's verdict of the
answer (the withheld one for an abstention) to ``--out`` (JSON).
``experiments/drift/drift_monitor.py``
then feeds these scores to :class:`~abstain_guard.GuardMonitor`.

Pools:

* ``probe_fresh``: built-in probe questions the artifact never saw (positions 2400.. of the
  seeded probe order; calibration drew its 2400 from the same random order, so these are
  exchangeable with the calibration questions: the null).
* ``sciq``: SciQ test questions (``../shared/data/sciq``): science questions the capitals /
  elements / relations guard was not calibrated on.
* ``truthfulqa``: TruthfulQA questions (``../shared/data/truthfulqa``): adversarial
  misconceptions.
* ``swapped``: the fresh probe questions answered by a *swapped model*: SmolLM2 with Gaussian
  noise added to every weight matrix of its decoder layers (standard deviation ``--noise``
  times that matrix's own standard deviation) — what an unannounced model update (a
  re-quantisation, a fine-tune) looks like to a guard whose fingerprint check was turned off
  (``on_mismatch="warn"``) or cannot be made (an API model). Same architecture, so the
  geometry scorer still runs.

Run (about 20 minutes on 2 shared cores)::

    nohup flock /tmp/heavy.lock .venv/bin/python experiments/drift/drift_collect.py \
        --out runs/drift_scores.json > runs/drift_collect.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def _pool(chain: Any, items: list[Any], judge: Any, name: str) -> list[dict[str, Any]]:
    rows = []
    start = time.perf_counter()
    for i, it in enumerate(items):
        msg = chain.invoke({"question": it.prompt_text()})
        info = msg.response_metadata["abstention"]
        withheld = msg.response_metadata.get("withheld_response") or {}
        text = str(withheld.get("content", msg.content)) if info["abstained"] else msg.content
        verdict = judge.judge(it.question, list(it.answers), str(text))
        rows.append(
            {
                "id": it.id,
                "score": info["score"],
                "abstained": bool(info["abstained"]),
                "correct": verdict.correct,
                "answer": str(text)[:200],
            }
        )
        if (i + 1) % 25 == 0:
            rate = (time.perf_counter() - start) / (i + 1)
            print(f"{name}: {i + 1}/{len(items)} ({rate:.2f} s/question)", flush=True)
    return rows


def _perturbed_model(noise: float, seed: int) -> Any:
    import torch

    from abstain_guard.adapters import GeometryChatModel
    from abstain_guard.adapters.model.loading import (
        DEFAULT_GGUF,
        DEFAULT_MODEL_NAME,
        default_model_path,
        load_pretrained,
    )

    hf_model, tokenizer = load_pretrained(default_model_path(), DEFAULT_GGUF)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if ".layers." in name and p.ndim == 2:
                p.add_(torch.randn(p.shape, generator=gen) * (noise * float(p.std())))
    return GeometryChatModel.from_hf(
        hf_model, tokenizer, model_name=f"{DEFAULT_MODEL_NAME}+noise{noise}", max_new_tokens=24
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/drift_scores.json")
    parser.add_argument("--n", type=int, default=300, help="questions per pool")
    parser.add_argument("--noise", type=float, default=0.3)
    parser.add_argument(
        "--pools",
        default="probe_fresh,sciq,truthfulqa,swapped",
        help="comma list; 'sciq+200': the n SciQ questions after the first 200 (more of the "
        "same pool)",
    )
    args = parser.parse_args()

    from abstain_guard.calibration.building.judges.registry import make_judge
    from abstain_guard.calibration.building.questions.named_datasets import load_named_dataset
    from abstain_guard.calibration.building.questions.probe import builtin_probe_set
    from abstain_guard.config import GuardConfig
    from abstain_guard.default import DEFAULT_ARTIFACT_DIR
    from abstain_guard.guard.chains import load_guard_chain

    out = Path(args.out)
    result: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {"pools": {}}
    judge = make_judge("lexical")
    probe = builtin_probe_set()[2400 : 2400 + args.n]
    pools = [p for p in args.pools.split(",") if p not in result["pools"]]
    chain = None
    for name in pools:
        if name == "swapped":
            model = _perturbed_model(args.noise, seed=0)
            warn = GuardConfig(on_mismatch="warn")
            chain, _, _ = load_guard_chain(DEFAULT_ARTIFACT_DIR, warn, model=model)
            items = probe
        else:
            if chain is None:
                chain, _, _ = load_guard_chain(DEFAULT_ARTIFACT_DIR)
            if name == "probe_fresh":
                items = probe
            else:  # "sciq", or "sciq+200": the next n questions of the same seeded order
                base, _, start = name.partition("+")
                items, _ = load_named_dataset(base, DATA / base)
                first = int(start or 0)
                order = np.random.default_rng(0).permutation(len(items))[first : first + args.n]
                items = [items[i] for i in order]
        rows = _pool(chain, items, judge, name)
        result["pools"][name] = {"n": len(rows), "rows": rows}
        if name == "swapped":
            result["pools"][name]["noise"] = args.noise
            chain = None
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"{name}: done, written to {out}", flush=True)


if __name__ == "__main__":
    main()
