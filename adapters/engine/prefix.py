"""The prefix path: a prompt pass split after the shared prefix, the prefix computed once
(:class:`PrefixStore`) and every request started from a copy. A split pass is not bitwise
the whole pass, so the prefix path is a decode path of its own (:data:`PREFIX_RULE`); where a
prompt splits is a function of the prompt alone (:func:`split_point`). docs/architecture.md,
"Concurrent callers".
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache

from ..capture.attention import capture_mode
from ..capture.session import CACHE_BUDGET_BYTES, CaptureSession, default_parts
from .threads import DECODE_THREADS, blas_threads

#: The split rule the prefix path records (``decode_path["prefix"]``): prompts split after
#: the leading system turn(s) and the opening of the first user turn (:func:`split_point`).
PREFIX_RULE = "system_turn"

#: Prefixes :class:`PrefixStore` keeps per model (least recently used dropped first); a
#: deployment has one per system prompt and tool set. Each keeps its KV cache and, under full
#: capture, ``L·k·H·D`` floats of parts where they fit the capture budget.
STORE_SIZE = 8


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token-id sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def split_point(prompt: Sequence[int], head: Sequence[int]) -> int:
    """Where ``prompt`` splits on the prefix path: after its common prefix with ``head``
    (the template rendered up to the first user turn's content), and never at either end
    (0: no split; the whole prompt is one pass)."""
    n = common_prefix(prompt, head)
    return n if 0 < n < len(prompt) else 0


@dataclass(frozen=True)
class PrefixState:
    """What a prefix's forward leaves behind, for requests to start from.

    ``cache``: its KV cache (copied per request); ``cmlp [L, k]``: ``C_MLP^l[s, s]`` of the
    prefix positions (full capture); ``unorm [L, k, H]``: the max-norms ``‖u^h_s‖_∞``;
    ``u [L, H, k, D]``: the parts themselves, kept when they fit the capture memory budget
    (None otherwise, and for plain prefixes, which keep only the cache).
    """

    ids: tuple[int, ...]
    full: bool
    cache: Any
    cmlp: torch.Tensor | None = None
    unorm: torch.Tensor | None = None
    u: torch.Tensor | None = None

    def new_cache(self) -> Any:
        """A cache holding the prefix, for one request to extend."""
        return copy.deepcopy(self.cache)


def compute_prefix(
    loaded: Any, ids: Sequence[int], full: bool, budget: int | None = None
) -> PrefixState:
    """Run ``ids`` alone (batch 1, one BLAS thread) and keep what a request needs of it:
    with ``full``, under full capture (whose attention function the rest of the prompt pass
    uses too) with the parts kept where the request's "auto" rule keeps them (they fit its
    session's ``budget``, default :data:`~..capture.session.CACHE_BUDGET_BYTES`; a request
    that keeps parts has a longer session, so its prefix's parts fit too), their max-norms
    otherwise."""
    hf = loaded.hf_model
    session = None
    if full:
        rule = default_parts()
        if budget is not None:
            rule = replace(rule, cache_budget_bytes=budget)
        session = CaptureSession(
            loaded.spec, batch_size=1, max_len=len(ids), capture="full", parts=rule, strategy="auto"
        )
    cache = DynamicCache(config=hf.config)
    device = next(hf.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    with torch.inference_mode(), capture_mode(hf, session), blas_threads(DECODE_THREADS):
        hf(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if session is None:
        return PrefixState(tuple(ids), False, cache)
    return PrefixState(tuple(ids), True, cache, *session.prefix_parts())


class PrefixStore:
    """The prefixes of one model, computed once each (thread-safe; least recently used
    dropped beyond ``size``). Two threads asking for a missing prefix at once may both
    compute it; the results are bitwise equal and one is kept."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[tuple[bool, int | None, tuple[int, ...]], PrefixState] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(
        self, loaded: Any, ids: Sequence[int], full: bool, budget: int | None = None
    ) -> PrefixState:
        """The state of prefix ``ids`` (full capture or plain; full under the memory
        ``budget`` of :func:`compute_prefix`), computed if missing."""
        budget = (CACHE_BUDGET_BYTES if budget is None else budget) if full else None
        key = (full, budget, tuple(int(t) for t in ids))
        with self._lock:
            state = self._items.get(key)
            if state is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return state
            self.misses += 1
        state = compute_prefix(loaded, key[2], full, budget)
        with self._lock:
            self._items.setdefault(key, state)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return self._items[key]

    def clear(self) -> None:
        """Drop every prefix (e.g. after the model's weights changed)."""
        with self._lock:
            self._items.clear()


_STORES_LOCK = threading.Lock()


def prefix_store(loaded: Any) -> PrefixStore:
    """The :class:`PrefixStore` of ``loaded`` (one per loaded model, made on first use)."""
    store = getattr(loaded, "prefixes", None)
    if store is None:
        with _STORES_LOCK:
            store = getattr(loaded, "prefixes", None)
            if store is None:
                store = loaded.prefixes = PrefixStore()
    return store


def start_from_prefix(
    loaded: Any, prompt: Sequence[int], split: int, session: CaptureSession | None
) -> tuple[Any, list[int]]:
    """The cache a request's prompt pass starts from and the ids it still runs: the prompt
    after ``split`` on a copy of the prefix's cache (the prefix's capture state loaded into
    ``session``), or a fresh cache and the whole prompt when ``split`` is 0."""
    hf = loaded.hf_model
    if split <= 0:
        return DynamicCache(config=hf.config), list(prompt)
    full = session is not None and session.needs_attention
    budget = session.parts.cache_budget_bytes if session is not None else None
    state = prefix_store(loaded).get(loaded, prompt[:split], full, budget)
    if session is not None:
        session.load_prefix(state)
    return state.new_cache(), list(prompt[split:])
