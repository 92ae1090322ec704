"""Step-level batching that gives every row exactly the numbers it would get alone.

:class:`BatchEngine` runs the rows (answers being generated) of a
:class:`~abstain_guard.adapters.engine.scheduler.GenerationScheduler`:

* **prefill**: each new row runs its prompt alone (batch 1, its own ``DynamicCache``, its
  own :class:`~abstain_guard.adapters.capture.session.CaptureSession`); on the prefix path
  (:mod:`.prefix`) it starts from a copy of its shared prefix's cache and capture state;
* **decode**: one forward per step for all active rows (one new token each), padded with
  dummy rows to the path's ``min_rows`` (:mod:`.threads`), each row computed on its own
  cache and hooks (:mod:`.shared_step`).

Tokens are chosen from each row's own logits (a per-row ``torch.Generator``), so batch
composition never changes a row's tokens either.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..capture.attention import attention_implementation, capture_mode
from ..capture.decode_step import DecodeStepCapture
from ..capture.features import StepFeatures
from ..capture.hook_routes import Hook
from ..capture.parts_rule import PartsRule
from ..capture.session import CaptureSession, default_parts
from ..capture.types import ReferenceMeans
from ..model.loading import LoadedModel, eos_token_ids, pad_token_id
from .prefix import PREFIX_RULE, start_from_prefix
from .shared_step import (
    ROWS_ATTENTION,
    HookMux,
    RowsCache,
    SharedStep,
    register_rows_attention,
    running,
)
from .threads import DECODE_THREADS, DecodePath, blas_threads, choose_decode_path

_LOG = logging.getLogger(__name__)


class GenerationCancelled(Exception):
    """Raised by a request's ``on_token`` callback to stop its row: the caller went away
    (e.g. a streaming consumer that stopped reading). The row finishes at once with
    ``finish_reason="cancelled"`` and frees its place in the batch."""


@dataclass
class GenerationRequest:
    """One answer to generate: prompt ids, token budget and the call's options."""

    prompt: list[int]
    max_new: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    capture: bool = True
    capture_mode: str = "full"  # "full" or "fast" (CaptureSession's ``capture``)
    reference: ReferenceMeans | None = None
    keep_states: bool = False
    #: Called with each new token id as soon as it is chosen (in the scheduler's thread; for
    #: streaming). It must be quick; raising :class:`GenerationCancelled` stops the row, any
    #: other exception is logged and ignored.
    on_token: Callable[[int], None] | None = None
    #: Called, like ``on_token`` and after it, with a :class:`RowSnapshot` of the row so far
    #: (certified streaming scores the answer so far at chunk ends); the same rules apply.
    on_snapshot: Callable[[RowSnapshot], None] | None = None
    #: the prefix path (:mod:`.prefix`): None runs the prompt in one pass; a number runs it
    #: split after that many tokens (0: not split), the prefix from the model's store
    prefix: int | None = None
    #: full capture's attention-parts rule (None: the library's default,
    #: :func:`..capture.session.default_parts`)
    parts: PartsRule | None = None


@dataclass
class RowResult:
    """What one row produced: ``token_ids`` (cut after the first EOS), the raw ``logits``
    ``[N, V]`` that predicted them, the finish reason and the capture steps (one per token)."""

    token_ids: list[int]
    logits: torch.Tensor
    finish_reason: str
    steps: list[StepFeatures]
    #: the engine's :class:`~.threads.DecodePath` as recorded (:meth:`DecodePath.record`)
    decode_path: dict[str, Any] = field(default_factory=dict)


@dataclass
class RowSnapshot:
    """A generating row as it stands after a token: shallow copies of its token ids, the
    logits ``[V]`` that predicted each and its capture steps (append-only in the row, so the
    copies never change). :meth:`result` is the :class:`RowResult` the row would have had
    if it had finished here."""

    token_ids: list[int]
    logits: list[torch.Tensor]
    steps: list[StepFeatures]
    decode_path: dict[str, Any]

    @property
    def token(self) -> int:
        """The newest token id."""
        return self.token_ids[-1]

    def result(self) -> RowResult:
        """The row's result cut here (``finish_reason="partial"``)."""
        return RowResult(
            token_ids=list(self.token_ids),
            logits=torch.stack(self.logits).float(),
            finish_reason="partial",
            steps=list(self.steps),
            decode_path=dict(self.decode_path),
        )


