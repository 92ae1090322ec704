"""One scheduler per loaded model: concurrent callers share its forward passes.

Callers submit :class:`~.batching.GenerationRequest` objects and get futures back; worker
threads, one per engine (:func:`~.threads.engine_workers`), admit their fair share of the
waiting requests between decode steps and run them on a :class:`~.batching.BatchEngine`.
Every caller gets bitwise what it gets alone. Bounds, locking and exactness:
docs/architecture.md, "Concurrent callers".
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from abstain_guard.errors import SchedulerFullError

from ..model.loading import LoadedModel
from .batching import BatchEngine, GenerationRequest, Row, RowResult
from .threads import engine_workers

#: Rows decoded together in one step (more wait in the queue).
DEFAULT_MAX_BATCH = 8
#: Requests that may wait for a place in the batch before ``submit`` refuses more.
DEFAULT_MAX_QUEUE = 64


@dataclass
class _Pending:
    request: GenerationRequest
    future: Future[RowResult]


class GenerationScheduler:
    """Queue and workers of one loaded model (see the module docstring)."""

    def __init__(
        self,
        loaded: LoadedModel,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_queue: int = DEFAULT_MAX_QUEUE,
        batch_decode: bool = True,
        workers: int | None = None,
    ) -> None:
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be positive")
        self.loaded = loaded
        self.max_batch = max_batch
        self.max_queue = max_queue
        #: ask the engines for shared decode steps (fixed when the engines are built)
        self.batch_decode = batch_decode
        self.workers = workers if workers is not None else engine_workers(loaded.hf_model)
        if self.workers < 1:
            raise ValueError("workers must be positive")
        self._cond = threading.Condition()
        self._pending: deque[_Pending] = deque()
        self._running: list[threading.Thread | None] = [None] * self.workers
        self._engines: list[BatchEngine | None] = [None] * self.workers
        self._widest = 0

    # -- submitting ------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests waiting for a place in a batch."""
        with self._cond:
            return len(self._pending)

    @property
    def widest_step(self) -> int:
        """Most answers decoded at the same time so far (all engines together)."""
        return self._widest

    @property
    def engines(self) -> list[BatchEngine]:
        """The engines built so far (one per worker that has run)."""
        return [e for e in self._engines if e is not None]

    def submit(self, requests: Sequence[GenerationRequest]) -> list[Future[RowResult]]:
        """Queue ``requests`` (all or none) and return one future per request.

        Raises SchedulerFullError when the queue cannot take them all. A thread that holds
        the model lock gets its requests run inline (the futures are already done).
        """
        pending = [_Pending(r, Future()) for r in requests]
        if _owns(self.loaded.lock):
            self._run_inline(pending)
            return [p.future for p in pending]
        with self._cond:
            if len(self._pending) + len(pending) > self.max_queue:
                raise SchedulerFullError(
                    f"the model's request queue is full ({len(self._pending)} of "
                    f"{self.max_queue} waiting, {len(pending)} more asked for). Retry later, "
                    "send fewer concurrent calls, or raise the bound with "
                    "GeometryChatModel(max_queue=...)."
                )
            self._pending.extend(pending)
            for slot in range(min(self.workers, len(self._pending))):
                if self._running[slot] is None:
                    worker = threading.Thread(
                        target=self._work,
                        args=(slot,),
                        name=f"abstain-guard-engine-{slot}",
                        daemon=True,
                    )
                    self._running[slot] = worker
                    _WORKERS.add(worker)
                    worker.start()
            self._cond.notify_all()
        return [p.future for p in pending]

    # -- the workers -----------------------------------------------------------------------

    def _take(self, slot: int, runner: _Runner) -> list[_Pending] | None:
        """Requests worker ``slot`` admits now (its fair share of the rows in flight, at
        least one when it has none); None when it has nothing left to do (it exits)."""
        with self._cond:
            own = len(runner.engine.active)
            if not self._pending and not own:
                self._running[slot] = None
                return None
            flying = sum(len(e.active) for e in self.engines) + len(self._pending)
            share = -(-flying // self.workers) - own
            room = self.max_batch - own
            take = min(room, len(self._pending), max(share, 0 if own else 1))
            return [self._pending.popleft() for _ in range(take)]

    def _note_width(self) -> None:
        self._widest = max(self._widest, sum(len(e.active) for e in self.engines))

    def _work(self, slot: int) -> None:
        """Worker loop: admit and prefill, decode one step, resolve finished rows; repeat.
        On an unexpected failure its own rows and every waiting caller get the exception
        (never a hang); the other workers go on with their rows."""
        runner: _Runner | None = None
        try:
            with self.loaded.lock:  # the first build probes the weights (decode path)
                engine = self._engines[slot]
                if engine is None:
                    engine = BatchEngine(self.loaded, self.max_batch, self.batch_decode)
                    self._engines[slot] = engine
            runner = _Runner(engine, self._note_width)
            while (admit := self._take(slot, runner)) is not None:
                with self.loaded.lock.shared():
                    done = runner.round(admit)
                runner.finish(done)
        except BaseException as exc:
            with self._cond:
                self._running[slot] = None
                waiting = list(self._pending)
                self._pending.clear()
            for p in waiting:
                p.future.set_exception(exc)
            if runner is not None:
                runner.fail(runner.engine.drop_all(), exc)
            raise

    def _run_inline(self, pending: list[_Pending]) -> None:
        """Run ``pending`` to completion in the calling thread (it holds the model lock)."""
        runner = _Runner(BatchEngine(self.loaded, self.max_batch, self.batch_decode))
        queue = deque(pending)
        while queue or runner.engine.active:
            room = self.max_batch - len(runner.engine.active)
            runner.finish(runner.round([queue.popleft() for _ in range(min(room, len(queue)))]))


class _Runner:
    """An engine and the futures of its rows (used by one thread at a time)."""

    def __init__(self, engine: BatchEngine, before_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.futures: dict[int, Future[RowResult]] = {}
        self._before_step = before_step

    def round(self, admit: list[_Pending]) -> list[Row]:
        """Prefill ``admit`` (each failure is that caller's alone), then one decode step
        (a failure goes to every active row); returns the finished rows."""
        done: list[Row] = []
        for p in admit:
            if not p.future.set_running_or_notify_cancel():
                continue
            try:
                row = self.engine.start(p.request)
            except BaseException as exc:
                p.future.set_exception(exc)
                continue
            self.futures[id(row)] = p.future
            if row.finish is not None:
                done.append(row)
        if self._before_step is not None:
            self._before_step()
        try:
            done.extend(self.engine.step())
        except BaseException as exc:
            self.fail(self.engine.drop_all(), exc)
        return done

    def finish(self, rows: list[Row]) -> None:
        """Hand each finished row's result to its caller."""
        for row in rows:
            fut = self.futures.pop(id(row))
            try:
                fut.set_result(row.result())
            except BaseException as exc:
                fut.set_exception(exc)

    def fail(self, rows: list[Row], exc: BaseException) -> None:
        """Hand ``exc`` to the callers of ``rows``."""
        for row in rows:
            self.futures.pop(id(row)).set_exception(exc)


#: Scheduler workers started in this process (see :func:`_join_workers`).
_WORKERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _join_workers(timeout: float = 30.0) -> None:
    """At interpreter exit, let each worker finish what it is doing (a daemon worker still
    inside a torch call when torch's thread pools are torn down aborts the process)."""
    for worker in list(_WORKERS):
        if worker is not threading.current_thread():
            worker.join(timeout)


def _owns(lock: object) -> bool:
    """Whether the calling thread holds ``lock`` (an RLock)."""
    is_owned = getattr(lock, "_is_owned", None)
    return bool(is_owned()) if callable(is_owned) else False


_CREATE = threading.Lock()


def scheduler_for(
    loaded: LoadedModel,
    max_batch: int | None = None,
    max_queue: int | None = None,
    batch_decode: bool | None = None,
) -> GenerationScheduler:
    """The scheduler of ``loaded``, created on first use (bounds default to
    :data:`DEFAULT_MAX_BATCH` and :data:`DEFAULT_MAX_QUEUE`, ``batch_decode`` to True);
    bounds given later replace the current ones (``max_batch`` only up to the first one: the
    engine's batch shape is fixed when it is built). ``batch_decode`` is fixed at creation:
    asking for the other setting later raises ValueError (the numbers would change in the
    last bits between calls)."""
    with _CREATE:
        sched = loaded.scheduler
        if not isinstance(sched, GenerationScheduler):
            sched = GenerationScheduler(
                loaded,
                max_batch or DEFAULT_MAX_BATCH,
                max_queue or DEFAULT_MAX_QUEUE,
                True if batch_decode is None else bool(batch_decode),
            )
            loaded.scheduler = sched
            return sched
        if batch_decode is not None and batch_decode != sched.batch_decode:
            raise ValueError(
                f"this loaded model's scheduler runs with batch_decode={sched.batch_decode}; "
                "one loaded model has one decode mode. Load the model again for the other."
            )
        with sched._cond:
            if max_queue is not None:
                sched.max_queue = max(1, max_queue)
            if max_batch is not None:
                built = sched.engines
                cap = built[0].max_rows if built else max_batch
                sched.max_batch = max(1, min(max_batch, cap))
        return sched
