"""Chat-model calls from threads that all queue before the model starts (deterministic
shared steps)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from abstain_guard.adapters import GeometryChatModel
from abstain_guard.adapters.engine.scheduler import GenerationScheduler, scheduler_for


def _scheduler(model: GeometryChatModel) -> GenerationScheduler:
    return scheduler_for(model._s)


@contextmanager
def _model_held(model: GeometryChatModel) -> Iterator[None]:
    """Hold the model lock from another thread, so submitted calls queue up (deterministic
    batching: the worker admits them all at once when the block ends)."""
    got, release = threading.Event(), threading.Event()

    def hold() -> None:
        with model._s.lock:
            got.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    got.wait(60)
    try:
        yield
    finally:
        release.set()
        holder.join(60)


def _wait_until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _run_threads(model: GeometryChatModel, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads that all queue before the model starts; results in order."""
    out: list[Any] = [None] * len(calls)

    def work(i: int) -> None:
        out[i] = calls[i]()

    sched = _scheduler(model)
    with _model_held(model):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        _wait_until(lambda: sched.queued == len(calls))
    for t in threads:
        t.join(120)
    return out
