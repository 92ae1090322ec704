"""The capture that runs inside stock vLLM (abstain_guard/backends/vllm_capture.py), without
vLLM: device placement on a fake GPU, the running sums against ``hidden_summary`` over the
same rows, the steps vLLM schedules around a request (chunked prefill, one step after the
last token, preemption), the tap inside a compiled graph, the stop rule and the payload."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from abstain_guard.backends.vllm_capture import (
    RequestCapture,
    finishes,
    install_tap,
    step_from_runner,
    token_entropy,
)
from abstain_guard.backends.vllm_payload import (
    PAYLOAD_KEY,
    connector_flag,
    decode_capture,
    encode_capture,
)
from abstain_guard.contract.metadata import hidden_summary
from abstain_guard.errors import BackendError

K, D, V = 2, 8, 11


def _runner(
    req_ids: list[str],
    query_lens: list[int],
    positions: torch.Tensor,
    prompt_lens: dict[str, int],
    device: Any = "cpu",
) -> Any:
    qsl = torch.tensor([0, *np.cumsum(query_lens).tolist()], dtype=torch.int32).to(device)
    return SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(req_ids), req_ids=list(req_ids)),
        query_start_loc=SimpleNamespace(gpu=qsl),
        positions=positions,
        requests={r: SimpleNamespace(num_prompt_tokens=p) for r, p in prompt_lens.items()},
    )


class _OneDevice(TorchFunctionMode):
    """Stands in for a GPU's device check on a machine without one: the "GPU" is the
    ``meta`` device, and any op that mixes it with a host tensor (other than a 0-d scalar,
    or a copy between the two) raises, as CUDA does."""

    TRANSFERS = frozenset({"to", "cpu", "copy_", "cuda", "numpy", "tolist", "item"})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
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
        capture = RequestCapture([3, 5], D, 4, 32, gpu)
        runner = _runner(["a", "b"], [5, 1], torch.arange(16, device=gpu), {"a": 5, "b": 9}, gpu)
        step_from_runner(capture, taps, runner, torch.zeros(2, V, device=gpu))
        assert capture.sum_.device == gpu and capture.entropy_.device == gpu
        with pytest.raises(RuntimeError, match="one device"):
            taps[0].index_select(0, torch.tensor([0]))  # what the old engine's hook did


def _drive(
    capture: RequestCapture,
    steps: list[list[tuple[str, int, int]]],
    states: dict[str, np.ndarray],
    logits: dict[tuple[str, int], np.ndarray],
    prompt_lens: dict[str, int],
) -> None:
    """Each step: ``(request, first position, rows)`` in batch order; the tap holds each
    request's rows ``states[req][pos]`` at their flattened places."""
    for step in steps:
        flat, pos, reqs, qlens, sampled = [], [], [], [], []
        for req, first, n in step:
            for p in range(first, first + n):
                flat.append(states[req][p])
                pos.append(p)
            reqs.append(req)
            qlens.append(n)
            sampled.append(logits[(req, first + n - 1)])
        tap = torch.tensor(np.stack(flat), dtype=torch.float32)  # [T, K, D]
        taps = [tap[:, k].contiguous() for k in range(K)]
        runner = _runner(reqs, qlens, torch.tensor(pos), prompt_lens)
        step_from_runner(capture, taps, runner, torch.tensor(np.stack(sampled)))


def test_read_out_is_the_answer_rows_summary_through_chunked_prefill_and_batching() -> None:
    rng = np.random.default_rng(0)
    prompt = {"a": 6, "b": 3}
    n_tokens = {"a": 4, "b": 5}
    states = {
        r: rng.normal(size=(prompt[r] + n_tokens[r], K, D)).astype(np.float32) for r in prompt
    }
    logits = {(r, p): rng.normal(size=V).astype(np.float32) for r in prompt for p in range(20)}
    capture = RequestCapture([3, 5], D, 4, 32, "cpu")
    steps = [
        [("a", 0, 4)],  # a's prompt in two chunks: the first chunk's last row does not count
        [("b", 0, 3), ("a", 4, 2)],
        [("a", 6, 1), ("b", 3, 1)],
        [("b", 4, 1), ("a", 7, 1)],  # the batch order changes between steps
        [("a", 8, 1), ("b", 5, 1)],
        [("b", 6, 1)],
    ]
    _drive(capture, steps, states, logits, prompt)
    for req in ("a", "b"):
        assert capture.sampled(req, n_tokens[req]) == n_tokens[req]
    out = capture.read_out(["a", "b"])
    for req in ("a", "b"):
        p, n = prompt[req], n_tokens[req]
        entropy, hidden, _ = decode_capture({PAYLOAD_KEY: out[req]}, n)
        want = hidden_summary(states[req][p - 1 : p + n - 1], [3, 5])
        assert want is not None and hidden is not None
        np.testing.assert_allclose(hidden["last"], want["last"], rtol=0, atol=0)
        np.testing.assert_allclose(hidden["mean"], want["mean"], rtol=1e-6, atol=1e-7)
        ref = token_entropy(
            torch.tensor(np.stack([logits[(req, q)] for q in range(p - 1, p + n - 1)]))
        )
        np.testing.assert_allclose(entropy, ref.numpy(), rtol=1e-6)
    assert capture.slots == {} and len(capture._free) == 4


