"""Certified streaming on the real embedded model: a guard calibrated with a chunk rule
records it and every calibration answer's prefix scores; the live stream's prefix scores are
the stored ones; served with ``stream: true`` to the OpenAI client, an answered question's
first text arrives while the answer is still being generated, and a stream the guard stops
after chunk j shows nothing past chunk j - 1."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.questions.items import load_items
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.contract.streaming import open_prefix_sink
from abstain_guard.guard.chains import load_guard_chain
from abstain_guard.serve.runner import ServerThread
from abstain_guard.serve.service import GuardService

pytestmark = [pytest.mark.model, pytest.mark.slow]

openai = pytest.importorskip("openai")

N = 32  # builtin questions: 4 reference, 4 train, 16 calibration, 8 test
RULE = "tokens:4"


@pytest.fixture(scope="module")
def calibrated(default_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("stream")
    config = CalibrationConfig(
        scorer="perplexity",
        chunk_rule=RULE,
        limit=N,
        ratios=(1, 1, 4, 2),
        cache_dir=str(tmp / "run.cache"),
    )
    items, _ = load_items("builtin", config)
    calibrate("builtin", tmp / "guard", config=config, model=default_model, progress=False)
    return tmp, {it.id: it for it in items}


def _prefix_scores(guard: Any, chain: Any, question: str) -> tuple[list[float], float, Any]:
    """Every chunk end's score of the live stream of ``question`` and the whole answer's
    (the guard's model streamed under a prefix sink, as the certified stream runs it)."""
    messages = chain.first.invoke({"question": question}).to_messages()
    with open_prefix_sink(guard.chunk_rule) as sink:
        chunks = list(guard.bound_runnable.stream(messages))
        prefixes = sink.take()
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    scorer = guard.artifact.scorer
    n = len(whole.response_metadata["token_ids"])
    live = [float(scorer.score(p.message)) for p in prefixes if p.tokens < n]
    return live, float(scorer.score(whole)), whole


def test_the_artifact_records_the_rule_and_the_prefix_statistics(calibrated: Any) -> None:
    tmp, _ = calibrated
    art = GuardArtifact.load(tmp / "guard")
    record = DeploymentRecord.from_metadata(art.metadata)
    assert record is not None and record.streaming is not None
    assert record.streaming.chunk_rule == RULE
    assert record.streaming.chunks["answers"] == art.n
    first = art.stream_first
    assert first is not None and first.shape == art.scores.shape
    has = np.isfinite(first)
    assert has.sum() == record.streaming.chunks["with_interior_chunk_end"] > 0
    assert (first[has] <= art.scores[has]).all()  # the statistic is the maximum
    guarantee = art.decision_rule(GuardConfig(participation=0.8)).guarantee
    assert guarantee.partial_release is not None and guarantee.partial_release["n"] == art.n


def test_live_prefix_scores_are_the_stored_ones(calibrated: Any, default_model: Any) -> None:
    """Calibration replays each cut of an answer; the live stream scores the message the
    engine built from its own decode steps. Not bitwise: the replay's forward over the
    whole cut and the decode steps reduce in other orders, so float32 log-probabilities
    differ in their last bits (measured: perplexity within 3.4e-6 relative on this
    machine's kernels); equal to 1e-5 relative, far below any threshold gap that matters."""
    tmp, items = calibrated
    art = GuardArtifact.load(tmp / "guard")
    chain, guard, _ = load_guard_chain(art, GuardConfig(participation=0.8), model=default_model)
    ids = art.metadata["calibration_ids"]
    # four streams at once, each under its own sink (a context variable: one per thread),
    # their decode steps shared by the engine as a server's would be
    with ThreadPoolExecutor(4) as pool:
        streamed = list(
            pool.map(lambda i: _prefix_scores(guard, chain, items[ids[i]].question), range(4))
        )
    for i, (live, whole, _) in enumerate(streamed):
        assert max([whole, *live]) == pytest.approx(art.scores[i], rel=1e-5)
        stored_first = art.stream_first[i]
        assert (not live and stored_first == np.inf) or live[0] == pytest.approx(
            stored_first, rel=1e-5
        )


@pytest.fixture(scope="module")
def stopping(calibrated: Any, default_model: Any) -> Any:
    """From the stored statistics: a calibration question whose stream passes its first
    chunk and crosses later (F < M), τ between, and one whose whole stream stays under τ
    (with an interior chunk end); and an artifact with the same scorer and record whose τ
    is that (every calibration statistic at τ: the participation threshold is τ itself)."""
    tmp, items = calibrated
    art = GuardArtifact.load(tmp / "guard")
    ids, first, stat = art.metadata["calibration_ids"], art.stream_first, art.scores
    pairs = [
        (i, k, (first[i] + stat[i]) / 2)
        for i in np.argsort(first - stat)  # the widest gap first
        if stat[i] - first[i] > 1e-2
        for k in np.argsort(stat)
        if k != i and np.isfinite(first[k]) and stat[k] < (first[i] + stat[i]) / 2 - 1e-3
    ]
    assert pairs, "no calibration stream passes a first chunk below a later one"
    i, k, tau = pairs[0]
    crafted = GuardArtifact.from_calibration(
        scorer=art.scorer,
        calibration=CalibrationSet(
            np.full(art.n, tau), np.arange(art.n) % 2 == 0, stream_first=np.full(art.n, tau)
        ),
        model_fingerprint=art.model_fingerprint,
        metadata=art.metadata,
    )
    crafted.save(tmp / "crafted")
    chain, guard, _ = load_guard_chain(crafted, GuardConfig(participation=0.5), model=default_model)
    *_, whole = _prefix_scores(guard, chain, items[ids[i]].question)
    return items[ids[i]].question, items[ids[k]].question, whole


@pytest.fixture(scope="module")
def client(calibrated: Any, stopping: Any, default_model: Any) -> Any:
    tmp, _ = calibrated
    service = GuardService.from_artifact(
        tmp / "crafted", GuardConfig(participation=0.5), model=default_model
    )
    assert service.certified_streaming
    with ServerThread(service) as srv:
        yield openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)