@dataclass
class Row:
    """An answer being generated: its cache, capture session, tokens and logits so far."""

    request: GenerationRequest
    cache: Any
    session: CaptureSession | None
    hooks: list[Hook]
    generator: torch.Generator | None
    ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish: str | None = None
    path: DecodePath | None = None

    @property
    def position(self) -> int:
        """Position of the newest token (the input of the next decode step)."""
        return len(self.request.prompt) + len(self.ids) - 1

    def snapshot(self) -> RowSnapshot:
        """The row so far (:class:`RowSnapshot`)."""
        steps = self.session.steps if self.session is not None else []
        n = len(self.ids)
        return RowSnapshot(
            token_ids=list(self.ids),
            logits=list(self.logits),
            steps=list(steps[:n]),
            decode_path=self.path.record() if self.path is not None else {},
        )

    def result(self) -> RowResult:
        """The finished row's result."""
        return replace(self.snapshot().result(), finish_reason=self.finish or "length")


# -- token choice -----------------------------------------------------------------------------


def choose_token(
    logits: torch.Tensor, request: GenerationRequest, gen: torch.Generator | None
) -> int:
    """Greedy (temperature 0) or sampled next token from one row's raw logits ``[V]``
    (temperature, top-k, top-p as transformers applies them)."""
    if request.temperature <= 0:
        return int(torch.argmax(logits))
    scores = logits.float().unsqueeze(0)
    scores = TemperatureLogitsWarper(float(request.temperature))(None, scores)  # type: ignore[arg-type]
    if request.top_k:
        scores = TopKLogitsWarper(int(request.top_k))(None, scores)  # type: ignore[arg-type]
    if request.top_p < 1.0:
        scores = TopPLogitsWarper(float(request.top_p))(None, scores)  # type: ignore[arg-type]
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen)[0, 0])


# -- the engine -------------------------------------------------------------------------------


