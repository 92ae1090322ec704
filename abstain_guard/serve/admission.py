"""How many requests a server takes at once, and the request options no served model takes
(shared by the guard and the passthrough)."""

from __future__ import annotations

from typing import Any

import httpx

from abstain_guard.errors import SchedulerFullError
from abstain_guard.serve.schemas import ChatCompletionRequest, RequestRefused

#: A local chat model's default batch and queue (``max_batch_size``, ``max_queue``).
DEFAULT_BATCH, DEFAULT_QUEUE = 8, 64
#: Requests admitted at once by default: the model's batch plus its queue.
DEFAULT_MAX_IN_FLIGHT = DEFAULT_BATCH + DEFAULT_QUEUE
#: How long readiness waits for the model's engine to answer its health check.
BACKEND_TIMEOUT_S = 5.0


class Admission:
    """How many requests a service takes at once: at most ``max_in_flight`` (429 beyond,
    with ``Retry-After``), none while shutting down (503)."""

    max_in_flight: int
    retry_after_s: int
    in_flight: int
    draining: bool
    model_name: str
    chat_model: Any
    backend_url: str | None

    def _open(self, max_in_flight: int | None, retry_after_s: int) -> None:
        """Start the chat model's engine, if it has one (the vLLM backend: up before the
        first request), and start admitting: at most ``max_in_flight`` at once (default:
        the chat model's batch plus queue)."""
        start = getattr(self.chat_model, "engine", None)
        self.backend_url = start()[0] if callable(start) else None
        batch = int(getattr(self.chat_model, "max_batch_size", DEFAULT_BATCH))
        queue = int(getattr(self.chat_model, "max_queue", DEFAULT_QUEUE))
        self.max_in_flight = max_in_flight or batch + queue
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.draining = False

    async def backend_health(self) -> dict[str, Any]:
        """``{"ok": bool, ...}``: whether the model answers (``/readyz``'s ``backend``): an
        engine's ``GET /health`` within :data:`BACKEND_TIMEOUT_S`; a model in this process
        always does."""
        if self.backend_url is None:
            return {"ok": True}
        try:
            async with httpx.AsyncClient(timeout=BACKEND_TIMEOUT_S) as client:
                (await client.get(f"{self.backend_url}/health")).raise_for_status()
        except httpx.HTTPError as exc:
            return {"ok": False, "url": self.backend_url, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, "url": self.backend_url}

    def admit(self) -> None:
        """Take a place for one request.

        Raises:
            RequestRefused: 503 while shutting down, 429 when ``max_in_flight`` requests run.
        """
        if self.draining:
            raise RequestRefused(
                "The server is shutting down; retry on another instance.",
                status=503,
                kind="server_error",
                code="shutting_down",
                retry_after_s=self.retry_after_s,
            )
        if self.in_flight >= self.max_in_flight:
            raise RequestRefused(
                f"The server is busy ({self.in_flight} requests in flight, at most "
                f"{self.max_in_flight}); retry after {self.retry_after_s} s.",
                status=429,
                kind="rate_limit_error",
                code="overloaded",
                retry_after_s=self.retry_after_s,
            )
        self.in_flight += 1

    def queue_full(self, exc: SchedulerFullError) -> RequestRefused:
        """The 503 for a full model queue."""
        return RequestRefused(
            f"The model's queue is full ({exc}).",
            status=503,
            kind="server_error",
            code="queue_full",
            retry_after_s=self.retry_after_s,
        )

    @property
    def top_logprobs_available(self) -> int:
        """Alternatives per token the model records (``top_logprobs`` may not ask more)."""
        return int(getattr(self.chat_model, "top_logprobs", 0) or 0)

    def unsupported_option(self, request: ChatCompletionRequest, **more: bool) -> str | None:
        """The first option of ``request`` no served model takes (``n`` > 1, ``more``,
        penalties, ``logit_bias``, a non-text ``response_format``); None: none.

        Raises:
            RequestRefused: none of these, but ``top_logprobs`` over what the model records.
        """
        problems = {
            "n": request.n not in (None, 1),
            **more,
            "frequency_penalty": request.frequency_penalty not in (None, 0),
            "presence_penalty": request.presence_penalty not in (None, 0),
            "logit_bias": bool(request.logit_bias),
            "response_format": (request.response_format or {}).get("type", "text") != "text",
        }
        found = next((param for param, bad in problems.items() if bad), None)
        reads = getattr(self.chat_model, "reads", None)
        if found is None and request.logprobs and reads is not None and "logprobs" not in reads:
            raise RequestRefused(
                "logprobs=true, but this guard's model does not ask its server for logprobs "
                "(its scorer reads none); to return them, serve the guard with a chat model "
                "that asks for every field (GuardService.from_artifact(..., "
                "model=VLLMChatModel(..., reads=None))).",
                param="logprobs",
            )
        asked = request.top_logprobs or 0
        if found is None and asked > self.top_logprobs_available:
            raise RequestRefused(
                f"top_logprobs={asked}, but the model records {self.top_logprobs_available} "
                "alternatives per token; ask for at most that many.",
                param="top_logprobs",
            )
        return found
