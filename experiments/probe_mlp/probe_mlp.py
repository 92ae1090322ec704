"""Does a small MLP beat the logistic hidden-state probe?

    flock /tmp/heavy.lock .venv/bin/python experiments/probe_mlp/probe_mlp.py --artifact \
        runs/power_builtin

On an artifact's own run (answers and verdicts read from its calibration cache; nothing is
generated when the cache holds them): the ``probe_concat`` / ``probe_concat_last`` features
of the reference + train answers fit

* ``logistic``: the registered probe (:class:`abstain_guard.scorers.probe.HiddenStateProbe`,
  L2 strength by 5-fold CV);
* ``mlp``: scikit-learn's ``MLPClassifier`` (one hidden layer of 64 ReLU units, Adam, early
  stopping on a 10 % slice of the fitting answers), its L2 strength ``alpha`` chosen by the
  same 5-fold stratified CV (AUROC) on the fitting answers only;

and both are scored on the held-out (calibration + test) answers, read from the generation
cache (the metadata calibration stored; the live guard reads the same, live = stored).
Prints one JSON line: per feature set, each model's AUROC with its 95 % class-stratified
bootstrap interval, the paired difference (mlp − logistic) with its interval, on the same
resamples, and its two-sided paired DeLong p-value (unadjusted), and the whole paired report
(:func:`calibration.measure.paired.paired_report`). ``bench/power/paired_tables.py --also
experiments/probe_mlp/probe_mlp.json`` puts these two comparisons into the Holm family of the
power tables, since they were made on the same held-out answers before ``probe_mid`` was chosen.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.model_selection import GridSearchCV, StratifiedKFold
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from abstain_guard.adapters.engine.kernels import kernel_facts
from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.calibration.building.answering.answer_rows import GenerationOptions
from abstain_guard.calibration.building.answering.answers import generate_answers
from abstain_guard.calibration.building.answering.models import load_model
from abstain_guard.calibration.building.judges.judging import (
    build_judges,
    judge_answers,
    labeled_items,
    labels,
)
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.calibration.measure.cache_reuse import evaluate_cache
from abstain_guard.calibration.measure.held_out import artifact_splits, reference_metadata
from abstain_guard.calibration.measure.paired import paired_report
from abstain_guard.scorers import build_scorer
from abstain_guard.scorers.probe import PROBE_KINDS, hidden_features

ALPHAS = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)


def fit_mlp(x: np.ndarray, y: np.ndarray, seed: int) -> tuple[Any, dict[str, Any]]:
    """A standardised one-hidden-layer MLP, ``alpha`` by 5-fold stratified CV (AUROC)."""
    search = GridSearchCV(
        make_pipeline(
            StandardScaler(),
            MLPClassifier(
                hidden_layer_sizes=(64,),
                early_stopping=True,
                validation_fraction=0.1,
                max_iter=500,
                random_state=seed,
            ),
        ),
        {"mlpclassifier__alpha": list(ALPHAS)},
        scoring="roc_auc",
        cv=StratifiedKFold(5, shuffle=True, random_state=seed),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        search.fit(x, y)
    return search.best_estimator_, {
        "alpha": float(search.best_params_["mlpclassifier__alpha"]),
        "cv_auroc": round(float(search.best_score_), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--out", default="runs/probe_mlp_eval", help="evaluation cache directory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    art = GuardArtifact.load(args.artifact)
    cfg = CalibrationConfig(**art.metadata.get("config", {}))
    name, held, splits = artifact_splits(art)
    fitting = splits["reference"] + splits["train"]
    model = load_model(cfg)
    cache = evaluate_cache(Path(args.out) / "cache", art, args.artifact)
    store = cache.run_store()
    fp = str(getattr(model, "fingerprint", "unknown"))
    quiet = GenerationOptions(progress=False)
    alone = GenerationOptions(batch_size=1, progress=False)
    answers = generate_answers(model, held, store, cfg, fingerprint=fp, options=alone)
    answers.update(generate_answers(model, fitting, store, cfg, fingerprint=fp, options=quiet))
    judges = build_judges(cfg, cache.directory / "judgments.sqlite", read_from=cache.judgments)
    judgments = judge_answers(judges, held + fitting, answers, progress=False)
    held = labeled_items(held, judgments)
    fitting = labeled_items(fitting, judgments)
    y_fit = np.array(labels(fitting, judgments), dtype=bool)
    y_held = np.array(labels(held, judgments), dtype=bool)
    meta_fit = [reference_metadata(answers[it.id], store) for it in fitting]
    meta_held = [reference_metadata(answers[it.id], store) for it in held]
    result: dict[str, Any] = {
        "artifact": args.artifact,
        "data": name,
        "fitting": [int(y_fit.sum()), int((~y_fit).sum())],
        "held_out": [int(y_held.sum()), int((~y_held).sum())],
        "features": {},
    }
    for kind in ("probe_concat", "probe_concat_last"):
        layer, summary = PROBE_KINDS[kind]
        x_fit = np.stack([hidden_features(m, layer, summary) for m in meta_fit])
        x_held = np.stack([hidden_features(m, layer, summary) for m in meta_held])
        t1 = time.perf_counter()
        probe = build_scorer(kind).fit(list(zip(meta_fit, y_fit.tolist(), strict=True)), [])
        logistic = probe.score_many(meta_held)
        t2 = time.perf_counter()
        mlp, info = fit_mlp(x_fit, y_fit, args.seed)
        wrong = np.asarray(mlp.predict_proba(x_held)[:, 0], dtype=np.float64)  # P(wrong)
        t3 = time.perf_counter()
        report = paired_report({"mlp": wrong, "logistic": logistic}, y_held, reference="mlp")
        s = report["scorers"]
        result["features"][kind] = {
            "width": int(x_fit.shape[1]),
            "logistic": {
                "auroc": round(s["logistic"]["auroc"], 4),
                "auroc_ci": s["logistic"]["auroc_ci"],
                "C": probe.probe_.C,
                "fit_seconds": round(t2 - t1, 1),
            },
            "mlp": {
                "auroc": round(s["mlp"]["auroc"], 4),
                "auroc_ci": s["mlp"]["auroc_ci"],
                **info,
                "fit_seconds": round(t3 - t2, 1),
            },
            "mlp_minus_logistic": round(s["logistic"]["auroc_diff"], 4),
            "mlp_minus_logistic_ci": s["logistic"]["auroc_diff_ci"],
            "mlp_minus_logistic_p": s["logistic"]["auroc_diff_p"],
            "paired": report,
        }
    result["kernel_facts"] = kernel_facts("cpu")
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
