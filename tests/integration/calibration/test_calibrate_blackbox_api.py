"""A black-box guard on an API model that returns no logprobs, end to end and without
fakes: ``langchain_openai``'s ``ChatOpenAI`` against the embedded SmolLM2 behind an
OpenAI-compatible server that strips every logprob (``tests/_text_only_server.py``);
calibrated with three answers sampled per question at temperature 1 (the medoid returned,
compared by the shipped all-MiniLM-L6-v2), evaluated on its held-out answers with every
black-box statistic, and deployed: the live scores against the stored ones in distribution
(their two-sample p-value)."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import api_model_config, completions_served, hash_judges
from _text_only_server import text_only_server

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.calibration.building import pipeline
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.measure import held_out as held_out_module
from abstain_guard.calibration.measure.deployment_check import live_check
from abstain_guard.calibration.measure.evaluate import EvaluateOptions, evaluate
from abstain_guard.errors import LogprobsMissingError
from abstain_guard.scorers import BlackBoxScorer

pytestmark = [pytest.mark.model, pytest.mark.slow]

openai = pytest.importorskip("openai")
pytest.importorskip("langchain_openai")

#: 24 questions of the built-in probe set (capitals and currencies, which SmolLM2 sometimes
#: gets right), split 1:1:4:1: 14 calibration and 3 test answers, each the medoid of 3
#: samples.
ITEMS = list(builtin_probe_set(relations=("capital", "currency")))[:24]
PLAN = {"num_samples": 3, "temperature": 1.0, "primary": "medoid"}
BASELINES = "perplexity,discrete_semantic_entropy,num_semantic_sets,degree,eccentricity"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The questions as a data file (what evaluate reads back)."""
    path = tmp_path_factory.mktemp("data") / "questions.jsonl"
    rows = [{"question": it.question, "answer": list(it.answers)} for it in ITEMS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def server(default_model: Any) -> Any:
    with text_only_server(default_model, max_tokens=32) as srv:
        yield srv


def test_the_endpoint_answers_without_logprobs_even_when_asked(server: Any) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
    )
    assert reply.choices[0].message.content
    assert reply.choices[0].logprobs is None


def test_a_logprob_scorer_is_refused_on_it(server: Any, data: Path, tmp_path: Path) -> None:
    with pytest.raises(LogprobsMissingError, match="black-box scorer"):
        calibrate(
            data,
            tmp_path / "guard",
            config=api_model_config(server.base_url, tmp_path, api_key="k"),
            progress=False,
        )
    assert not (tmp_path / "guard").exists()


def test_a_blackbox_guard_calibrates_evaluates_and_holds_live_in_distribution(
    server: Any, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "from-the-environment")  # the artifact stores none
    # sampled answers differ run to run: the hash judge keeps both classes in every split
    # (the lexical judge could call all of a dozen sampled held-out answers wrong)
    monkeypatch.setattr(pipeline, "build_judges", hash_judges)
    monkeypatch.setattr(held_out_module, "build_judges", hash_judges)
    cfg = api_model_config(server.base_url, tmp_path, "eigv", PLAN, api_key="k")
    sent = completions_served(server.base_url)
    summary = calibrate(data, tmp_path / "guard", config=cfg, progress=False)
    assert completions_served(server.base_url) - sent == 3 * len(
        ITEMS
    )  # k samples per question, nothing more
    art = GuardArtifact.load(tmp_path / "guard")
    n = summary.split_sizes["calibration"]
    assert n >= 12 and art.scores.shape == (n,) and np.isfinite(art.scores).all()
    assert isinstance(art.scorer, BlackBoxScorer)
    params = art.scorer.get_state().params
    assert {k: params[k] for k in PLAN} == PLAN
    assert params["similarity"]["name"] == "all-MiniLM-L6-v2" and params["similarity"]["digest"]
    assert art.model_fingerprint.startswith("chat_model:")
    # every stored answer is text only, with its three samples and the plan they follow
    with sqlite3.connect(tmp_path / "run.cache" / "run.sqlite") as db:
        stored = [
            json.loads(v)
            for (v,) in db.execute("SELECT value FROM kv WHERE ns = ?", ("generation",))
        ]
    assert len(stored) == len(ITEMS)
    for row in stored:
        meta = row["metadata"]
        assert "logprobs" not in meta or not meta["logprobs"]
        block = meta["samples"]
        assert len(block["texts"]) == 3 and row["text"] == block["texts"][block["primary_index"]]
        assert block["plan"]["temperature"] == 1.0 and block["plan"]["primary"] == "medoid"

    results = evaluate(
        tmp_path / "guard",
        tmp_path / "eval",
        options=EvaluateOptions(baselines=BASELINES, n_resplits=20),
        progress=False,
    )
    assert completions_served(server.base_url) - sent == 3 * len(
        ITEMS
    )  # read from the calibration cache
    ((name, entry),) = results["datasets"].items()
    scored = entry["scorers"]
    assert {"eigv", "degree", "eccentricity", "num_semantic_sets"} <= set(scored)
    assert "perplexity" not in scored  # text-only answers: left out, not faked
    held_out = len(art.metadata["calibration_ids"]) + len(art.metadata["test_ids"])
    assert scored["eigv"]["n_correct"] + scored["eigv"]["n_incorrect"] == entry["n"] <= held_out
    assert 0.0 <= results["headline"][name]["eigv"]["auroc"] <= 1.0

    live = live_check(tmp_path / "guard", guard_config=GuardConfig(participation=0.5))
    assert completions_served(server.base_url) - sent == 3 * len(ITEMS) + 3 * held_out
    check = live["summary"]["in_distribution"]
    assert check["test"] == "ks_2samp" and check["n_live"] == held_out
    assert 0.0 <= check["p_value"] <= 1.0 and math.isfinite(check["statistic"])
    # the same plan and model, sampled afresh: one draw of a p-value uniform under the
    # null, so this fails by chance once in 10,000 runs
    assert check["p_value"] > 1e-4
    assert all(r["live_score"] is not None for r in live["rows"])