def test_a_step_after_the_last_token_is_taken_back_and_preemption_resumes() -> None:
    rng = np.random.default_rng(1)
    states = {"a": rng.normal(size=(12, K, D)).astype(np.float32)}
    logits = {("a", p): rng.normal(size=V).astype(np.float32) for p in range(12)}
    capture = RequestCapture([0, 1], D, 2, 32, "cpu")
    steps = [
        [("a", 0, 4)],  # prompt of 4: row 3 predicts token 1
        [("a", 4, 1)],
        [("a", 0, 6)],  # preempted, recomputed over prompt + 2 tokens: row 5 predicts token 3
        [("a", 6, 1)],  # predicts token 4, the last
        [("a", 7, 1)],  # async scheduling ran one more step before the stop was seen
    ]
    _drive(capture, steps, states, logits, {"a": 4})
    capture.sampled("a", 4)
    out = capture.read_out(["a"])["a"]
    _, hidden, _ = decode_capture({PAYLOAD_KEY: out}, 4)
    want = hidden_summary(states["a"][3:7], [0, 1])
    assert hidden is not None and want is not None
    np.testing.assert_allclose(hidden["mean"], want["mean"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(hidden["last"], want["last"], rtol=0, atol=0)


def test_rows_missing_or_capacity_exceeded_give_an_error_not_a_summary() -> None:
    rng = np.random.default_rng(2)
    states = {r: rng.normal(size=(8, K, D)).astype(np.float32) for r in "ab"}
    logits = {(r, p): rng.normal(size=V).astype(np.float32) for r in "ab" for p in range(8)}
    capture = RequestCapture([0, 1], D, 1, 32, "cpu")
    _drive(capture, [[("a", 0, 3), ("b", 0, 3)], [("a", 3, 1)]], states, logits, {"a": 3, "b": 3})
    capture.sampled("a", 3)  # three tokens sampled, two rows seen
    out = capture.read_out(["a", "b"])
    assert "2 rows for 3 generated tokens" in out["a"]["error"]
    assert "no capture" in out["b"]["error"]  # one slot: b was never held
    with pytest.raises(BackendError, match="could not capture"):
        decode_capture({PAYLOAD_KEY: out["a"]}, 3)


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
    # issue 57: installing again (a second connector, a reload) taps once, into the same buffer
    hooks = len(model.layers[1]._forward_hooks)
    again = install_tap(model.layers, [1], 16, D, torch.float32, torch.device("cpu"))
    assert again[0] is taps[0] and len(model.layers[1]._forward_hooks) == hooks == 1


def test_the_stop_rule_is_vllms() -> None:
    params = SimpleNamespace(eos_token_id=2, stop_token_ids=[7], max_tokens=5)
    assert finishes(params, 2, 1, 10, 100)
    assert finishes(params, 7, 1, 10, 100)
    assert finishes(params, 9, 5, 10, 100)
    assert finishes(params, 9, 2, 98, 100)
    assert not finishes(params, 9, 2, 10, 100)
    assert not finishes(None, 2, 1, 10, 100)


def test_the_payload_round_trips_and_names_what_is_wrong() -> None:
    rng = np.random.default_rng(3)
    last, mean = rng.normal(size=(2, D)), rng.normal(size=(2, D))
    payload = encode_capture([4, 6], last, mean, [0.5, 0.25], 2)
    entropy, hidden, engine = decode_capture({PAYLOAD_KEY: {**payload, "engine": {"x": 1}}}, 2)
    assert entropy == [0.5, 0.25] and engine == {"x": 1} and hidden is not None
    np.testing.assert_array_equal(hidden["last"], last.astype(np.float32))
    with pytest.raises(BackendError, match="covers 2 tokens but the response has 3"):
        decode_capture({PAYLOAD_KEY: payload}, 3)
    with pytest.raises(BackendError, match="AbstainGuardConnector"):
        decode_capture(None, 2)
    flag = connector_flag([4])
    assert flag[0] == "--kv-transfer-config" and '"layers": [4]' in flag[1]
