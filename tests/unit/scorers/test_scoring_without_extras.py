"""Scoring needs numpy and scipy only: in a process where torch, scikit-learn, XGBoost,
transformers and sentence-transformers cannot be imported (a ``sys.meta_path`` blocker
installed before ``abstain_guard``), the shipped guard loads and decides on a stored response
with bitwise the score this (full) install computes, every stored linear probe and
likelihood scorer scores bitwise as here, and an XGBoost calibrator is refused by name, with
the extra that installs it.

The stored response (``tests/data/shipped_guard_response.json``) is the shipped chain's reply
to the artifact's first calibration question (content and ``response_metadata``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from langchain_core.messages import AIMessage

from abstain_guard import GuardArtifact, default_artifact_path
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.guard.policy import AbstentionPolicy
from abstain_guard.scorers import (
    CalibratedScorer,
    PerplexityScorer,
    build_scorer,
    scorer_class,
    scorer_names,
)

ROOT = Path(__file__).resolve().parents[3]
STORED_RESPONSE = ROOT / "tests" / "data" / "shipped_guard_response.json"
BLOCKED = ("torch", "sklearn", "xgboost", "transformers", "sentence_transformers")

CHILD = textwrap.dedent(
    """
    import importlib.abc, json, sys, warnings

    BLOCKED = set(sys.argv[2].split(","))

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())

    from langchain_core.messages import AIMessage
    from abstain_guard import GuardArtifact, default_artifact_path
    from abstain_guard.errors import AbstainGuardError
    from abstain_guard.guard.policy import AbstentionPolicy
    from abstain_guard.scorers import scorer_class, scorer_names

    job = json.loads(open(sys.argv[1]).read())
    stored = job["stored"]
    message = AIMessage(content=stored["content"], response_metadata=stored["response_metadata"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kernel note, on other CPU kernels
        reply, _ = AbstentionPolicy(GuardArtifact.load(default_artifact_path())).decide(message)
    decision = reply.response_metadata["abstention"]
    out = {"shipped": [float(decision["score"]).hex(), decision["abstained"]], "stored": {}}
    for path, responses in job["artifacts"].items():
        try:
            scores = GuardArtifact.load(path).scorer.score_many(responses)
            out["stored"][path] = [float(s).hex() for s in scores]
        except AbstainGuardError as exc:
            out["stored"][path] = f"{type(exc).__name__}: {exc}"
    out["classes"] = {kind: scorer_class(kind).__name__ for kind in scorer_names()}
    out["loaded"] = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    print(json.dumps(out))
    """
)


def _hidden_response(rng: np.random.Generator, width: int, correct: bool) -> dict[str, Any]:
    """Metadata of a synthetic answer: both probe layers' summaries, logprobs and entropies."""
    n = int(rng.integers(2, 6))
    shift = 0.8 if correct else -0.8
    summaries = {s: (rng.normal(size=(2, width)) + shift).tolist() for s in ("mean", "last")}
    return {
        "logprobs": {
            "content": [{"token": "x", "logprob": float(v)} for v in -rng.gamma(1.0, 0.5, n)]
        },
        "entropy": rng.uniform(0.1, 2.0, n).tolist(),
        "geometry": {"hidden": {"layers": [1, 2], **summaries}},
    }


def _stored_artifacts(folder: Path) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Artifacts of every probe and likelihood scorer, fitted here on synthetic answers, and
    one of an XGBoost-calibrated score; each folder with the answers to score there."""
    rng = np.random.default_rng(0)
    labels = rng.random(60) < 0.5
    fit = [(_hidden_response(rng, 8, bool(c)), bool(c)) for c in labels]
    scored = [_hidden_response(rng, 8, bool(c)) for c in rng.random(7) < 0.5]
    scorers: list[Any] = [build_scorer(k) for k in scorer_names(family="likelihood")]
    scorers += [build_scorer(k).fit(fit[:30], fit[30:]) for k in scorer_names(family="probe")]
    scorers.append(CalibratedScorer(PerplexityScorer()).fit(fit))
    jobs: dict[str, list[dict[str, Any]]] = {}
    here: dict[str, Any] = {}
    for scorer in scorers:
        path = folder / scorer.name
        scores = scorer.score_many(scored)
        GuardArtifact.from_calibration(
            scorer=scorer, calibration=CalibrationSet(scores, labels[:7])
        ).save(path)
        jobs[str(path)] = scored
        here[str(path)] = [float(s).hex() for s in scores]
    return jobs, here


def test_without_the_extras_the_shipped_guard_decides_bitwise_as_the_full_install(
    tmp_path: Path,
) -> None:
    stored = json.loads(STORED_RESPONSE.read_text())
    message = AIMessage(content=stored["content"], response_metadata=stored["response_metadata"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kernel note, on other CPU kernels
        reply, _ = AbstentionPolicy(GuardArtifact.load(default_artifact_path())).decide(message)
    decision = reply.response_metadata["abstention"]
    jobs, here = _stored_artifacts(tmp_path)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"stored": stored, "artifacts": jobs}))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(job), ",".join(BLOCKED)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["loaded"] == []
    assert out["shipped"] == [float(decision["score"]).hex(), decision["abstained"]]
    built_in = {k: scorer_class(k) for k in scorer_names()}  # less the tests' own
    assert out["classes"] == {  # every built-in scorer class loads
        k: c.__name__ for k, c in built_in.items() if c.__module__.startswith("abstain_guard.")
    }
    refused = {p: v for p, v in out["stored"].items() if isinstance(v, str)}
    assert list(refused) == [str(tmp_path / "calibrated_perplexity")]
    (message_text,) = refused.values()
    assert message_text.startswith("MissingExtraError") and "xgboost" in message_text
    assert "pip install 'abstain-guard[calibration]'" in message_text
    assert {p: v for p, v in out["stored"].items() if p not in refused} == {
        p: v for p, v in here.items() if p not in refused
    }
