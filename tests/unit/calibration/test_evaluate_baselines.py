"""evaluate builds every named baseline and scores real (tiny-model) responses with them."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_chat_model

from abstain_guard.calibration.measure.baselines import (
    BASELINE_PARAMS,
    MODEL_BASELINES,
    parse_baselines,
)
from abstain_guard.errors import ConfigError
from abstain_guard.scorers import SampleSource, build_scorer


def test_parse_baselines_sets_and_errors() -> None:
    assert parse_baselines("likelihood") == [
        "perplexity",
        "max_sequence_probability",
        "mean_token_entropy",
    ]
    assert set(parse_baselines("all")) >= set(MODEL_BASELINES)
    assert parse_baselines("none") == []
    with pytest.raises(ConfigError, match="vibes"):
        parse_baselines("perplexity,vibes")


def test_every_model_baseline_is_built_and_cheap_ones_score() -> None:
    model = tiny_chat_model("llama", seed=1, max_new_tokens=5)
    samples = SampleSource(model, num_samples=2, max_new_tokens=4)
    # P(True) needs "True" to be one token; the tiny model's tokenizer is per character
    with pytest.raises(ConfigError, match="single token"):
        build_scorer("p_true", model=model, samples=samples)
    names = [n for n in MODEL_BASELINES if n != "p_true"]
    scorers = {
        name: build_scorer(name, model=model, samples=samples, **BASELINE_PARAMS.get(name, {}))
        for name in names
    }
    assert {s.kind for s in scorers.values()} == {
        "attention_score",
        "eigenscore",
        "sar",
        "semantic_entropy",
    }
    msgs = model.batch(["What is 1?", "What is 2?"])
    for name in ("attention_score", "eigenscore"):
        scores = scorers[name].score_many(msgs)
        assert scores.shape == (2,)
        assert np.all(np.isfinite(scores)), name