def _step_groups(rows: list[Row], path: DecodePath) -> list[list[Row]]:
    """The forwards of one decode step: each row alone, or shared steps of at most
    ``path.max_rows`` rows (as even as possible: 9 rows with a cap of 6 are 5 and 4)."""
    if path.steps != "shared":
        return [[r] for r in rows]
    cap = max(1, path.max_rows)
    k = -(-len(rows) // cap)
    size, extra = divmod(len(rows), k)
    out, at = [], 0
    for i in range(k):
        n = size + (1 if i < extra else 0)
        out.append(rows[at : at + n])
        at += n
    return out


class BatchEngine:
    """Prefills new rows one at a time and decodes all active rows one token per step.

    Not thread-safe: one scheduler worker drives it (holding the model lock shared); other
    engines of the same model may run their forwards at the same time in other threads.
    """

    def __init__(self, loaded: LoadedModel, max_rows: int, batch_decode: bool = True) -> None:
        self.loaded = loaded
        self.max_rows = max_rows
        self.active: list[Row] = []
        self.widest = 0  # most real rows one decode step has run with (for tests, benchmarks)
        self.cancelled = 0  # rows stopped by their caller (GenerationCancelled)
        hf = loaded.hf_model
        self._eos = set(eos_token_ids(hf, loaded.tokenizer))
        self._pad = pad_token_id(hf, loaded.tokenizer)
        self._device = next(hf.parameters()).device
        self._keep_one = "logits_to_keep" in inspect.signature(hf.forward).parameters
        #: how decode steps run (:mod:`.threads`): shared steps on one BLAS thread where the
        #: model's weights make rows independent there (and ``batch_decode`` asks for it),
        #: else each row alone; recorded in every row's result
        self.path: DecodePath = choose_decode_path(hf, batch_decode, max_rows)
        register_rows_attention()

    # -- rows ------------------------------------------------------------------------------

    def start(self, request: GenerationRequest) -> Row:
        """Prefill ``request`` alone (on :data:`~.threads.DECODE_THREADS` BLAS threads, like
        every forward) and choose its first token; returns the row, finished or still active
        (it is then in :attr:`active`)."""
        hf = self.loaded.hf_model
        parts = request.parts or default_parts()
        session = (
            CaptureSession(
                self.loaded.spec,
                batch_size=1,
                max_len=len(request.prompt) + request.max_new,
                reference=request.reference,
                keep_states=request.keep_states,
                capture=request.capture_mode,
                parts=parts,
            )
            if request.capture
            else None
        )
        gen = None
        if request.seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(int(request.seed))
        path = replace(self.path, parts=parts)
        if request.prefix is not None:
            path = replace(path, prefix=PREFIX_RULE)
        kw: dict[str, Any] = {"logits_to_keep": 1} if self._keep_one else {}
        with torch.inference_mode(), blas_threads(DECODE_THREADS):
            # the prefix (from the store, or computed under its own capture) before the row's
            split = request.prefix or 0
            cache, rest = start_from_prefix(self.loaded, request.prompt, split, session)
            row = Row(request, cache, session, [], gen, path=path)
            ids = torch.tensor([rest], dtype=torch.long, device=self._device)
            with capture_mode(hf, session):
                row.hooks = list(session.hooks) if session is not None else []
                out = hf(input_ids=ids, past_key_values=row.cache, use_cache=True, **kw)
        self._append(row, out.logits[0, -1])
        if row.finish is None:
            self.active.append(row)
        return row

    def _append(self, row: Row, logits: torch.Tensor) -> None:
        """Choose the row's next token from ``logits`` and check whether the row is done."""
        logits = logits.detach().to("cpu", torch.float32, copy=True)  # not a view of the step's
        tok = choose_token(logits, row.request, row.generator)
        row.ids.append(tok)
        row.logits.append(logits)
        if row.request.on_token is not None or row.request.on_snapshot is not None:
            try:
                if row.request.on_token is not None:
                    row.request.on_token(tok)
                if row.request.on_snapshot is not None:
                    row.request.on_snapshot(row.snapshot())
            except GenerationCancelled:
                row.finish = "cancelled"
                self.cancelled += 1
                return
            except Exception:  # a streaming consumer's failure is not the generation's
                _LOG.exception("on_token callback failed; generation goes on")
        if tok in self._eos:
            row.finish = "stop"
        elif len(row.ids) >= row.request.max_new or self._hit_stop(row):
            row.finish = "length"

    def _hit_stop(self, row: Row) -> bool:
        stops = row.request.stop
        if not stops:
            return False
        text = self.loaded.tokenizer.decode(row.ids, skip_special_tokens=True)
        return any(s in text for s in stops)

    # -- decode ----------------------------------------------------------------------------

    def step(self) -> list[Row]:
        """One decode step for every active row; returns the rows that finished."""
        rows = self.active
        if not rows:
            return []
        self.widest = max(self.widest, len(rows))
        groups = _step_groups(rows, self.path)
        for group in groups:
            self._step_rows(group)
        done = [r for r in rows if r.finish is not None]
        self.active = [r for r in rows if r.finish is None]
        return done

    def _step_rows(self, rows: list[Row]) -> None:
        """One forward for ``rows`` (padded to the path's ``min_rows``), a token for each."""
        hf = self.loaded.hf_model
        b = len(rows)
        bp = max(b, self.path.min_rows)
        pad = bp - b
        ids = [[r.ids[-1]] for r in rows] + [[self._pad]] * pad
        pos = [[r.position] for r in rows] + [[0]] * pad
        cache = RowsCache([r.cache for r in rows] + [None] * pad)
        # rows captured at the end of the step for all layers at once, and the others (long
        # contexts, layers on several devices) by their sessions' per-layer hooks
        deferred = [
            r.session if r.session is not None and r.session.defers_decode() else None for r in rows
        ] + [None] * pad
        hooked = [r.session if d is None else None for r, d in zip(rows, deferred, strict=False)]
        hooked += [None] * pad
        mux = HookMux(
            [r.hooks if d is None else [] for r, d in zip(rows, deferred, strict=False)],
            hooked,
            bp,
        )
        capture = (
            DecodeStepCapture(self.loaded.spec, deferred)
            if any(d is not None for d in deferred)
            else None
        )
        with (
            torch.inference_mode(),
            running(SharedStep(cache, hooked, capture)),
            attention_implementation(hf, ROWS_ATTENTION),
            mux.installed(),
            capture.installed() if capture is not None else nullcontext(),
            blas_threads(self.path.threads),
        ):
            out = hf(
                input_ids=torch.tensor(ids, dtype=torch.long, device=self._device),
                position_ids=torch.tensor(pos, dtype=torch.long, device=self._device),
                past_key_values=cache,
                use_cache=True,
            )
            if capture is not None:
                capture.finish()
        for i, row in enumerate(rows):
            self._append(row, out.logits[i, -1])

    def drop_all(self) -> list[Row]:
        """Remove and return every active row (after a failed step)."""
        rows, self.active = self.active, []
        return rows
