"""The capture that runs inside stock vLLM (abstain_guard/backends/vllm_capture.py), without
vLLM: driven in vLLM's call orders (synchronous, and async scheduling: step N + 1 queued before
step N's output is read, the read on another thread while step N + 1 runs), against
``hidden_summary`` over the same rows; no sync and no pageable copy on the engine thread;
device placement on a stand-in GPU; a failing hook fails its requests only; the chunked
entropy; the tap inside a compiled graph."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from abstain_guard.backends.vllm_capture import (
    HostCapture,
    RunnerCapture,
    StepCopier,
    install_tap,
    token_entropy,
)
from abstain_guard.backends.vllm_payload import (
    PAYLOAD_KEY,
    decode_capture,
    sign_payload,
    tokens_digest,
)
from abstain_guard.contract.metadata import hidden_summary
from abstain_guard.errors import BackendError

K, D, V, T = 2, 8, 11, 64
KEY = b"test key"


def _stop(params: Any, prompt_len: int, output: list[int]) -> bool:
    return len(output) >= params.max_tokens


class _World:
    """A model runner as the capture reads vLLM's, and the rows and logits of each request
    at each position (``states[req][pos]``, ``logits[req][pos]``)."""

    def __init__(self, prompts: dict[str, int], budgets: dict[str, int], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.prompts, self.budgets = prompts, budgets
        self.states = {r: rng.normal(size=(40, K, D)).astype(np.float32) for r in prompts}
        self.logits = {r: rng.normal(size=(40, V)).astype(np.float32) for r in prompts}
        self.tokens = {r: rng.integers(0, V, size=40).tolist() for r in prompts}
        self.taps = [torch.zeros(T, D) for _ in range(K)]
        self.runner = SimpleNamespace(
            max_num_reqs=8,
            input_batch=SimpleNamespace(num_reqs=0, req_ids=[]),
            query_start_loc=SimpleNamespace(np=np.zeros(9, dtype=np.int32)),
            positions=torch.zeros(T, dtype=torch.int64),
            requests={
                r: SimpleNamespace(
                    num_prompt_tokens=p,
                    prompt_token_ids=list(range(p)),
                    sampling_params=SimpleNamespace(max_tokens=budgets[r]),
                )
                for r, p in prompts.items()
            },
        )

    def capture(self, ring: int = 3, without_entropy: tuple[str, ...] = ()) -> RunnerCapture:
        host = HostCapture([3, 5], D, 32, _stop)
        host.want({r: r not in without_entropy for r in self.prompts})
        return RunnerCapture(self.runner, self.taps, host, ring=ring)

    def prepare(self, step: list[tuple[str, int, int]]) -> tuple[torch.Tensor, Any]:
        """One step's forward (``(request, first position, rows)`` in batch order): the tap
        and the runner's inputs written; returns the sampler's logits and the step's output
        as ``sample_tokens`` gives it (a token for each request whose last row is at or past
        its prompt's end)."""
        pos, qsl, logits, sampled = [], [0], [], []
        for req, first, n in step:
            for p in range(first, first + n):
                for layer in range(K):
                    self.taps[layer][len(pos)] = torch.from_numpy(self.states[req][p, layer])
                pos.append(p)
            qsl.append(len(pos))
            last = first + n - 1
            logits.append(self.logits[req][last])
            sampled.append([self.tokens[req][last]] if last >= self.prompts[req] - 1 else [])
        self.runner.positions[: len(pos)] = torch.from_numpy(np.asarray(pos))
        self.runner.query_start_loc.np[: len(qsl)] = qsl
        self.runner.input_batch.num_reqs = len(step)
        reqs = [r for r, _, _ in step]
        self.runner.input_batch.req_ids = reqs
        output = SimpleNamespace(
            req_ids=reqs,
            req_id_to_index={r: k for k, r in enumerate(reqs)},
            sampled_token_ids=sampled,
        )
        return torch.from_numpy(np.stack(logits)), output

    def execute(self, capture: RunnerCapture, step: list[tuple[str, int, int]]) -> Any:
        """``execute_model`` of one step: the forward, then the sampler's logits reach the
        capture; returns the step's output."""
        logits, output = self.prepare(step)
        capture.begin_step(SimpleNamespace(finished_req_ids=set()))
        capture.on_logits(logits)
        return output

    def expected(self, req: str) -> tuple[dict[str, Any], list[float], list[int]]:
        p, n = self.prompts[req], self.budgets[req]
        want = hidden_summary(self.states[req][p - 1 : p + n - 1], [3, 5])
        entropy = token_entropy(torch.tensor(self.logits[req][p - 1 : p + n - 1]))
        return want, entropy.tolist(), self.tokens[req][p - 1 : p + n - 1]

    def check(self, req: str, payload: dict[str, Any], with_entropy: bool = True) -> None:
        want, entropy, tokens = self.expected(req)
        prompt = list(range(self.prompts[req]))
        params = {PAYLOAD_KEY: sign_payload(dict(payload), KEY)}
        got_entropy, hidden, _ = decode_capture(params, prompt, tokens, KEY)
        assert hidden is not None and want is not None
        np.testing.assert_allclose(hidden["last"], want["last"], rtol=0, atol=0)
        np.testing.assert_allclose(hidden["mean"], want["mean"], rtol=1e-6, atol=1e-7)
        if with_entropy:
            np.testing.assert_allclose(got_entropy, entropy, rtol=1e-6)
        else:
            assert got_entropy is None


def _sync_steps(world: _World, capture: RunnerCapture, steps: list) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for step in steps:
        result = world.execute(capture, step)
        out.update(capture.on_output(capture.take_step(), result))
    return out


STEPS = [
    [("a", 0, 4)],  # a's prompt (6) in two chunks: the first chunk's last row does not count
    [("b", 0, 3), ("a", 4, 2)],
    [("a", 6, 1), ("b", 3, 1)],
    [("b", 4, 1), ("a", 7, 1)],  # the batch order changes between steps
    [("a", 8, 1), ("b", 5, 1)],
    [("b", 6, 1)],
]


def test_read_out_is_the_answer_rows_summary_through_chunked_prefill_and_batching() -> None:
    world = _World({"a": 6, "b": 3}, {"a": 4, "b": 5})
    capture = world.capture()
    out = _sync_steps(world, capture, STEPS)
    assert set(out) == {"a", "b"}
    for req in ("a", "b"):
        world.check(req, out[req])
    assert capture.host.size == 0


def test_async_order_the_next_step_is_queued_before_the_output_is_read() -> None:
    """vLLM's async scheduler: step N + 1 runs (scheduled before step N's tokens were seen,
    so it holds a row after a's last token) before step N's output is read."""
    world = _World({"a": 4}, {"a": 4}, seed=1)
    capture = world.capture()
    steps = [
        [("a", 0, 4)],  # prompt of 4: row 3 predicts token 1
        [("a", 4, 1)],
        [("a", 0, 6)],  # preempted, recomputed over prompt + 2 tokens: row 5 predicts token 3
        [("a", 6, 1)],  # predicts token 4, the last
        [("a", 7, 1)],  # run before the stop was seen
    ]
    out: dict[str, dict] = {}
    queued: list[tuple[Any, Any]] = []
    for step in steps:
        result = world.execute(capture, step)
        queued.append((capture.take_step(), result))
        if len(queued) == 2:  # the output of the step before this one is read now
            out.update(capture.on_output(*queued.pop(0)))
    out.update(capture.on_output(*queued.pop(0)))
    world.check("a", out["a"])


class _PauseAt(TorchFunctionMode):
    """On the thread that enters it: at the ``at``-th torch call, let ``other`` run to its
    end before going on (the output thread's read, interleaved at that point)."""

    def __init__(self, at: int, go: threading.Event, done: threading.Event) -> None:
        super().__init__()
        self.at, self.go, self.done, self.calls = at, go, done, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        if self.calls == self.at:
            self.go.set()
            assert self.done.wait(10)
        return func(*args, **(kwargs or {}))


def _interleaved(at: int) -> tuple[_World, dict[str, dict], int]:
    world = _World({"a": 3, "b": 3}, {"a": 3, "b": 5}, seed=2)
    capture = world.capture()
    _sync_steps(world, capture, [[("a", 0, 3), ("b", 0, 3)], [("a", 3, 1), ("b", 3, 1)]])
    result = world.execute(capture, [("a", 4, 1), ("b", 4, 1)])  # a's last token
    step = capture.take_step()
    out: dict[str, dict] = {}
    go, done = threading.Event(), threading.Event()

    def output_thread() -> None:
        go.wait(10)
        out.update(capture.on_output(step, result))
        done.set()

    reader = threading.Thread(target=output_thread)
    reader.start()
    mode = _PauseAt(at, go, done)
    with mode:  # step N + 1, with a's extra row, runs while step N's output is read
        world.execute(capture, [("a", 5, 1), ("b", 5, 1)])
    go.set()
    reader.join(10)
    return world, out, mode.calls


def test_the_output_thread_reads_step_n_while_step_n_plus_1_runs() -> None:
    """At every torch call of step N + 1 (the engine thread), step N's output is read on
    another thread (the worker's async output thread under TP > 1): the read-out is the
    same whatever the interleaving."""
    _, _, calls = _interleaved(10**9)
    assert calls > 3
    for at in range(1, calls + 1):
        world, out, _ = _interleaved(at)
        assert set(out) == {"a"}, at
        world.check("a", out["a"])


def test_release_on_the_engine_thread_races_the_output_thread() -> None:
    """The scheduler's finished / aborted requests are dropped on the engine thread while the
    output thread adds rows and reads out: the bookkeeping stays consistent."""
    host = HostCapture([0], 4, 8, _stop)
    errors: list[BaseException] = []
    stop = threading.Event()
    params = SimpleNamespace(max_tokens=3)  # finished on the output thread, released on both

    def engine() -> None:
        try:
            for i in range(4000):
                host.want({f"r{i}": True})
                host.admit(f"r{i}", [1], 1, params)
                host.release([f"r{i - 3}", f"r{i - 5}"])
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop.set()

    def output() -> None:
        try:
            while not stop.is_set():
                with host.lock:
                    live = list(host.held)
                host.sampled(dict.fromkeys(live, 1))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=engine), threading.Thread(target=output)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as the interpreter lets them
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not errors and host.size <= 5


