"""The probe scorers deploy on fast capture (``ProbeScorerBase.capture``): what they read (the
residual stream's summary, log-probabilities, entropies, tokens) must be bitwise the same as
full capture records, on every family, or a probe guard calibrated on full-capture answers
would score its live answers differently. (A calibrated probe guard deploying fast and
scoring live as stored: ``tests/test_probe_calibration.py``.)

Why bitwise: full capture runs the model's own attention kernel (sdpa, or the modeling
module's eager function where sdpa cannot) and only *reads* its inputs to compute the
per-source parts; fast capture leaves the attention implementation alone, so every layer
computes the same products in the same order (CPU, one BLAS thread, any kernel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _pipeline_fakes import ITEMS
from langchain_core.messages import HumanMessage, SystemMessage
from tiny_models import FAMILIES, tiny_chat_model

from abstain_guard.scorers._registry import build_scorer

MESSAGES = [SystemMessage("Answer briefly."), HumanMessage("Capital of Peru?")]
READ_BY_PROBES = ("token_ids", "logprobs", "entropy")


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_capture_records_the_probe_inputs_bitwise(family: str) -> None:
    full = tiny_chat_model(family, max_new_tokens=6)
    fast = tiny_chat_model(family, max_new_tokens=6, capture="fast")
    fast._shared = full._shared
    a, b = full.invoke(MESSAGES), fast.invoke(MESSAGES)
    ma, mb = a.response_metadata, b.response_metadata
    assert ma["geometry"]["capture"] == "full" and mb["geometry"]["capture"] == "fast"
    for key in READ_BY_PROBES:
        assert ma[key] == mb[key], key
    assert ma["geometry"]["hidden"] == mb["geometry"]["hidden"]


def test_full_capture_answers_score_as_fast_ones(tmp_path: Path) -> None:
    """An artifact whose answers were captured in full (the shipped guard's, before probes
    ran fast) scores the same answers bitwise when they are generated fast."""
    full = tiny_chat_model("llama", seed=1, max_new_tokens=8)
    fast = tiny_chat_model("llama", seed=1, max_new_tokens=8, capture="fast")
    fast._shared = full._shared
    questions = [it.question for it in ITEMS]
    fit = [full.invoke(q) for q in questions]
    labels = [i % 2 == 0 for i in range(len(fit))]
    scorer: Any = build_scorer("probe_mid", cv_folds=2)
    half = len(fit) // 2
    pairs = list(zip(fit, labels, strict=True))
    scorer.fit(pairs[:half], pairs[half:])
    again = [fast.invoke(q) for q in questions]
    np.testing.assert_array_equal(scorer.score_many(fit), scorer.score_many(again))
