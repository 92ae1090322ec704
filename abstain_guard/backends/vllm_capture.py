"""What the probe and likelihood scorers read, taken inside stock vLLM's worker.

Runs in vLLM's worker processes (the connector of :mod:`.vllm_connector` installs it; no
vLLM import here, so the tests drive it with vLLM's call orders and no engine). Three parts,
split where vLLM's fast path and its threads split:

- **The tap** (:func:`install_tap`), *inside* the compiled graph: a forward hook on each probe
  layer copies the layer's residual stream ``e^l = hidden_states + residual`` of every row of
  the step into a static buffer ``[T, D]`` per layer (a module buffer: torch.compile traces the
  copy into the graph and a CUDA graph replays it at the same address).
- **The step copy** (:class:`StepCopier`), on the engine thread beside the sampler, for the
  requests that asked for a capture only: their rows that predicted a token (the last row
  of each, ``query_start_loc[1:] − 1``), their positions and their full-vocabulary entropies
  (in row chunks: :func:`token_entropy`) are gathered on the device and copied to
  persistent pinned host buffers on a copy stream, with an event. Nothing on this thread
  waits for the device, and no pageable host memory is copied.
- **The host sums** (:class:`HostCapture`), where vLLM reads the step's output (the worker's
  output thread under async scheduling, the engine thread otherwise): after the step's event,
  the rows are added into per-request float64 sums, the sampled tokens appended, and vLLM's
  own stop rule decides which requests finished; their payloads go into the step's
  ``KVConnectorWorkerMetadata``. Each step's rows are copied out at that step, so the next
  step (already queued under async scheduling, on another CUDA stream under TP > 1) writes
  nothing a read-out reads; the bookkeeping shared by the two threads is under one lock.

A row counts when its position is the one its request expects next (``P − 1`` first, then
``P, P + 1, …``): rows of unfinished prefill chunks are skipped, a request recomputed after
preemption resumes where it stopped, and the step scheduled after the last token (async
scheduling) finds its request finished. A hook that raises fails the captures of the
requests it was serving (their responses carry the error, the guard abstains), never the
engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .vllm_payload import encode_capture, tokens_digest

log = logging.getLogger(__name__)

#: Logit rows whose entropy is computed at once (two ``[rows, V]`` float32 temporaries).
ENTROPY_CHUNK_ROWS = 32


def token_entropy(
    logits: torch.Tensor, rows: torch.Tensor | None = None, chunk_rows: int = ENTROPY_CHUNK_ROWS
) -> torch.Tensor:
    """Full-vocabulary entropy (nats) of each row of ``logits`` (``rows``: of those rows
    only, gathered a chunk at a time): ``[R, V] -> [R]`` float32 on the logits' device,
    ``−Σ p·log p`` with ``log p = x − logsumexp(x)`` computed in place, ``chunk_rows`` rows
    at a time (at most two ``[chunk_rows, V]`` float32 temporaries, never ``[R, V]``;
    ``−inf`` logits, masked tokens, add nothing)."""
    count = int(logits.shape[0] if rows is None else rows.shape[0])
    out = torch.empty(count, dtype=torch.float32, device=logits.device)
    lowest = torch.finfo(torch.float32).min
    for start in range(0, count, chunk_rows):
        end = start + chunk_rows
        part = logits[start:end] if rows is None else logits.index_select(0, rows[start:end])
        logp = part.to(torch.float32, copy=rows is None).clamp_(min=lowest)
        logp.sub_(torch.logsumexp(logp, dim=-1, keepdim=True))
        out[start:end] = -logp.exp().mul_(logp).sum(-1)
    return out


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


# ---- the step copy: engine thread, no wait on the device ---------------------------------


@dataclass
class HostRows:
    """One step's rows of the requests that asked, on the host once :meth:`wait` returns:
    ``rows [R, K, D]`` float32, ``entropy [R]``, ``positions [R]`` (views of pinned buffers,
    valid until the ring comes round again) for ``req_ids`` in that order."""

    req_ids: list[str]
    rows: np.ndarray
    entropy: np.ndarray
    positions: np.ndarray
    event: Any = None
    keep: tuple[torch.Tensor, ...] = ()

    def wait(self) -> None:
        """Block until the step's copies reached the host (the output thread's wait)."""
        if self.event is not None:
            self.event.synchronize()
        self.keep = ()


def _pinned(*shape: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, pin_memory=pin)


class StepCopier:
    """Persistent pinned host buffers for a ring of steps, and the copies into them.

    Args:
        layers: ``K`` tapped layers; ``hidden_size``: ``D``.
        max_rows: most requests in one step (vLLM's ``max_num_seqs``).
        device: the taps' device (``cuda``: a copy stream and events; the CPU copies in place).
        ring: steps whose rows may wait for their read-out at once (vLLM's concurrent
            batches plus one: a step is read before the step two later is scheduled).
        copy_stream: copy on a CUDA copy stream with events (default: on a CUDA device).

    A step's row indices reach the device from a pinned tensor of PyTorch's caching host
    allocator, which reuses that memory only once the copy's event completed: the engine
    thread never waits for an earlier step.
    """

    def __init__(
        self,
        layers: int,
        hidden_size: int,
        max_rows: int,
        device: torch.device,
        ring: int,
        copy_stream: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda" if copy_stream is None else bool(copy_stream)
        pin = cuda and torch.cuda.is_available()
        self.pinned = pin
        self.ring = int(ring)
        self.rows = _pinned(ring, max_rows, layers, hidden_size, dtype=torch.float32, pin=pin)
        self.entropy = _pinned(ring, max_rows, dtype=torch.float32, pin=pin)
        self.positions = _pinned(ring, max_rows, dtype=torch.int64, pin=pin)
        self.index_dev = torch.zeros(2, max_rows, dtype=torch.int64, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(ring)]
        self.step = 0

    def copy(
        self,
        taps: Sequence[torch.Tensor],
        logits: torch.Tensor,
        positions: torch.Tensor,
        token_rows: Sequence[int],
        batch_rows: Sequence[int],
        req_ids: list[str],
        entropy_rows: int | None = None,
    ) -> HostRows:
        """Gather rows ``token_rows`` of each tap and of ``positions``, the entropies of logit
        rows ``batch_rows`` (of the first ``entropy_rows`` only, default all; the others' are
        NaN), and start their copy to the host (returns without waiting)."""
        slot, n = self.step % self.ring, len(token_rows)
        k = n if entropy_rows is None else int(entropy_rows)
        self.step += 1
        staged = torch.empty(2, n, dtype=torch.int64, pin_memory=self.pinned)
        staged.numpy()[:] = (token_rows, batch_rows)
        index = self.index_dev[:, :n]
        index.copy_(staged, non_blocking=True)
        copied = self.copied[slot]
        rows = torch.stack([tap.index_select(0, index[0]) for tap in taps], dim=1).float()
        entropy = token_entropy(logits, index[1, :k])
        if k < n:
            entropy = torch.cat([entropy, entropy.new_full((n - k,), float("nan"))])
        pos = positions.index_select(0, index[0].to(positions.device)).to(torch.int64)
        host = (self.rows[slot, :n], self.entropy[slot, :n], self.positions[slot, :n])
        views = [t.numpy() for t in host]
        if self.stream is None or copied is None:
            for dst, src in zip(host, (rows, entropy, pos), strict=True):
                dst.copy_(src)
            return HostRows(req_ids, views[0], views[1], views[2])
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in zip(host, (rows, entropy, pos), strict=True):
                dst.copy_(src, non_blocking=True)
            copied.record(self.stream)
        keep = (rows, entropy, pos)
        return HostRows(req_ids, views[0], views[1], views[2], event=copied, keep=keep)


# ---- the host sums: wherever vLLM reads the step's output --------------------------------


@dataclass
class _Held:
    """One request's running capture on the host."""

    prompt_len: int
    prompt_ids: list[int] | None
    params: Any
    sum: np.ndarray
    last: np.ndarray
    with_entropy: bool = True
    count: int = 0
    entropy: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None


#: ``stop(params, prompt_len, output_ids) -> bool``: vLLM's stop rule on a request's state.
StopRule = Callable[[Any, int, list[int]], bool]


class HostCapture:
    """Per-request sums of the requests that asked for a capture (one per model runner).

    Args:
        layers: the tapped decoder layers (``K``); ``hidden_size``: ``D``.
        max_entropy_tokens: answer positions whose entropy is kept (longer: ``entropy: None``).
        stop: vLLM's stop rule (:func:`~.vllm_support.stop_view` + ``check_stop``).

    Called from two threads: :meth:`want`, :meth:`admit` and :meth:`release` on the engine
    thread, :meth:`add` / :meth:`sampled` where vLLM reads step outputs; one lock. A request
    that asked for no entropy gets none computed (its payload's ``entropy`` is None).
    """

    def __init__(
        self, layers: Sequence[int], hidden_size: int, max_entropy_tokens: int, stop: StopRule
    ) -> None:
        self.layers = [int(x) for x in layers]
        self.shape = (len(self.layers), int(hidden_size))
        self.max_entropy_tokens = int(max_entropy_tokens)
        self.stop = stop
        self.lock = threading.Lock()
        self.wanted: dict[str, bool] = {}
        self.held: dict[str, _Held] = {}

    def want(self, wanted: Mapping[str, bool]) -> None:
        """Requests that asked for a capture (the scheduler's metadata of this step), each
        with whether it asked for its entropies."""
        with self.lock:
            self.wanted.update(wanted)

    def admit(
        self, req: str, prompt_ids: Sequence[int] | None, prompt_len: int, params: Any
    ) -> bool | None:
        """Start holding ``req`` if it asked (engine thread, at its first step); None: it is
        not held, else whether it asked for its entropies."""
        with self.lock:
            if req in self.held:
                return self.held[req].with_entropy
            if req not in self.wanted:
                return None
            ids = None if prompt_ids is None else [int(t) for t in prompt_ids]
            self.held[req] = _Held(
                int(prompt_len),
                ids,
                params,
                np.zeros(self.shape),
                np.zeros(self.shape, np.float32),
                with_entropy=self.wanted[req],
            )
            return self.wanted[req]

    def release(self, reqs: Sequence[str]) -> None:
        """Forget requests the scheduler finished or aborted."""
        with self.lock:
            for req in reqs:
                self.wanted.pop(req, None)
                self.held.pop(req, None)

    def fail(self, reqs: Sequence[str], reason: str) -> None:
        """The capture of ``reqs`` failed (their payloads carry ``reason``)."""
        with self.lock:
            for req in reqs:
                held = self.held.get(req)
                if held is not None and held.error is None:
                    held.error = reason

    def add(self, step: HostRows) -> None:
        """One step's rows, once on the host."""
        step.wait()
        with self.lock:
            for j, req in enumerate(step.req_ids):
                held = self.held.get(req)
                if held is None or int(step.positions[j]) != held.prompt_len - 1 + held.count:
                    continue  # finished, a prefill chunk's row, or recomputed after preemption
                held.sum += step.rows[j]
                held.last = step.rows[j].copy()
                held.count += 1
                if held.with_entropy and held.count <= self.max_entropy_tokens:
                    held.entropy.append(float(step.entropy[j]))

    def sampled(self, tokens: dict[str, int]) -> dict[str, dict[str, Any]]:
        """Tokens sampled this step (request -> token); the payloads of the requests they
        finished (vLLM's stop rule), whose state is then dropped."""
        out: dict[str, dict[str, Any]] = {}
        with self.lock:
            for req, token in tokens.items():
                held = self.held.get(req)
                if held is None:
                    continue
                held.tokens.append(int(token))
                try:
                    done = self.stop(held.params, held.prompt_len, held.tokens)
                except Exception as exc:  # a stop rule that cannot read this request
                    held.error = held.error or f"the stop rule failed: {exc!r}"
                    done = False
                if done:
                    out[req] = self._payload(held)
                    del self.held[req]
                    self.wanted.pop(req, None)
        return out

    def _payload(self, held: _Held) -> dict[str, Any]:
        n = len(held.tokens)
        if held.error is not None:
            return {"error": f"the capture failed on the server: {held.error}"}
        if held.count != n or n == 0:
            return {
                "error": f"the capture holds {held.count} rows for {n} generated tokens; the "
                "engine ran a path the tap does not see"
            }
        mean = held.sum / float(n)
        entropy = held.entropy if held.with_entropy and n <= self.max_entropy_tokens else None
        digest = tokens_digest(held.prompt_ids, held.tokens)
        return encode_capture(self.layers, held.last, mean, entropy, digest, n)

    @property
    def size(self) -> int:
        """Requests held now."""
        with self.lock:
            return len(self.held)


# ---- one model runner's capture: the glue vLLM's runner methods call ----------------------


class RunnerCapture:
    """What one model runner holds: the tap's buffers, the step copier and the host sums.

    Called by the connector's wrappers of vLLM's runner methods, in vLLM's order:
    :meth:`begin_step` and :meth:`on_logits` inside ``execute_model`` and :meth:`take_step`
    in ``sample_tokens`` (engine thread); :meth:`on_output` where the step's output is read
    (under async scheduling: after the next step was queued, on the worker's output thread
    under TP > 1). ``runner`` is read as vLLM's V1 ``GPUModelRunner`` lays it out
    (``input_batch.req_ids``, ``query_start_loc.np``, ``positions``, ``requests``).
    """

    def __init__(
        self,
        runner: Any,
        taps: Sequence[torch.Tensor],
        host: HostCapture,
        ring: int,
    ) -> None:
        self.runner = runner
        self.taps = list(taps)
        self.host = host
        self.copier = StepCopier(
            len(host.layers), host.shape[1], int(runner.max_num_reqs), taps[0].device, ring
        )
        self.pending: HostRows | None = None
        self.profiling = False

    def begin_step(self, scheduler_output: Any) -> None:
        """A step starts: forget the requests the scheduler finished or aborted."""
        self.pending = None
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished:
            self.host.release(list(finished))

    def on_logits(self, logits: torch.Tensor) -> None:
        """Beside the sampler: copy this step's rows of the requests that asked."""
        if self.profiling:  # vLLM's profiling run: the copy's peak memory, at most rows
            n = min(int(logits.shape[0]), self.copier.rows.shape[1])
            self.copier.copy(
                self.taps, logits, self.runner.positions, list(range(n)), list(range(n)), [""] * n
            ).wait()
            return
        runner, reqs = self.runner, []
        try:
            num = int(runner.input_batch.num_reqs)
            if num == 0 or int(logits.shape[0]) != num:  # prompt logprobs, or a dummy run
                return
            qsl = runner.query_start_loc.np
            rows: tuple[list[tuple[int, int, str]], ...] = ([], [])  # with entropy, without
            for b, req in enumerate(runner.input_batch.req_ids[:num]):
                state = runner.requests.get(req)
                if state is None:
                    continue
                held = self.host.admit(
                    req, state.prompt_token_ids, state.num_prompt_tokens, state.sampling_params
                )
                if held is not None:
                    rows[0 if held else 1].append((int(qsl[b + 1]) - 1, b, req))
                    reqs.append(req)
            if reqs:
                ordered = zip(*rows[0], *rows[1], strict=True)
                token_rows, batch_rows, reqs = (list(x) for x in ordered)
                self.pending = self.copier.copy(
                    self.taps, logits, runner.positions, token_rows, batch_rows, reqs, len(rows[0])
                )
        except Exception as exc:
            log.exception("abstain_guard: the step copy failed; its requests get no capture")
            self.host.fail(reqs, f"the step copy raised {exc!r}")

    def take_step(self) -> HostRows | None:
        """This step's rows (``sample_tokens``, engine thread), for its output's read-out."""
        step, self.pending = self.pending, None
        return step

    def on_output(self, step: HostRows | None, output: Any) -> dict[str, dict[str, Any]]:
        """The step's rows added and its sampled tokens read (``output``: vLLM's
        ``ModelRunnerOutput``, token ids on the host); the payloads of the requests it
        finished."""
        try:
            if step is not None:
                self.host.add(step)
            index = getattr(output, "req_id_to_index", None) or {}
            sampled = getattr(output, "sampled_token_ids", None) or []
            with self.host.lock:
                held = [r for r in self.host.held if r in index]
            tokens = {}
            for req in held:
                ids = sampled[index[req]] if index[req] < len(sampled) else []
                if len(ids):
                    tokens[req] = int(ids[-1])
            return self.host.sampled(tokens)
        except Exception as exc:
            log.exception("abstain_guard: reading a step's capture failed")
            self.host.fail(step.req_ids if step is not None else [], f"the read-out raised {exc!r}")
            return {}
