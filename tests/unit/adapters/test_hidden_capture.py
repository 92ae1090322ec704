"""The probe layers' residual-stream summaries (``geometry["hidden"]``, issue 37): written by
generation and replay alike, in both capture modes, equal to the states the session keeps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from langchain_core.messages import HumanMessage
from tiny_models import tiny_chat_model

from abstain_guard.contract.metadata import ResponseMetadata, hidden_summary, probe_layers

PROMPT = "Tell me the capital of Portugal, please."


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_chat_model("llama", max_new_tokens=6)


def test_probe_layers() -> None:
    assert probe_layers(30) == (15, 24)
    assert probe_layers(2) == (1, 1)
    assert probe_layers(1) == (0, 0)


def test_generation_records_hidden_summaries(model: Any) -> None:
    msg = model.invoke(PROMPT)
    meta = ResponseMetadata.of(msg)
    n_layers = msg.response_metadata["geometry"]["num_layers"]
    layers, last = meta.hidden("last")
    _, mean = meta.hidden("mean")
    assert layers == list(probe_layers(n_layers))
    assert last.shape == mean.shape == (2, model._s.spec.hidden_size)
    # replay from the generated ids gives the same summaries (to float tolerance)
    res = model.replay(PROMPT, msg.response_metadata["token_ids"])
    rep = ResponseMetadata.of(res.metadata)
    np.testing.assert_allclose(rep.hidden("last")[1], last, atol=1e-4, rtol=0)
    np.testing.assert_allclose(rep.hidden("mean")[1], mean, atol=1e-4, rtol=0)


def test_summaries_equal_kept_states(model: Any) -> None:
    [(msg, states)] = model.generate_with_states([[HumanMessage(PROMPT)]])
    geo = msg.response_metadata["geometry"]
    layers = probe_layers(geo["num_layers"])
    want = hidden_summary(np.asarray(states.post_mlp)[:, list(layers)], layers)
    assert want is not None
    assert geo["hidden"] == want


def test_fast_capture_has_them(model: Any) -> None:
    full = model.invoke(PROMPT).response_metadata["geometry"]["hidden"]
    fast = (
        model.model_copy(update={"capture": "fast"})
        .invoke(PROMPT)
        .response_metadata["geometry"]["hidden"]
    )
    np.testing.assert_allclose(np.asarray(fast["mean"]), np.asarray(full["mean"]), atol=1e-5)


def test_missing_summary_is_a_clear_error() -> None:
    from abstain_guard.errors import ScoringError

    with pytest.raises(ScoringError, match="hidden-state summary"):
        ResponseMetadata.of({"geometry": {"omega": []}}).hidden("mean")
