"""What the probe and likelihood scorers read, accumulated on the device inside stock vLLM.

Runs in vLLM's worker processes (the connector of :mod:`.vllm_connector` installs it). Two
parts, split where vLLM's fast path splits:

- **The tap** (:func:`install_tap`), *inside* the compiled graph: a forward hook on each probe
  layer copies the layer's residual stream ``e^l = hidden_states + residual`` (vLLM's decoder
  layers return the two apart) of every row of the step into a static buffer ``[T, D]`` per layer
  (a module buffer, so torch.compile traces the copy into the graph and a CUDA graph
  replays it at the same address). Registered before vLLM compiles the model.
- **The accumulator** (:class:`RequestCapture`), eager, once per step beside the sampler:
  the rows that predict a token (the last row of each request, ``query_start_loc[1:] − 1``)
  are added into per-request running sums on the device, with the last row, the row before
  it, the count and the full-vocabulary entropy at each answer position. Nothing is copied
  to the host until a request finishes; then its summary is copied once.

A row counts when its position is the one the request expects next (``P − 1`` first, then
``P, P + 1, …``): rows of unfinished prefill chunks are skipped, a request recomputed after
preemption resumes where it stopped, and one extra step scheduled after the last token
(async scheduling) is taken back at read-out (the count says so).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from .vllm_payload import encode_capture

__all__ = [
    "CaptureIncomplete",
    "RequestCapture",
    "finishes",
    "install_tap",
    "step_from_runner",
    "tapped_rows",
    "token_entropy",
]


class CaptureIncomplete(RuntimeError):
    """A finished request's capture lacks rows (evicted, or the engine ran a path the tap
    does not see); its response carries an error instead of a summary."""


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary entropy (nats) of each row: ``[R, V] -> [R]`` float32, on the logits'
    device."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).nan_to_num(0.0).sum(-1)


def install_tap(
    decoder_layers: Sequence[torch.nn.Module],
    layers: Sequence[int],
    rows: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Hook ``decoder_layers[l]`` for each ``l`` in ``layers`` to copy its residual stream
    into a static buffer of its own; returns the buffers, ``[rows, D]`` each, on ``device``
    (one tensor per layer: buffers that alias one storage would be graph inputs that alias).

    Must run before the model is first called: torch.compile traces the hooks into the graph
    (a hook added later would not run in the compiled graph). Installing again on a layer
    already tapped returns its buffer and adds no second hook.
    """
    taps = []
    for layer in layers:
        module = decoder_layers[layer]
        existing = getattr(module, "_abstain_guard_tap", None)
        if isinstance(existing, torch.Tensor) and existing.shape == (rows, hidden_size):
            taps.append(existing)
            continue
        tap = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        module.register_buffer("_abstain_guard_tap", tap, persistent=False)

        def on_output(mod: torch.nn.Module, args: Any, output: Any) -> None:
            hs, residual = output if isinstance(output, tuple) else (output, None)
            stream = hs if residual is None else hs + residual
            buffer = mod.get_buffer("_abstain_guard_tap")
            buffer[: stream.shape[0]].copy_(stream)

        module.register_forward_hook(on_output)
        taps.append(tap)
    return taps