def test_a_release_during_the_read_out_waits_for_it() -> None:
    """The scheduler aborts a request (a release on the engine thread) at the moment the
    output thread's stop rule finds it finished: the release waits for the read-out, which
    answers with the request's payload (without the lock the read-out drops what the release
    already dropped: a KeyError that would end the output thread)."""
    done = threading.Event()
    releaser: list[threading.Thread] = []

    def stop(params: Any, prompt_len: int, output: list[int]) -> bool:
        releaser.append(threading.Thread(target=lambda: (host.release(["a"]), done.set())))
        releaser[0].start()
        assert not done.wait(0.2)  # the release waits for this read-out
        return True

    host = HostCapture([0], 4, 8, stop)
    host.want({"a": True})
    host.admit("a", [1], 1, SimpleNamespace(max_tokens=1))
    out = host.sampled({"a": 5})
    releaser[0].join(10)
    assert set(out) == {"a"} and done.is_set() and host.size == 0


def test_a_hook_that_raises_fails_its_requests_only(monkeypatch: pytest.MonkeyPatch) -> None:
    world = _World({"a": 3, "b": 3}, {"a": 2, "b": 2}, seed=3)
    capture = world.capture()
    copy = StepCopier.copy
    calls = {"n": 0}

    def flaky(self: StepCopier, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(StepCopier, "copy", flaky)
    out = _sync_steps(world, capture, [[("a", 0, 3)], [("a", 3, 1)], [("b", 0, 3)], [("b", 3, 1)]])
    assert "step copy raised RuntimeError('boom')" in out["a"]["error"]
    world.check("b", out["b"])
    broken = SimpleNamespace(req_ids=["b"], req_id_to_index=None, sampled_token_ids=5)
    assert capture.on_output(None, broken) == {}  # a read-out that raises: nothing escapes


@contextmanager
def _no_sync_on_the_engine_thread() -> Any:
    """What ``VLLM_GPU_SYNC_CHECK`` flags, raised: host reads of device tensors, device
    syncs, and per-step host tensors built from Python lists (pageable copies)."""

    def refuse(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"{name} on the engine thread")

        return call

    patches = {
        (torch.Tensor, "cpu"): refuse("Tensor.cpu"),
        (torch.Tensor, "item"): refuse("Tensor.item"),
        (torch.Tensor, "tolist"): refuse("Tensor.tolist"),
        (torch.cuda, "synchronize"): refuse("torch.cuda.synchronize"),
        (torch.cuda.Event, "synchronize"): refuse("Event.synchronize"),
        (torch.cuda.Stream, "synchronize"): refuse("Stream.synchronize"),
        (torch, "tensor"): refuse("torch.tensor"),
    }
    saved = {k: getattr(*k) for k in patches}
    try:
        for (owner, name), fn in patches.items():
            setattr(owner, name, fn)
        yield
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


def test_no_step_syncs_or_copies_pageable_memory_on_the_engine_thread() -> None:
    world = _World({"a": 3}, {"a": 3}, seed=4)
    capture = world.capture()
    out: dict[str, dict] = {}
    for step in [[("a", 0, 3)], [("a", 3, 1)], [("a", 4, 1)]]:
        logits, result = world.prepare(step)  # the forward's own tensors
        with _no_sync_on_the_engine_thread():
            capture.begin_step(SimpleNamespace(finished_req_ids=set()))
            capture.on_logits(logits)
            rows = capture.take_step()
        out.update(capture.on_output(rows, result))
    assert "a" in out and "error" not in out["a"]
    copier = capture.copier
    assert copier.pinned == torch.cuda.is_available()  # pinned wherever pin_memory exists


def _entropy_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The logit rows each call of the capture's ``token_entropy`` computes, in order."""
    import abstain_guard.backends.vllm_capture as capture_module

    rows_seen: list[int] = []
    entropy = capture_module.token_entropy

    def counted(logits: torch.Tensor, rows: Any = None, **kwargs: Any) -> torch.Tensor:
        rows_seen.append(int(logits.shape[0] if rows is None else rows.shape[0]))
        return entropy(logits, rows, **kwargs)

    monkeypatch.setattr(capture_module, "token_entropy", counted)
    return rows_seen


def test_only_the_requests_that_asked_are_gathered_and_their_entropies_computed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a batch of three, one asked for its capture: its row alone is gathered, its logit
    row alone has its entropy computed, and only it is held."""
    world = _World({"a": 3, "b": 3, "c": 3}, {"a": 2, "b": 2, "c": 2}, seed=6)
    host = HostCapture([3, 5], D, 32, _stop)
    host.want({"b": True})
    capture = RunnerCapture(world.runner, world.taps, host, ring=3)
    rows_seen = _entropy_rows(monkeypatch)
    world.execute(capture, [("a", 0, 3), ("b", 0, 3), ("c", 0, 3)])
    step = capture.take_step()
    assert step is not None and step.req_ids == ["b"] and step.rows.shape == (1, K, D)
    assert rows_seen == [1] and host.size == 1


def test_a_request_that_asked_for_no_entropy_gets_its_rows_and_no_entropy_computed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A guard whose scorer reads no entropy asks for none: in a batch where ``a`` asked for
    its entropies and ``b`` did not, each step computes the entropy of ``a``'s logit row only;
    ``b``'s capture is its exact rows summary with ``entropy`` None, ``a``'s is unchanged."""
    world = _World({"a": 6, "b": 3}, {"a": 4, "b": 5})
    capture = world.capture(without_entropy=("b",))
    rows_seen = _entropy_rows(monkeypatch)
    out = _sync_steps(world, capture, STEPS)
    world.check("a", out["a"])
    world.check("b", out["b"], with_entropy=False)
    assert rows_seen == [1, 1, 1, 1, 1, 0]  # a's row in each step, none in b's last step alone


def test_the_profiling_run_runs_the_step_copy_at_its_largest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's profiling run (``_dummy_sampler_run``: logits for ``max_num_seqs`` rows) runs
    the gather, the chunked entropy and the host copy over every row the copier can hold, so
    their peak memory is in what vLLM measures before it sizes the KV cache."""
    world = _World({"a": 3}, {"a": 2}, seed=7)
    capture = world.capture()
    rows_seen = _entropy_rows(monkeypatch)
    capture.profiling = True
    capture.on_logits(torch.randn(world.runner.max_num_reqs + 4, V))
    assert rows_seen == [world.runner.max_num_reqs] and capture.copier.step == 1
    assert capture.take_step() is None and capture.host.size == 0  # nothing is held


class _FakeStream:
    current: _FakeStream | None = None

    def __init__(self, device: Any = None) -> None:
        self.waited = 0

    def wait_stream(self, other: Any) -> None:
        self.waited += 1

    def synchronize(self) -> None:
        raise AssertionError("a stream synchronized")


class _FakeEvent:
    def __init__(self) -> None:
        self.recorded, self.synced = 0, 0

    def record(self, stream: Any = None) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        self.synced += 1


def test_on_a_gpu_the_copies_run_on_a_copy_stream_with_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA branch of the step copy, on stand-in streams and events: every host buffer
    it allocates is pinned (the persistent ones and each step's staged indices), the engine
    thread queues non-blocking copies into the persistent host buffers on the copy stream
    (after the compute stream) and records an event, and nothing on it waits for an event or
    a stream; only the read-out waits for the step's event."""
    copies: list[tuple[bool, bool, bool]] = []
    main = _FakeStream()
    pinned: list[bool] = []

    @contextmanager
    def on_stream(stream: Any) -> Any:
        _FakeStream.current = stream
        try:
            yield
        finally:
            _FakeStream.current = None

    def host_alloc(real: Any) -> Any:
        def alloc(*shape: Any, **kwargs: Any) -> torch.Tensor:
            if "device" not in kwargs:  # a host buffer (the stand-in GPU is the CPU too)
                pinned.append(bool(kwargs.pop("pin_memory", False)))
            return real(*shape, **kwargs)

        return alloc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "zeros", host_alloc(torch.zeros))
    monkeypatch.setattr(torch, "empty", host_alloc(torch.empty))
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    copier = StepCopier(K, D, 4, torch.device("cpu"), ring=3, copy_stream=True)
    assert copier.pinned and len(pinned) == 3 and all(pinned)
    owned = [copier.rows, copier.entropy, copier.positions, copier.index_dev]
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in owned]
    real_copy = torch.Tensor.copy_

    def watched(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        inside = any(lo <= self.data_ptr() < hi for lo, hi in spans)
        copies.append((inside, bool(non_blocking), _FakeStream.current is copier.stream))
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", watched)
    taps = [torch.randn(T, D) for _ in range(K)]
    with _no_sync_on_the_engine_thread():
        rows = copier.copy(
            taps, torch.randn(3, V), torch.arange(T), [5, 9, 2], [0, 1, 2], list("abc")
        )
    assert len(pinned) == 4 and all(pinned)  # the step's staged indices
    index_copy, *host_copies = copies
    assert index_copy == (True, True, False)  # the H2D index copy, from pinned, non-blocking
    assert host_copies and all(c == (True, True, True) for c in host_copies)
    assert copier.stream.waited == 1 and copier.copied[0].recorded == 1
    assert rows.event is copier.copied[0] and rows.event.synced == 0
    rows.wait()
    assert rows.event.synced == 1 and rows.keep == ()
    np.testing.assert_array_equal(rows.rows[:, 1], taps[1][[5, 9, 2]].numpy())


class _OneDevice(TorchFunctionMode):
    """Stands in for a GPU's device check on a machine without one: the "GPU" is the
    ``meta`` device, and any op that mixes it with a host tensor (other than a 0-d scalar,
    or a copy between the two) raises, as CUDA does; a copy out of ``meta`` is skipped."""

    TRANSFERS = frozenset({"to", "cpu", "copy_", "cuda", "numpy", "tolist", "item"})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "copy_" and args[1].device.type == "meta" and args[0].device.type == "cpu":
            return args[0]
        if name not in self.TRANSFERS:
            found = {
                t.device.type
                for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.dim() > 0
            }
            if {"meta", "cpu"} <= found:
                raise RuntimeError(f"{name}: expected all tensors on one device, got {found}")
        return func(*args, **kwargs)


def test_one_step_on_a_gpu_indexes_the_gpu_rows_with_gpu_indices() -> None:
    gpu = torch.device("meta")
    with _OneDevice():
        taps = [torch.zeros(16, D, device=gpu) for _ in range(K)]
        copier = StepCopier(K, D, 4, gpu, ring=2, copy_stream=False)
        copier.copy(
            taps,
            torch.zeros(2, V, device=gpu),
            torch.arange(16, device=gpu),
            [4, 5],
            [0, 1],
            ["a", "b"],
        )
        assert copier.index_dev.device == gpu
        with pytest.raises(RuntimeError, match="one device"):
            taps[0].index_select(0, torch.tensor([0]))  # what the first engine's hook did


def test_entropy_in_row_chunks_is_the_full_vocabulary_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(37, 50) * 3
    logits[4, :10] = float("-inf")  # masked tokens (a grammar) add nothing
    before = logits.clone()
    logp = torch.log_softmax(logits.double(), dim=-1)
    want = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)
    got = token_entropy(logits, chunk_rows=8)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    some = torch.tensor([36, 4, 0, 4])  # of some rows, gathered a chunk at a time
    picked = token_entropy(logits, some, chunk_rows=3)
    np.testing.assert_allclose(picked.numpy(), want[some].numpy(), rtol=1e-5, atol=1e-6)
    assert torch.equal(logits, before)  # the sampler's logits are not touched
    half = token_entropy(logits.to(torch.bfloat16), chunk_rows=5)
    ref = token_entropy(logits.to(torch.bfloat16).float(), chunk_rows=64)
    np.testing.assert_allclose(half.numpy(), ref.numpy(), rtol=1e-6)


