"""Engines side by side on one model: each thread's forwards keep their own attention, hooks
and rows, and every caller still gets bitwise its solo answer.

The scheduler runs one engine per CPU (two on the CI machine); these tests ask for two
explicitly so they exercise the concurrency on any machine.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from tiny_models import CONCURRENT_PROMPTS, assert_same_answer, tiny_chat_model

from abstain_guard.adapters import GeometryChatModel
from abstain_guard.adapters.capture.attention import attention_implementation
from abstain_guard.adapters.capture.hook_routes import install_routes, is_routed, routed
from abstain_guard.adapters.engine.scheduler import GenerationScheduler
from abstain_guard.adapters.engine.threads import ENGINE_WORKERS_ENV
from abstain_guard.adapters.model.loading import ModelLock

PROMPTS = [*CONCURRENT_PROMPTS, "Seven", "The eighth prompt is here."]


def _two_engines(model: GeometryChatModel) -> GenerationScheduler:
    sched = GenerationScheduler(model._s, workers=2)
    model._s.scheduler = sched
    return sched


@pytest.mark.parametrize(("family", "capture"), [("llama", "full"), ("qwen2", "fast")])
def test_two_engines_give_every_caller_its_solo_answer(family: str, capture: str) -> None:
    model = tiny_chat_model(family, seed=7, max_new_tokens=10, capture=capture)
    solo = [model.invoke(p) for p in PROMPTS]
    sched = _two_engines(model)
    got = model.batch(PROMPTS, config={"max_concurrency": len(PROMPTS)})
    assert len(sched.engines) == 2 and all(e.widest > 0 for e in sched.engines)
    assert sched.widest_step > max(e.widest for e in sched.engines)  # really side by side
    for a, b in zip(solo, got, strict=True):
        assert_same_answer(a, b)


def test_attention_is_chosen_per_thread() -> None:
    model = tiny_chat_model("llama", seed=1)
    cfg = model.hf_model.config
    own = cfg._attn_implementation
    inside, seen = threading.Event(), {}

    def other() -> None:
        inside.wait(10)
        seen["other"] = cfg._attn_implementation

    t = threading.Thread(target=other)
    t.start()
    with attention_implementation(model.hf_model, "eager"):
        assert cfg._attn_implementation == "eager"
        inside.set()
        t.join(10)
    assert seen["other"] == own
    assert cfg._attn_implementation == own


def test_routed_hooks_fire_only_in_their_thread() -> None:
    layer = torch.nn.Linear(3, 3)
    calls: list[str] = []
    with (
        pytest.raises(RuntimeError, match="no capture routes"),
        routed([(layer, "pre", lambda m, a: calls.append("x"), False)]),
    ):
        pass
    install_routes([layer, layer])
    assert is_routed(layer) and len(layer._forward_pre_hooks) == 1

    def other() -> None:
        layer(torch.ones(1, 3))

    with routed(
        [
            (layer, "pre", lambda m, a: calls.append(threading.current_thread().name), False),
            (layer, "post", lambda m, a, kw, out: calls.append("post"), True),
        ]
    ):
        t = threading.Thread(target=other, name="other")
        t.start()
        t.join(10)
        assert calls == []
        layer(torch.ones(1, 3))
    assert calls == [threading.current_thread().name, "post"]
    layer(torch.ones(1, 3))
    assert len(calls) == 2


def test_model_lock_shares_among_engines_and_excludes_replay() -> None:
    lock = ModelLock()
    both = threading.Barrier(2, timeout=10)
    order: list[str] = []

    def engine() -> None:
        with lock.shared():
            both.wait()  # two shared holders at once, or this times out
        order.append("engine")

    threads = [threading.Thread(target=engine) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["engine", "engine"]

    with lock.shared():
        assert lock._is_owned()  # a generation asked for here runs inline
        with pytest.raises(RuntimeError, match="alone"):
            lock.acquire()  # would deadlock: refused instead
    assert not lock._is_owned()

    entered = threading.Event()

    def replay() -> None:
        with lock:
            entered.set()

    with lock.shared():
        t = threading.Thread(target=replay)
        t.start()
        time.sleep(0.2)
        assert not entered.is_set()  # waits for the shared holder
    t.join(10)
    assert entered.is_set()
    with lock, lock, lock.shared():  # the exclusive holder re-enters, shared or not
        assert lock._is_owned()
    assert not lock._is_owned()


def test_replay_batches_side_by_side_match_one_after_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_chat_model("llama", seed=4)
    pairs = [(p[:12], f"Answer {i}.") for i, p in enumerate(PROMPTS)]
    monkeypatch.setenv(ENGINE_WORKERS_ENV, "1")
    alone = model.replay_batch(pairs, batch_size=2, return_states=True)
    monkeypatch.setenv(ENGINE_WORKERS_ENV, "2")
    both = model.replay_batch(pairs, batch_size=2, return_states=True)
    assert len(both) == len(pairs)
    for a, b in zip(alone, both, strict=True):
        assert a.metadata == b.metadata
        assert a.states is not None and b.states is not None
        assert np.array_equal(a.states.post_attn, b.states.post_attn)
        assert np.array_equal(a.states.post_mlp, b.states.post_mlp)
    with model._s.lock:  # the thread holding the lock alone replays in its own thread
        again = model.replay_batch(pairs[:4], batch_size=2)
    assert [r.metadata for r in again] == [r.metadata for r in model.replay_batch(pairs[:4], 2)]