def tapped_rows(taps: Sequence[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """The rows ``index`` of each tap: ``[K, R, D]`` (on the taps' device)."""
    return torch.stack([tap.index_select(0, index) for tap in taps])


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def step_from_runner(
    capture: RequestCapture, taps: Sequence[torch.Tensor], runner: Any, logits: torch.Tensor
) -> None:
    """One step of vLLM's model runner into ``capture``: its requests in batch order
    (``input_batch.req_ids``), the rows that predicted the sampled tokens
    (``query_start_loc[1:] − 1``, where ``logits`` were computed) and their positions. Every
    index is built on the taps' device (a GPU's rows are never indexed from the host)."""
    num = int(runner.input_batch.num_reqs)
    if num == 0 or logits.shape[0] != num:  # a dummy or profiling run, or prompt logprobs
        return
    device = taps[0].device
    index = _on(runner.query_start_loc.gpu[1 : num + 1], device).long() - 1
    req_ids = list(runner.input_batch.req_ids[:num])
    prompt = [int(runner.requests[r].num_prompt_tokens) for r in req_ids]
    positions = runner.positions.index_select(0, _on(index, runner.positions.device))
    capture.step(
        tapped_rows(taps, index),
        _on(positions, device),
        logits,
        req_ids,
        prompt,
        alive=runner.requests.keys(),
    )


def finishes(params: Any, token: int, generated: int, prompt_len: int, max_model_len: int) -> bool:
    """vLLM's stop rule (``vllm.v1.core.sched.utils.check_stop``), replayed on the worker
    when the token is sampled: EOS, a stop token id, max_tokens or the context length.
    (Stop *strings* are matched by the frontend after the engine has moved on; a response
    cut by one carries no capture, and the client says so.)"""
    if params is None:
        return False
    if token == getattr(params, "eos_token_id", None):
        return True
    if token in (getattr(params, "stop_token_ids", None) or ()):
        return True
    max_tokens = getattr(params, "max_tokens", None)
    return (max_tokens is not None and generated >= int(max_tokens)) or (
        prompt_len + generated >= max_model_len
    )


class RequestCapture:
    """Per-request running sums of the tapped rows, on the tap's device.

    Args:
        layers: the tapped decoder layers (``K``).
        hidden_size: ``D``.
        max_requests: requests held at once (vLLM's ``max_num_seqs``; more are refused).
        max_entropy_tokens: answer positions whose entropy is kept per request (longer
            answers get ``entropy: None``).
        device: where the sums live (the model's device).

    State (trailing underscore: device tensors): ``sum_`` ``[S, K, D]`` float64, ``last_``,
    ``prev_`` ``[S, K, D]`` float32, ``count_``, ``next_``, ``start_`` ``[S]`` int64,
    ``entropy_`` ``[S, E + 1]`` (column ``E`` takes rows that do not count).
    """

    def __init__(
        self,
        layers: Sequence[int],
        hidden_size: int,
        max_requests: int,
        max_entropy_tokens: int,
        device: torch.device | str,
    ) -> None:
        self.layers = [int(x) for x in layers]
        self.device = torch.device(device)
        s, k, d, e = int(max_requests), len(self.layers), int(hidden_size), int(max_entropy_tokens)
        f32, i64 = torch.float32, torch.int64
        # float64 sums: the mean as hidden_summary computes it from float32 rows
        self.sum_ = torch.zeros(s, k, d, dtype=torch.float64, device=self.device)
        self.last_ = torch.zeros(s, k, d, dtype=f32, device=self.device)
        self.prev_ = torch.zeros(s, k, d, dtype=f32, device=self.device)
        self.count_ = torch.zeros(s, dtype=i64, device=self.device)
        self.next_ = torch.zeros(s, dtype=i64, device=self.device)
        self.start_ = torch.zeros(s, dtype=i64, device=self.device)
        self.entropy_ = torch.zeros(s, e + 1, dtype=f32, device=self.device)
        self.max_entropy_tokens = e
        self.slots: dict[str, int] = {}
        self.prompt_len: dict[str, int] = {}
        self.generated: dict[str, int] = {}
        self._free = list(range(s - 1, -1, -1))

    # ---- per step (eager, no host copy) ------------------------------------------------

    def _slot_of(self, req: str, prompt_len: int, alive: Iterable[str] | None) -> int | None:
        slot = self.slots.get(req)
        if slot is not None:
            return slot
        if not self._free and alive is not None:  # drop requests the engine no longer holds
            keep = set(alive)
            for gone in [r for r in self.slots if r not in keep]:
                self.release(gone)
        if not self._free:
            return None
        slot = self._free.pop()
        self.slots[req] = slot
        self.prompt_len[req] = int(prompt_len)
        self.generated[req] = 0
        return slot

    def step(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        logits: torch.Tensor,
        req_ids: Sequence[str],
        prompt_lens: Sequence[int],
        alive: Iterable[str] | None = None,
    ) -> None:
        """Add one step: ``rows [K, R, D]`` (the tapped rows at the sampled positions),
        ``positions [R]`` and ``logits [R, V]`` on the device, ``req_ids`` / ``prompt_lens``
        (host) of the ``R`` requests in batch order."""
        if not req_ids:
            return
        slots, new, starts = [], [], []
        for req, p in zip(req_ids, prompt_lens, strict=True):
            known = req in self.slots
            slot = self._slot_of(req, p, alive)
            slots.append(-1 if slot is None else slot)
            if slot is not None and not known:
                new.append(slot)
                starts.append(int(p) - 1)
        if new:
            new_t = torch.tensor(new, dtype=torch.int64).to(self.device, non_blocking=True)
            start_t = torch.tensor(starts, dtype=torch.int64).to(self.device, non_blocking=True)
            for buf in (self.sum_, self.last_, self.prev_, self.entropy_):
                buf.index_fill_(0, new_t, 0.0)
            self.count_.index_fill_(0, new_t, 0)
            self.start_.index_copy_(0, new_t, start_t)
            self.next_.index_copy_(0, new_t, start_t)
        held = [i for i, s in enumerate(slots) if s >= 0]
        if not held:
            return
        slot_t = torch.tensor([slots[i] for i in held], dtype=torch.int64)
        slot_t = slot_t.to(self.device, non_blocking=True)
        if len(held) != len(slots):
            pick = torch.tensor(held, dtype=torch.int64).to(self.device, non_blocking=True)
            rows, positions, logits = rows[:, pick], positions[pick], logits[pick]
        pos = positions.to(torch.int64)
        include = pos == self.next_[slot_t]  # [R]
        r = rows.transpose(0, 1).float()  # [R, K, D]
        inc3 = include[:, None, None]
        old_last = self.last_[slot_t]
        self.prev_[slot_t] = torch.where(inc3, old_last, self.prev_[slot_t])
        self.last_[slot_t] = torch.where(inc3, r, old_last)
        self.sum_.index_add_(0, slot_t, (r * inc3.to(r.dtype)).double())
        col = (pos - self.start_[slot_t]).clamp(0, self.max_entropy_tokens)
        col = torch.where(include, col, torch.full_like(col, self.max_entropy_tokens))
        self.entropy_[slot_t, col] = token_entropy(logits)
        step_inc = include.to(torch.int64)
        self.count_.index_add_(0, slot_t, step_inc)
        self.next_.index_add_(0, slot_t, step_inc)

    def sampled(self, req: str, num_tokens: int) -> int:
        """Record ``num_tokens`` tokens sampled for ``req``; returns its total."""
        if req in self.generated:
            self.generated[req] += int(num_tokens)
            return self.generated[req]
        return 0

    # ---- when requests finish (one host copy for all of them) --------------------------

    def release(self, req: str) -> None:
        slot = self.slots.pop(req, None)
        self.prompt_len.pop(req, None)
        self.generated.pop(req, None)
        if slot is not None:
            self._free.append(slot)

    def read_out(self, reqs: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The summaries of finished requests ``reqs`` (their slots freed): per request the
        payload of :func:`~.vllm_payload.encode_capture`, or ``{"error": ...}``."""
        held = [r for r in reqs if r in self.slots]
        out: dict[str, dict[str, Any]] = {
            r: {"error": "the engine held no capture for this request (evicted or unknown)"}
            for r in reqs
            if r not in self.slots
        }
        if not held:
            return out
        idx = torch.tensor([self.slots[r] for r in held], dtype=torch.int64).to(self.device)
        host = [
            t.index_select(0, idx).cpu().numpy()
            for t in (self.sum_, self.last_, self.prev_, self.count_, self.entropy_)
        ]
        sums, lasts, prevs, counts, ents = host
        for j, req in enumerate(held):
            n = self.generated.get(req, 0)
            count = int(counts[j])
            try:
                out[req] = _summary(
                    sums[j],
                    lasts[j],
                    prevs[j],
                    count,
                    ents[j],
                    n,
                    self.max_entropy_tokens,
                    self.layers,
                )
            except CaptureIncomplete as exc:
                out[req] = {"error": str(exc)}
            self.release(req)
        return out


def _summary(
    total: np.ndarray,
    last: np.ndarray,
    prev: np.ndarray,
    count: int,
    entropy: np.ndarray,
    n: int,
    max_entropy: int,
    layers: Sequence[int],
) -> dict[str, Any]:
    """One request's payload from its host copies (``[K, D]`` rows, ``n`` tokens)."""
    if count == n + 1 and n > 0:  # one step ran after the last token: take it back
        total, last, count = total - last, prev, n
    if count != n or n == 0:
        raise CaptureIncomplete(
            f"the capture holds {count} rows for {n} generated tokens; the engine ran a "
            "path the tap does not see (speculative decoding, or a preempted request dropped)"
        )
    mean = total / float(n)
    ent = [float(x) for x in entropy[:n]] if n <= max_entropy else None
    return encode_capture(layers, last, mean, ent, n)
