"""Guarded requests on stock vLLM preempted under memory pressure (a server of its own, with a
KV cache too small for its batch) are recomputed and answered with their captures. Its own
file so that its server starts beside the backend module's, on another pytest worker."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from abstain_guard.backends.vllm_chat import VLLM_PYTHON_ENV, VLLMChatModel, stop_engines

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: The server's engine flags, parsed by vLLM: tensor parallelism accepted (one rank here).
TP = {"vllm_args": ["--tensor-parallel-size", "1"]}


@pytest.fixture(scope="module", autouse=True)
def _stop_the_server() -> Iterator[None]:
    yield None
    stop_engines()


def test_guarded_requests_preempted_under_memory_pressure_keep_their_captures() -> None:
    """A KV cache of 12 blocks of 32 tokens for 8 requests of ~80 tokens each: vLLM preempts
    running requests and recomputes them; every answer still carries its capture, equal to
    the same question's capture asked alone (tokens identical, hidden states within the
    CPU backend's batch variance)."""
    import httpx

    if not os.environ.get(VLLM_PYTHON_ENV):
        pytest.skip(f"{VLLM_PYTHON_ENV} is not set (make test sets it to .venv-vllm)")
    flags = ["--block-size", "32", "--num-gpu-blocks-override", "12", "--max-model-len", "256"]
    model = VLLMChatModel(max_tokens=48, max_model_len=256, vllm_args=[*TP["vllm_args"], *flags])
    countries = ("France", "Peru", "Chile", "Kenya", "Japan", "Spain", "Italy", "Egypt")
    questions = [[("human", f"Tell me about the capital of {c}.")] for c in countries]
    together = model.batch(questions, config={"max_concurrency": 8})
    url, _ = model.engine()
    metrics = httpx.get(url + "/metrics", timeout=30).text
    preempted = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("vllm:num_preemptions")
    )
    assert preempted > 0, "the server preempted nothing: the test needs a smaller KV cache"
    for question, message in zip(questions, together, strict=True):
        alone = model.invoke(question)
        meta, solo = message.response_metadata, alone.response_metadata
        assert meta["token_ids"] == solo["token_ids"]
        assert len(meta["entropy"]) == len(meta["token_ids"])
        np.testing.assert_allclose(
            meta["geometry"]["hidden"]["mean"], solo["geometry"]["hidden"]["mean"], atol=1e-3
        )
