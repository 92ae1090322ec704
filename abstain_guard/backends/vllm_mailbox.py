"""The scheduler side of the vLLM connector's bookkeeping: which requests asked for a
capture, and how a worker's capture meets its request's response. Pure Python (no vLLM):
:class:`~.vllm_connector.AbstainGuardConnector` delegates to :class:`CaptureMailbox`, and the
tests drive it without an engine.

The order vLLM gives (``Scheduler.update_from_output``): a request that finishes in a step is
handed to ``request_finished`` *before* the worker's captures of that step reach
``update_connector_output``. So ``request_finished`` returns a payload dict that is filled in
place when the capture arrives — vLLM builds the OpenAI response from it after the step.
Until then it says why there is no capture; a response that leaves the engine still saying
so (aborted, cut by a stop string, or evicted below) is refused by the client
(:func:`~.vllm_payload.decode_capture` raises ``BackendError``), and the guard fails closed.
A capture is never attached to another request's response. Every payload — a capture or
an error — is signed as it is completed (``sign``: :func:`~.vllm_payload.sign_payload` under
the server's key), so the client tells the server's errors from a forgery.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

#: Most captures, and most payloads, kept waiting for their other half. A finished request
#: waits for its capture only until the same step's worker output arrives, so more than this
#: many requests finishing in one step would be needed to evict one (it then keeps
#: :data:`NO_CAPTURE`); a capture waits only for a request that never finishes (aborted
#: between the worker's sampling and the scheduler's bookkeeping).
MAX_WAITING = 4096
#: The payload's error when the engine finished a request without its capture.
NO_CAPTURE = (
    "the engine finished the request without its capture (aborted, or cut by a stop string)"
)
#: The payload's error for a request that asked without the server's token (no activations).
NOT_AUTHORIZED = (
    "the request did not carry the token of the server's ABSTAIN_GUARD_PAYLOAD_KEY; no "
    "activations are returned to it"
)
Sign = Callable[[dict[str, Any]], dict[str, Any]]


class CaptureMailbox:
    """Captures matched to their requests (scheduler side; one per engine)."""

    def __init__(
        self,
        engine: Mapping[str, Any],
        sign: Sign = lambda payload: payload,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self.engine = dict(engine)
        self.sign = sign
        self.max_waiting = max_waiting
        self._new: dict[str, bool] = {}
        self._wanted: set[str] = set()
        self._denied: set[str] = set()
        self._pending: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._arrived: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def want(self, request_id: str, entropy: bool = True) -> None:
        """A new request asked for its capture (``entropy``: with its token entropies)."""
        self._new[request_id] = bool(entropy)
        self._wanted.add(request_id)

    def deny(self, request_id: str) -> None:
        """A new request asked for its capture without the server's token."""
        self._denied.add(request_id)

    def take_new(self) -> dict[str, bool]:
        """The requests that asked since the last call (sent to the workers this step), each
        with whether it asked for its entropies."""
        new, self._new = self._new, {}
        return new

    def finished(
        self, request_id: str, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """The payload of a request that just finished (None: it asked for none), with
        ``extra`` (what the scheduler records of it: its LoRA adapter). Filled in place by
        :meth:`arrive` when its capture comes with the step's worker output."""
        if request_id in self._denied:
            self._denied.discard(request_id)
            return self.sign({"error": NOT_AUTHORIZED})
        if request_id not in self._wanted:
            return None
        self._wanted.discard(request_id)
        own = {**(extra or {}), "engine": self.engine}
        capture = self._arrived.pop(request_id, None)
        if capture is not None:
            return self.sign({**capture, **own})
        target: dict[str, Any] = self.sign({"error": NO_CAPTURE, **own})
        self._pending[request_id] = target
        while len(self._pending) > self.max_waiting:
            self._pending.popitem(last=False)  # the oldest keeps its error: refused, not wrong
        return target

    def arrive(self, captures: Mapping[str, Mapping[str, Any]]) -> None:
        """Captures of requests whose last token a worker sampled in this step."""
        for request_id, capture in captures.items():
            target = self._pending.pop(request_id, None)
            if target is not None:  # the response is still being assembled
                own = {k: target[k] for k in target if k not in ("error", "signature")}
                target.clear()
                target.update(capture, **own)
                self.sign(target)
            else:
                self._arrived[request_id] = dict(capture)
                while len(self._arrived) > self.max_waiting:
                    self._arrived.popitem(last=False)

    @property
    def waiting(self) -> tuple[int, int]:
        """``(payloads waiting for a capture, captures waiting for a request)``."""
        return len(self._pending), len(self._arrived)