def _stream(client: Any, question: str) -> list[tuple[float, Any]]:
    start = time.perf_counter()
    out = []
    for chunk in client.chat.completions.create(
        model="abstain-guard", messages=[{"role": "user", "content": question}], stream=True
    ):
        out.append((time.perf_counter() - start, chunk))
    return out


def test_served_answer_arrives_while_it_is_generated(client: Any, stopping: Any) -> None:
    _, question, _ = stopping  # every chunk of it stays under τ
    got = _stream(client, question)
    texts = [t for t, c in got if c.choices and c.choices[0].delta.content]
    final = [c for _, c in got if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1
    decision = final[0].choices[0].model_extra["abstention"]
    assert not decision["abstained"]
    assert final[0].choices[0].finish_reason in ("stop", "length")
    assert len(texts) >= 2 and decision["streaming"]["chunks_decided"] >= 3
    # the first text left before the last token was generated: the rest of the answer took
    # generation time after it (a buffered stream sends everything within milliseconds)
    last = next(t for t, c in got if c.choices and c.choices[0].finish_reason)
    assert last - texts[0] > 0.15


def test_served_stream_stopped_after_chunk_j_shows_nothing_past_chunk_j_minus_1(
    client: Any, stopping: Any, default_model: Any
) -> None:
    question, _, whole = stopping
    got = _stream(client, question)
    final = [c for _, c in got if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == "stop"
    decision = final[0].choices[0].model_extra["abstention"]
    assert decision["abstained"] and decision["streaming"]["partial_release"]
    stopped_at = decision["streaming"]["stopped_at_tokens"]
    assert stopped_at is not None and stopped_at >= 8  # after chunk j >= 2
    shown = "".join(
        c.choices[0].delta.content or ""
        for _, c in got
        if c.choices and not c.choices[0].finish_reason
    )
    ids = whole.response_metadata["token_ids"]
    tokenizer = default_model.tokenizer
    cut = tokenizer.decode(ids[: stopped_at - 4], skip_special_tokens=True)
    assert shown and cut.startswith(shown)  # nothing beyond chunk j - 1's tokens
    assert final[0].choices[0].delta.content == "I don't know."
    assert decision["streaming"]["released_chars"] == len(shown)


def test_a_chunk_end_at_the_last_token_scores_as_the_whole_answer(default_model: Any) -> None:
    """Issue 57: the live engine tests the chunk rule at every generated token, the last one
    included, while calibration scores interior ends (``t < n``) and then the whole answer.
    The n-token prefix the live stream puts into the sink is the whole answer: its score is
    the whole answer's ``s_{m+1}``, so the running maximum is calibration's ``M``. Bitwise:
    both messages are built from the same decode steps' log-probabilities by the same code
    (no replay), on any kernels."""
    from langchain_core.messages import HumanMessage

    from abstain_guard.contract.streaming import ChunkRule
    from abstain_guard.scorers import build_scorer

    scorer = build_scorer("perplexity")
    for question in ("What is the capital of France?", "Name the currency of Japan."):
        with open_prefix_sink(ChunkRule.parse("tokens:1")) as sink:  # every token ends one
            chunks = list(default_model.stream([HumanMessage(question)]))
            prefixes = sink.take()
        whole = chunks[0]
        for c in chunks[1:]:
            whole = whole + c
        n = len(whole.response_metadata["token_ids"])
        assert [p.tokens for p in prefixes] == list(range(1, n + 1))
        last = prefixes[-1].message
        assert last.response_metadata["token_ids"] == whole.response_metadata["token_ids"]
        assert float(scorer.score(last)) == float(scorer.score(whole))
