"""The decode path: which BLAS thread counts and batch shapes the engine runs, set by the
library itself (never by ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``), and recorded
(:meth:`DecodePath.record`; the guard refuses a response decoded on another path than
calibration's). Why, with the measurements: docs/architecture.md, "Concurrent callers".
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal
from weakref import WeakKeyDictionary

import torch
from torch import nn

from ..capture.parts_rule import UNRECORDED_PARTS, PartsRule

#: Fewest rows a shared decode step runs with (dummy rows fill up): the smallest row count
#: from which one-thread BLAS computes every row the same way whatever the batch size.
MIN_DECODE_ROWS = 4

#: BLAS threads inside every forward of the library: decode steps (shared or alone), prompt
#: passes and replay.
DECODE_THREADS = 1


#: Environment variable that caps the engines the scheduler runs side by side on a CPU model
#: (default: one per CPU of the process, :func:`engine_workers`).
ENGINE_WORKERS_ENV = "ABSTAIN_GUARD_ENGINE_WORKERS"


@dataclass(frozen=True)
class DecodePath:
    """How the engine decodes: ``steps`` ``"shared"`` (concurrent rows in one forward,
    padded to ``min_rows``) or ``"alone"`` (each row its own forward, ``min_rows`` 1), with
    ``threads`` BLAS threads inside each step."""

    steps: Literal["shared", "alone"]
    threads: int
    min_rows: int
    #: the prefix path's split rule (:data:`.prefix.PREFIX_RULE`), or None: the prompt in
    #: one pass
    prefix: str | None = None
    #: most rows one shared step holds (more concurrent rows take several steps): the largest
    #: count up to which the probe found rows independent on this CPU. Not recorded: every
    #: count from ``min_rows`` to ``max_rows`` gives each row the same bits, so it changes
    #: throughput, never a number.
    max_rows: int = 1
    #: full capture's attention-parts rule (:class:`~..capture.parts_rule.PartsRule`); None
    #: and :data:`~..capture.parts_rule.UNRECORDED_PARTS` record alike
    parts: PartsRule | None = None

    def record(self) -> dict[str, Any]:
        """The path as it appears in generation and deployment records (``prefix`` only on
        the prefix path, ``parts`` only for a rule other than :data:`UNRECORDED_PARTS`)."""
        out: dict[str, Any] = {"steps": self.steps, "threads": self.threads}
        out["min_rows"] = self.min_rows
        if self.prefix is not None:
            out["prefix"] = self.prefix
        if self.parts is not None and self.parts != UNRECORDED_PARTS:
            out["parts"] = self.parts.record()
        return out


@contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads in the calling thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def process_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def _positive_env(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}={raw!r}: give a positive number")
    return n


def engine_workers(hf: nn.Module) -> int:
    """Engines the scheduler runs side by side for ``hf``, each in its own thread with its
    own rows: on the CPU one per CPU of the process (:data:`ENGINE_WORKERS_ENV` caps it),
    each decoding on :data:`DECODE_THREADS` thread; on an accelerator one (its kernels do
    not gain from a second host thread). A row's numbers do not depend on the engine it
    runs in (decode steps are row-independent on one thread), so this is not recorded."""
    device = next(hf.parameters()).device
    if device.type != "cpu":
        return 1
    return _positive_env(ENGINE_WORKERS_ENV) or process_cpus()


def independent_rows(weight: torch.Tensor, rows: int, max_rows: int) -> int:
    """The largest ``m <= max_rows`` such that ``x @ weight.T`` gives every row bitwise the
    same result for every batch of ``rows..m`` rows, wherever the row sits (probed with
    random rows, with the calling thread's BLAS thread count); ``rows - 1`` when a batch of
    ``rows`` already fails. ``weight``: ``[out, in]``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((max_rows, weight.shape[1]), generator=gen, dtype=weight.dtype)
    with torch.inference_mode():
        ref = torch.nn.functional.linear(x[:rows], weight)
        for m in range(rows, max_rows + 1):
            out = torch.nn.functional.linear(x[:m], weight)
            if not torch.equal(out[:rows], ref):
                return m - 1
            flipped = torch.nn.functional.linear(x[:m].flip(0), weight).flip(0)
            if not torch.equal(flipped, out):
                return m - 1
    return max_rows


def model_independent_rows(hf: nn.Module, rows: int, max_rows: int) -> int:
    """:func:`independent_rows` over every distinct shape of the model's linear layers (LM
    head included; the smallest), on the model's own weights (in their dtype, on the CPU).
    ``rows - 1`` for a mixture of experts (stacked expert weights, 3-D or more): an expert's
    product holds the rows routed to it, so a row's last bits depend on the other rows of
    the step."""
    if any(p.dim() >= 3 for p in hf.parameters()):
        return rows - 1
    top = max_rows
    seen: set[tuple[int, ...]] = set()
    for m in hf.modules():
        if isinstance(m, nn.Linear) and tuple(m.weight.shape) not in seen:
            seen.add(tuple(m.weight.shape))
            top = independent_rows(m.weight.detach().cpu(), rows, top)
            if top < rows:
                break
    return top


_PATHS: WeakKeyDictionary[nn.Module, dict[tuple[bool, int], DecodePath]] = WeakKeyDictionary()


def choose_decode_path(hf: nn.Module, shared: bool, max_rows: int) -> DecodePath:
    """The path the engine takes for ``hf``: shared steps on :data:`DECODE_THREADS` threads
    padded to :data:`MIN_DECODE_ROWS` when ``shared`` is asked for and the model's weights
    show rows to be independent from there (CPU only: GPU kernels are not probed and decode
    each row alone), each step holding at most as many rows as they stay independent for
    (up to ``max_rows``: :attr:`DecodePath.max_rows`); otherwise each row alone. Probed once
    per model and setting."""
    top = max(max_rows, MIN_DECODE_ROWS)
    cached = _PATHS.setdefault(hf, {})
    key = (shared, top)
    if key not in cached:
        device = next(hf.parameters()).device
        cap = 0
        if shared and device.type == "cpu":
            with blas_threads(DECODE_THREADS):
                cap = model_independent_rows(hf, MIN_DECODE_ROWS, top)
        cached[key] = (
            DecodePath("shared", DECODE_THREADS, MIN_DECODE_ROWS, max_rows=cap)
            if cap >= MIN_DECODE_ROWS
            else DecodePath("alone", DECODE_THREADS, 1)
        )
    return cached[key]
