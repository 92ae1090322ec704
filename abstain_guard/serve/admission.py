"""How many requests a server takes at once (shared by the guard and the passthrough)."""

from __future__ import annotations

from typing import Any

from abstain_guard.errors import SchedulerFullError
from abstain_guard.serve.schemas import RequestRefused

__all__ = ["Admission"]


class Admission:
    """How many requests a service takes at once: at most ``max_in_flight`` (429 beyond,
    with ``Retry-After``), none while shutting down (503)."""

    max_in_flight: int
    retry_after_s: int
    in_flight: int
    draining: bool
    model_name: str
    chat_model: Any

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