def test_the_tap_runs_inside_a_compiled_graph() -> None:
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(D, D)

        def forward(self, h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tanh(self.lin(h + r)), h + r

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer() for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, r = x, torch.zeros_like(x)
            for layer in self.layers:
                h, r = layer(h, r)
            return h + r

    torch.manual_seed(0)
    model = Model()
    taps = install_tap(model.layers, [1], 16, D, torch.float32, torch.device("cpu"))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    x = torch.randn(5, D)
    with torch.no_grad():
        compiled(x)
        h, r = model.layers[0](x, torch.zeros_like(x))
        h, r = model.layers[1].forward(h, r)
    np.testing.assert_allclose(taps[0][:5].numpy(), (h + r).numpy(), rtol=1e-6, atol=1e-6)
    # installing again (a second connector, a reload) taps once, into the same buffer
    hooks = len(model.layers[1]._forward_hooks)
    again = install_tap(model.layers, [1], 16, D, torch.float32, torch.device("cpu"))
    assert again[0] is taps[0] and len(model.layers[1]._forward_hooks) == hooks == 1


def test_rows_missing_give_an_error_not_a_summary() -> None:
    world = _World({"a": 3}, {"a": 3}, seed=5)
    capture = world.capture()
    out = _sync_steps(world, capture, [[("a", 0, 3)], [("a", 3, 1)]])
    assert not out
    # a token sampled on a path the tap did not see (no rows this step)
    out = capture.on_output(
        None, SimpleNamespace(req_id_to_index={"a": 0}, sampled_token_ids=[[1]])
    )
    assert "2 rows for 3 generated tokens" in out["a"]["error"]
    with pytest.raises(BackendError, match="could not capture"):
        decode_capture({PAYLOAD_KEY: sign_payload(out["a"], KEY)}, [0, 1, 2], [1, 2, 3], KEY)


def test_tokens_digest_binds_prompt_and_answer() -> None:
    assert tokens_digest([1, 2], [3]) != tokens_digest([1], [2, 3])
    assert tokens_digest(None, [3]) != tokens_digest([], [3])
