"""Concurrent callers share decode steps and still get bitwise their solo answers.

Every comparison here is exact (``==`` on tokens, logprobs and geometry), not a tolerance:
the scheduler's promise is that batch composition never changes a caller's numbers.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from _concurrency import _model_held, _run_threads, _scheduler, _wait_until
from tiny_models import CONCURRENT_PROMPTS, assert_same_answer, tiny_chat_model

from abstain_guard.adapters import GeometryChatModel, ReferenceMeans
from abstain_guard.adapters.engine.batching import _step_groups
from abstain_guard.adapters.engine.scheduler import scheduler_for
from abstain_guard.adapters.engine.threads import (
    ENGINE_WORKERS_ENV,
    MIN_DECODE_ROWS,
    DecodePath,
    blas_threads,
    independent_rows,
)
from abstain_guard.errors import AbstainGuardError, SchedulerFullError

PROMPTS = CONCURRENT_PROMPTS


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_threads_get_their_solo_answers(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # One engine, so "decoded together" is one engine's step: with one engine per CPU the
    # rows split between engines and the widest moment depends on when a short row ends in
    # one engine before the other admits (5 of 6 seen once on a clean clone). Engines side
    # by side, and their bitwise solo answers, are tests/test_engines.py's.
    monkeypatch.setenv(ENGINE_WORKERS_ENV, "1")
    model = tiny_chat_model(family, seed=3, max_new_tokens=12)
    solo = [model.invoke(p) for p in PROMPTS]
    got = _run_threads(model, [lambda p=p: model.invoke(p) for p in PROMPTS])
    assert _scheduler(model).widest_step == len(PROMPTS)  # really decoded together
    for a, b in zip(solo, got, strict=True):
        assert_same_answer(a, b)


def test_mixed_options_in_one_batch_match_solo() -> None:
    model = tiny_chat_model("qwen2", seed=1, max_new_tokens=10)
    calls: list[dict[str, Any]] = [
        {},
        {"capture_geometry": False},
        {"temperature": 1.0, "seed": 11},
        {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 5},
        {"max_new_tokens": 3},
        {"stop": ["e"]},
    ]
    solo = [model.invoke(p, **kw) for p, kw in zip(PROMPTS, calls, strict=True)]
    got = _run_threads(
        model,
        [lambda p=p, kw=kw: model.invoke(p, **kw) for p, kw in zip(PROMPTS, calls, strict=True)],
    )
    for a, b in zip(solo, got, strict=True):
        assert_same_answer(a, b)
    assert solo[1].response_metadata["geometry"] is None
    assert len(solo[4].response_metadata["token_ids"]) <= 3


def test_batch_and_asyncio_callers_match_solo() -> None:
    model = tiny_chat_model("mistral", seed=2, max_new_tokens=10)
    solo = [model.invoke(p) for p in PROMPTS]
    for a, b in zip(solo, model.batch(PROMPTS), strict=True):
        assert_same_answer(a, b)

    async def many() -> tuple[list[Any], list[Any]]:
        gathered = await asyncio.gather(*(model.ainvoke(p) for p in PROMPTS))
        return list(gathered), await model.abatch(PROMPTS)

    gathered, abatched = asyncio.run(many())
    for a, b, c in zip(solo, gathered, abatched, strict=True):
        assert_same_answer(a, b)
        assert_same_answer(a, c)


def test_reference_means_and_states_match_solo() -> None:
    model = tiny_chat_model("llama", seed=4, max_new_tokens=8)
    corr = model.replay_batch([("Hi", "Hello"), ("Yo", "Sup")], return_states=True)
    inc = model.replay_batch([("Hi", "Bye now")], return_states=True)
    means = ReferenceMeans.from_states(
        [r.states for r in corr if r.states], [r.states for r in inc if r.states]
    )
    ref = model.with_reference(means)
    solo = [ref.invoke(p) for p in PROMPTS[:3]]
    got = _run_threads(ref, [lambda p=p: ref.invoke(p) for p in PROMPTS[:3]])
    for a, b in zip(solo, got, strict=True):
        assert a.response_metadata["geometry"]["phi_in"] is not None
        assert_same_answer(a, b)


def test_full_queue_raises_a_typed_error_and_queued_calls_finish() -> None:
    model = tiny_chat_model("llama", seed=5, max_new_tokens=4, max_queue=2)
    sched = _scheduler(model)
    solo = model.invoke(PROMPTS[0])
    results: list[Any] = []
    with _model_held(model):
        with pytest.raises(SchedulerFullError, match="queue is full") as info:
            model.batch(PROMPTS[:3])  # all or none: 3 > 2
        assert isinstance(info.value, AbstainGuardError)
        threads = [
            threading.Thread(target=lambda: results.append(model.invoke(PROMPTS[0])))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        _wait_until(lambda: sched.queued == 2)
        with pytest.raises(SchedulerFullError):
            model.invoke(PROMPTS[1])
    for t in threads:
        t.join(60)
    assert len(results) == 2
    for msg in results:
        assert_same_answer(solo, msg)


def test_replay_and_generation_interleave_without_deadlock() -> None:
    model = tiny_chat_model("gemma3_text", seed=6, max_new_tokens=8)
    solo = [model.invoke(p) for p in PROMPTS[:4]]
    replays = [
        model.replay(p, m.response_metadata["token_ids"])
        for p, m in zip(PROMPTS[:4], solo, strict=True)
    ]
    calls: list[Callable[[], Any]] = []
    for i in range(4):
        calls.append(lambda i=i: model.invoke(PROMPTS[i]))
        calls.append(lambda i=i: model.replay(PROMPTS[i], solo[i].response_metadata["token_ids"]))
    out: list[Any] = [None] * len(calls)
    threads = [
        threading.Thread(target=lambda k=k: out.__setitem__(k, calls[k]())) for k in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(not t.is_alive() for t in threads), "deadlock"
    for i in range(4):
        assert_same_answer(solo[i], out[2 * i])
        assert out[2 * i + 1].metadata["geometry"] == replays[i].metadata["geometry"]


def test_caller_holding_the_model_lock_runs_inline() -> None:
    model = tiny_chat_model("qwen2", seed=7, max_new_tokens=6)
    solo = model.invoke(PROMPTS[1])
    with model._s.lock:
        inline = model.invoke(PROMPTS[1])
    assert_same_answer(solo, inline)


def test_the_probe_finds_up_to_how_many_rows_each_row_keeps_its_bits() -> None:
    """With one BLAS thread, rows from MIN_DECODE_ROWS on do not depend on the batch up to a
    count that depends on the CPU and MKL's branch (for this shape: 12 and more on an AMD
    EPYC and natively on an Intel Xeon, 6 on an Intel Xeon with ``MKL_CBWR=AVX2``, as
    ``make test-foreign`` runs). ``independent_rows`` must return exactly that count: every
    batch up to it gives each row the bits it has among MIN_DECODE_ROWS rows, and the batch
    one row larger (when under the probe's bound) gives some row other bits."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn((48, 32), generator=gen)
    x = torch.randn((16, 32), generator=torch.Generator().manual_seed(0))
    with blas_threads(1), torch.inference_mode():
        cap = independent_rows(weight, MIN_DECODE_ROWS, 16)
        ref = torch.nn.functional.linear(x[:MIN_DECODE_ROWS], weight)

        def keeps_bits(m: int) -> bool:
            out = torch.nn.functional.linear(x[:m], weight)
            flipped = torch.nn.functional.linear(x[:m].flip(0), weight).flip(0)
            return torch.equal(out[:MIN_DECODE_ROWS], ref) and torch.equal(flipped, out)

        assert all(keeps_bits(m) for m in range(MIN_DECODE_ROWS, cap + 1))
        if cap < 16:
            assert not keeps_bits(max(cap + 1, MIN_DECODE_ROWS))
        # probed and asserted under the same thread count: another count may give other bits
        assert independent_rows(weight, MIN_DECODE_ROWS, cap) == cap


def test_more_rows_than_one_step_holds_decode_in_several_shared_steps() -> None:
    """A shared step holds at most ``path.max_rows`` rows (where the probe found rows
    independent); more concurrent callers are split into near-even forwards, and every
    caller still gets bitwise its solo answer, as with one forward for all."""
    model = tiny_chat_model("llama", seed=5, max_new_tokens=10, batch_decode=True)
    solo = [model.invoke(p) for p in PROMPTS]
    engine = _scheduler(model).engines[0]
    assert engine is not None and engine.path.steps == "shared"
    wide = engine.path
    engine.path = replace(wide, max_rows=MIN_DECODE_ROWS)  # 6 callers: forwards of 3 and 3
    try:
        assert engine.path.record() == wide.record()  # the cap is not part of the numbers
        got = _run_threads(model, [lambda p=p: model.invoke(p) for p in PROMPTS])
    finally:
        engine.path = wide
    for a, b in zip(solo, got, strict=True):
        assert_same_answer(a, b)
    rows = list(range(9))
    groups = _step_groups(rows, replace(wide, max_rows=6))  # type: ignore[arg-type]
    assert [len(g) for g in groups] == [5, 4] and [r for g in groups for r in g] == rows
    assert len(_step_groups(rows, replace(wide, max_rows=16))) == 1  # type: ignore[arg-type]
    alone = DecodePath("alone", 1, 1)
    assert [len(g) for g in _step_groups(rows, alone)] == [1] * 9  # type: ignore[arg-type]


@pytest.mark.model
def test_default_model_concurrent_callers_match_solo(default_model: GeometryChatModel) -> None:
    questions = [
        "What is the capital of France?",
        "Who wrote Hamlet?",
        "What is 2+2?",
        "Which ocean is the largest?",
    ]
    solo = [default_model.invoke(q, max_new_tokens=10) for q in questions]
    got = _run_threads(
        default_model, [lambda q=q: default_model.invoke(q, max_new_tokens=10) for q in questions]
    )
    assert _scheduler(default_model).widest_step >= len(questions)
    for a, b in zip(solo, got, strict=True):
        assert_same_answer(a, b)


def test_batch_decode_shares_steps_and_keeps_solo_answers() -> None:
    """``batch_decode``: decode steps of concurrent callers run as one forward (on one BLAS
    thread where that is what makes rows independent) and every caller still gets bitwise
    its solo answer; one loaded model has one decode mode."""
    model = tiny_chat_model("llama", seed=5, max_new_tokens=10, batch_decode=True)
    solo = [model.invoke(p) for p in PROMPTS]
    sched = _scheduler(model)
    assert sched.batch_decode
    engine = sched.engines[0]
    assert engine is not None and engine.path.steps == "shared"
    assert engine.path.min_rows == MIN_DECODE_ROWS and engine.path.threads == 1
    got = _run_threads(model, [lambda p=p: model.invoke(p) for p in PROMPTS])
    for a, b in zip(solo, got, strict=True):
        assert_same_answer(a, b)
    with pytest.raises(ValueError, match="one decode mode"):
        scheduler_for(model._s, batch_decode=False)
    other = model.model_copy(update={"batch_decode": False})
    other._shared = model._shared
    with pytest.raises(ValueError, match="one decode mode"):
        other.invoke(PROMPTS[0])


def test_blas_threads_is_per_thread_and_restored() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []
    with blas_threads(1):
        seen.append(torch.get_num_threads())
        other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        other.start()
        other.join()
    assert seen[0] == 1
    assert torch.get_num_threads() == before
