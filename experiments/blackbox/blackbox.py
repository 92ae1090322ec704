"""The black-box scorers against perplexity on the same answers, through the library alone.

The embedded SmolLM2 is served behind the OpenAI endpoint of ``abstain-guard serve
--no-guard`` (loopback, a free port) and guarded as an API chat model
(``langchain_openai.ChatOpenAI``): ``calibrate`` draws k answers per question through the
black-box scorer's sampling plan and returns the medoid, ``evaluate`` scores the held-out
answers with every black-box statistic (from the same samples) and with perplexity and
max sequence probability (from the returned answer's logprobs, which the server reports and
the black-box scorers never read: their scores are what an endpoint without logprobs gives).
Writes the evaluate report (AUROC with bootstrap intervals, DeLong paired differences,
correct / incorrect counts) under ``--work`` and the table's JSON to ``--out``.

    .venv/bin/python experiments/blackbox/blackbox.py --limit 300 --out docs/results/blackbox.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from abstain_guard.adapters import load_default_model
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.measure.evaluate import EvaluateOptions, evaluate
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.runner import ServerThread

BASELINES = (
    "perplexity",
    "max_sequence_probability",
    "num_semantic_sets",
    "eigv",
    "degree",
    "eccentricity",
)


def _config(url: str, args: argparse.Namespace, cache: Path) -> CalibrationConfig:
    kwargs = {"model": "smollm2", "base_url": url, "api_key": "local", "max_retries": 3}
    return CalibrationConfig(
        model={"class_path": "langchain_openai:ChatOpenAI", "kwargs": kwargs},
        scorer=args.scorer,
        scorer_params={
            "num_samples": args.k,
            "temperature": args.temperature,
            "primary": args.primary,
        },
        max_new_tokens=args.max_new_tokens,
        batch_size=8,
        ratios=(0, 0, 1, 1),  # nothing is fitted: every answer is held out
        limit=args.limit,
        cache_dir=str(cache),
    )


def table(results: dict[str, Any]) -> dict[str, Any]:
    """Per scorer: AUROC, its bootstrap interval and the class counts; the DeLong paired
    difference from the artifact's scorer (pure)."""
    ((name, entry),) = results["datasets"].items()
    paired = (entry.get("paired") or {}).get("scorers") or {}
    keep = ("auroc_diff", "auroc_diff_ci", "auroc_diff_p", "auroc_diff_p_holm")
    out = {}
    for scorer, v in entry["scorers"].items():
        diff = paired.get(scorer) or {}
        out[scorer] = {
            "auroc": v["auroc"],
            "auroc_ci": v.get("auroc_ci"),
            "n_correct": v["n_correct"],
            "n_incorrect": v["n_incorrect"],
            "paired_with_artifact_scorer": {k: diff[k] for k in keep if k in diff},
        }
    return {"data": name, "scorers": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=300, help="first N built-in questions")
    parser.add_argument("--scorer", default="discrete_semantic_entropy")
    parser.add_argument("--k", type=int, default=5, help="samples per question")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--primary", default="medoid", choices=("first", "medoid"))
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--port", type=int, default=8931, help="loopback port (in the model's identity: fixed)"
    )
    parser.add_argument("--work", default="runs/blackbox", help="artifact, caches, report")
    parser.add_argument("--out", default="docs/results/blackbox.json")
    args = parser.parse_args()
    work = Path(args.work)
    t0 = time.perf_counter()
    model = load_default_model(max_new_tokens=args.max_new_tokens)
    service = ModelService(model, model_name="smollm2", max_tokens=args.max_new_tokens)
    with ServerThread(service, port=args.port) as server:
        cfg = _config(server.base_url, args, work / "run.cache")
        calibrate("builtin", work / "guard", config=cfg, progress=True)
        t_cal = time.perf_counter() - t0
        results = evaluate(
            work / "guard",
            work / "eval",
            options=EvaluateOptions(baselines=",".join(BASELINES), n_resplits=200),
            progress=True,
        )
    doc = {
        "command": "python experiments/blackbox/blackbox.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k not in ("work", "port")
        ),
        "model": "embedded SmolLM2-135M-Instruct behind serve --no-guard, via ChatOpenAI",
        "plan": {"k": args.k, "temperature": args.temperature, "primary": args.primary},
        "max_new_tokens": args.max_new_tokens,
        "artifact_scorer": args.scorer,
        "seconds": {"calibrate": t_cal, "total": time.perf_counter() - t0},
        **table(results),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()
