"""The FastAPI app: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /healthz``,
``GET /metrics``.

Every refusal is OpenAI's error format with a status that says whose fault it is: 400 (the
request would run the guard otherwise than calibrated, or is malformed), 413 (too large),
429 / 503 with ``Retry-After`` (overloaded, queue full, shutting down). A streamed answer
is decided before its first byte, so errors are statuses, not broken streams.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from abstain_guard.errors import AbstainGuardError
from abstain_guard.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from abstain_guard.serve.openai_format import (
    completion_body,
    decision_headers,
    new_completion_id,
    sse_chunks,
)
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.schemas import RequestLimits, RequestRefused, parse_request
from abstain_guard.serve.service import GuardService

__all__ = ["create_app"]

logger = logging.getLogger("abstain_guard.serve")

ROUTES = frozenset({"/v1/chat/completions", "/v1/models", "/healthz", "/metrics"})
"""Paths counted by name in the metrics (any other is ``other``: bounded labels)."""


def _refusal(exc: RequestRefused) -> JSONResponse:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _read_body(request: Request, limits: RequestLimits) -> bytes:
    """The body, read no further than one byte past the limit (413 is decided there)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise RequestRefused(
            f"The request body has {declared} bytes; this server accepts at most "
            f"{limits.max_body_bytes}. Send a shorter question.",
            status=413,
        )
    body = bytearray()
    async for part in request.stream():
        body.extend(part)
        if len(body) > limits.max_body_bytes:
            break
    return bytes(body)


def create_app(
    service: GuardService | ModelService, limits: RequestLimits | None = None
) -> FastAPI:
    """The app serving ``service`` (the guard, or the raw model without one) within
    ``limits``. On shutdown the service stops admitting requests (503) while uvicorn lets
    the admitted ones finish."""
    limits = limits or RequestLimits()
    metrics = ServerMetrics(service)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        service.draining = False
        yield
        service.draining = True
        logger.info("shutting down: %d requests in flight finish first", service.in_flight)

    app = FastAPI(title="abstain-guard", lifespan=lifespan)
    app.state.service = service
    app.state.metrics = metrics

    @app.middleware("http")
    async def count_requests(request: Request, call_next):  # type: ignore[no-untyped-def]
        response = await call_next(request)
        path = request.url.path if request.url.path in ROUTES else "other"
        metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        start = time.perf_counter()
        try:
            parsed = parse_request(await _read_body(request, limits), limits)
            question: Any = service.question(parsed)
            service.admit()
            answer = await service.answer(question)
        except RequestRefused as exc:
            return _refusal(exc)
        except AbstainGuardError as exc:  # the guard failed (on_error="raise", a mismatch)
            logger.exception("chat completion failed")
            return _refusal(
                RequestRefused(f"{type(exc).__name__}: {exc}", status=500, kind="server_error")
            )
        decided = answer.abstained if answer.decision else None  # None: no guard
        metrics.decided(decided, time.perf_counter() - start, parsed.stream)
        logprobs = (parsed.top_logprobs or 0) if parsed.logprobs else None
        completion_id = new_completion_id()
        headers = decision_headers(answer)
        if parsed.stream:
            chunks = sse_chunks(
                answer,
                completion_id=completion_id,
                model=service.model_name,
                logprobs=logprobs,
                include_usage=parsed.include_usage,
            )
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        body = completion_body(
            answer, completion_id=completion_id, model=service.model_name, logprobs=logprobs
        )
        return JSONResponse(body, headers=headers)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        entry = {"id": service.model_name, "object": "model", "created": 0}
        return {"object": "list", "data": [{**entry, "owned_by": "abstain-guard"}]}

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        info = service.describe()
        return JSONResponse(info, status_code=503 if service.draining else 200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
