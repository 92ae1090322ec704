"""The FastAPI app: ``POST /v1/chat/completions``, ``GET /v1/models``, ``POST /v1/feedback``,
``GET /v1/monitor``, ``GET /livez``, ``GET /readyz``, ``GET /metrics``, ``GET /dashboard``.

Every decision goes to the server's :class:`~abstain_guard.serve.monitor_link.MonitorLink`
under its completion id, in admission order, before its answer leaves (a monitor that cannot
take it makes the request a 503); feedback only feeds the monitor. With an API key every
``/v1/*`` route needs ``Authorization: Bearer <key>`` (a route dependency, so it holds
wherever the app is mounted); beyond loopback, feedback needs a key. Every refusal is
OpenAI's error format with a status saying whose fault it is. Each chat completion runs in
the guard's span, and its log lines carry its ids (:mod:`abstain_guard.serve.telemetry`).
See docs/serving.md ("Endpoints", "The drift monitor, feedback and the API key", "What a
request may ask", "Metrics, logs and traces").
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from abstain_guard.errors import (
    DecisionJournalError,
    DuplicateFeedbackError,
    MonitorUnavailableError,
    UnknownRunError,
)
from abstain_guard.monitor.guard_monitor import GuardMonitor
from abstain_guard.serve import telemetry
from abstain_guard.serve.metrics import ServiceMetrics, decision_reason
from abstain_guard.serve.monitor_link import LocalMonitorLink, MonitorLink
from abstain_guard.serve.openai_format import (
    completion_body,
    decision_headers,
    new_completion_id,
    sse_chunks,
    sse_decided_end,
    sse_released,
    sse_role,
)
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.schemas import (
    ChatCompletionRequest,
    RequestLimits,
    RequestRefused,
    parse_request,
)
from abstain_guard.serve.service import GuardedAnswer, GuardService

logger = logging.getLogger("abstain_guard.serve")

CHAT = "/v1/chat/completions"
ROUTES = frozenset(
    {CHAT, "/v1/models", "/v1/feedback", "/v1/monitor", "/livez", "/readyz", "/metrics"}
)
"""Paths counted by name in the metrics (any other is ``other``: bounded labels)."""


@dataclass(frozen=True)
class Served:
    """What the app's routes serve (``app.state.served``).

    Attributes:
        service: the guard, or the raw model without one.
        link: where decisions, feedback and metrics go.
        limits: the request size limits.
        feedback_open: whether ``/v1/feedback`` may be called (with an API key, or on
            loopback only).
        metrics: what this process reports of itself in ``/metrics``.
    """

    service: GuardService | ModelService
    link: MonitorLink
    limits: RequestLimits
    feedback_open: bool
    metrics: ServiceMetrics


def _served(request: Request) -> Served:
    served: Served = request.app.state.served
    return served


# --- the app -----------------------------------------------------------------------------


def service_monitor(service: GuardService | ModelService, **options: Any) -> GuardMonitor | None:
    """A monitor fitted on ``service``'s guard (its artifact and config); None without one."""
    if not isinstance(service, GuardService):
        return None
    guard = service.guard
    return GuardMonitor(**options).fit_artifact(guard.artifact, guard.config)


def create_app(
    service: GuardService | ModelService,
    *,
    api_key: str | None = None,
    loopback: bool = True,
    monitor: GuardMonitor | None = None,
    link: MonitorLink | None = None,
) -> FastAPI:
    """The app serving ``service`` (the guard, or the raw model without one) within the
    :class:`~abstain_guard.serve.schemas.RequestLimits`. On shutdown the service stops
    admitting requests (503) while uvicorn lets the admitted ones finish.

    Args:
        api_key: the key ``/v1/*`` requests must send as ``Authorization: Bearer``.
        loopback: whether the server listens on loopback only; beyond it, feedback needs
            ``api_key``.
        monitor: the guard's monitor (default: a new one, :func:`service_monitor`).
        link: where decisions, feedback and metrics go (default: ``monitor`` and the
            metrics in this process; a replica on Ray Serve passes the deployment's monitor
            actor, :class:`~abstain_guard.serve.monitor_actor.RayMonitorLink`).
    """
    if link is None:
        monitor = monitor if monitor is not None else service_monitor(service)
        link = LocalMonitorLink(service, monitor)
    app = FastAPI(title="abstain-guard", lifespan=_lifespan)
    app.state.served = Served(
        service, link, RequestLimits(), api_key is not None or loopback, ServiceMetrics.of(service)
    )
    app.add_exception_handler(RequestRefused, _refused)  # raised by a dependency (the API key)
    app.middleware("http")(_count_requests)
    keyed = [api_key_dependency(api_key)]  # on every /v1/* route
    for path, route, method in (
        (CHAT, _chat_completions, "POST"),
        ("/v1/feedback", _feedback, "POST"),
        ("/v1/monitor", _monitor_state, "GET"),
        ("/v1/models", _models, "GET"),
    ):
        app.add_api_route(path, route, methods=[method], dependencies=keyed)
    app.add_api_route("/livez", _livez, methods=["GET"])
    app.add_api_route("/readyz", _readyz, methods=["GET"])
    app.add_api_route("/metrics", _prometheus, methods=["GET"])
    app.add_api_route("/dashboard", _dashboard, methods=["GET"])
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    service = app.state.served.service
    service.draining = False
    yield
    service.draining = True
    logger.info("shutting down: %d requests in flight finish first", service.in_flight)


def _route(request: Request) -> str:
    route = getattr(request.scope.get("route"), "path", None)  # mount / root_path free
    return route if route in ROUTES else "other"


async def _count_requests(request: Request, call_next: Any) -> Response:
    ids = telemetry.request_ids(request.headers)
    response: Response = await call_next(request)
    _served(request).link.request_done(_route(request), response.status_code)
    response.headers[telemetry.REQUEST_ID_HEADER] = ids.request_id
    return response


# --- refusals and authentication ---------------------------------------------------------


def _refusal(exc: RequestRefused) -> JSONResponse:
    headers = {}
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestRefused)
    if _route(request) == CHAT:
        _served(request).link.refused("refused", exc.code or exc.kind)
    return _refusal(exc)


def _monitor_down(exc: Exception, retry_after_s: int) -> RequestRefused:
    """The 503 for a decision the monitor could not take (journal write failed, monitor
    actor timed out or gone): nothing is answered that is not logged."""
    return RequestRefused(
        f"The drift monitor could not take this request's decision ({type(exc).__name__}: "
        f"{exc}); it was not answered. Retry after {retry_after_s} s.",
        status=503,
        kind="server_error",
        code="monitor_unavailable",
        retry_after_s=retry_after_s,
    )


def _failed(served: Served, span: Span, exc: Exception) -> JSONResponse:
    """The response to a chat completion that was refused or failed, counted and logged:
    its refusal (outcome ``refused``, reason its code), a 503 when the monitor could not
    take its decision, else a 500 (outcome ``failed``, reason the error's type: the backend
    or the guard failed, ``on_error="raise"``, a mismatch)."""
    outcome = "refused"
    if isinstance(exc, MonitorUnavailableError | DecisionJournalError):
        logger.error("chat completion refused: the monitor could not take it: %s", exc)
        exc = _monitor_down(exc, served.service.retry_after_s)
    elif not isinstance(exc, RequestRefused):
        logger.error("chat completion failed", exc_info=exc)
        outcome, failure = "failed", type(exc).__name__
        exc = RequestRefused(f"{failure}: {exc}", status=500, kind="server_error", code=failure)
    else:
        logger.info("chat completion refused (%d %s): %s", exc.status, exc.code, exc.message)
    reason = exc.code or exc.kind
    served.link.refused(outcome, reason)
    telemetry.end_span(span, exc.status, outcome, reason)
    return _refusal(exc)


def api_key_dependency(api_key: str | None) -> Any:
    """A route dependency that refuses (401) a request without ``Authorization: Bearer
    <api_key>``; it runs for its route wherever the app is mounted."""

    async def require_api_key(request: Request) -> None:
        if not _authorized(request, api_key):
            raise RequestRefused(
                "Missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                "the server was started with (--api-key / ABSTAIN_GUARD_API_KEY).",
                status=401,
                kind="authentication_error",
                code="invalid_api_key",
            )

    return Depends(require_api_key)


def _authorized(request: Request, api_key: str | None) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <api_key>`` (always, without a key).

    The comparison is on bytes, in constant time: the header as it came over the wire
    (Starlette decodes header bytes as latin-1, so encoding back gives them exactly) against
    the key's UTF-8 bytes. A token with any byte at all is a yes or a no, never an error."""
    if api_key is None:
        return True
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    sent = token.strip().encode("latin-1", errors="replace")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, api_key.encode("utf-8"))


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


# --- chat completions --------------------------------------------------------------------


@dataclass
class _Completion:
    """One chat completion as its route runs it: its id (its key in admission order), when
    it arrived, the guard's span around it, the parsed request, and whether it took a
    place in admission order."""

    id: str
    start: float
    span: Span
    parsed: ChatCompletionRequest | None = None
    admitted: bool = False

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token to return (None: no logprobs asked)."""
        assert self.parsed is not None
        return (self.parsed.top_logprobs or 0) if self.parsed.logprobs else None

    def decided(self, served: Served, answer: GuardedAnswer) -> None:
        """Count and trace the answer (its decision, when one ended the run)."""
        assert self.parsed is not None
        decision = answer.outcome
        served.link.decided(decision, time.perf_counter() - self.start, self.parsed.stream)
        outcome, reason = decision_reason(decision) if decision else ("answered", "undecided")
        telemetry.end_span(self.span, 200, outcome, reason, **{
            "gen_ai.response.id": self.id,
            "gen_ai.response.finish_reasons": (answer.finish_reason,),
            "gen_ai.usage.input_tokens": answer.prompt_tokens,
            "gen_ai.usage.output_tokens": answer.completion_tokens,
        })  # fmt: skip


async def _chat_completions(request: Request) -> Response:
    served = _served(request)
    service, sink = served.service, served.link
    completion_id = new_completion_id()
    span = telemetry.start_span(request.headers, service.model_name, completion_id)
    call = _Completion(completion_id, time.perf_counter(), span)
    finished = handed_off = False
    try:
        with trace.use_span(span, end_on_exit=False):
            parsed = parse_request(await _read_body(request, served.limits), served.limits)
            call.parsed = parsed
            question: Any = service.question(parsed)
            call.admitted = sink.monitored
            if call.admitted:  # its place in the deployment's admission order
                await sink.admit(call.id)
            service.admit()  # no await between taking a place and answer(), which frees it
            if parsed.stream and isinstance(service, GuardService) and service.certified_streaming:
                events = service.stream_answer(question)  # released as it passes
                first = await anext(events)  # generation started: errors are still statuses
                handed_off = True  # the stream's body finishes or releases the place
                return StreamingResponse(
                    _certified_body(served, call, first, events),
                    media_type="text/event-stream",
                    headers={"X-Abstain-Guard-Streaming": "certified"},
                )
            answer = await service.answer(question)
            if call.admitted and answer.outcome:  # one decision per run: its outcome
                await sink.finish(call.id, answer.outcome)  # before the answer leaves
                finished = True
            return _answered(served, call, answer)
    except Exception as exc:  # a refusal, or the backend's or the guard's error: a 500
        return _failed(served, span, exc)
    finally:  # ended without a decision (refused, failed, cancelled): give up the place
        if call.admitted and not finished and not handed_off:
            sink.release(call.id)
        if not handed_off:
            span.end()


def _answered(served: Served, call: _Completion, answer: GuardedAnswer) -> Response:
    """The decided answer, counted: a JSON body or (buffered) server-sent events, with the
    decision's headers."""
    parsed = call.parsed
    assert parsed is not None
    call.decided(served, answer)
    model = served.service.model_name
    headers = decision_headers(answer)
    if parsed.stream:
        chunks = sse_chunks(
            answer,
            completion_id=call.id,
            model=model,
            logprobs=call.logprobs,
            include_usage=parsed.include_usage,
        )
        return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
    body = completion_body(answer, completion_id=call.id, model=model, logprobs=call.logprobs)
    return JSONResponse(body, headers=headers)


async def _certified_body(
    served: Served,
    call: _Completion,
    first: tuple[str, Any],
    events: AsyncGenerator[tuple[str, Any], None],
) -> AsyncIterator[str]:
    """A certified stream's server-sent events: each released piece as it passes, then the
    decided end (:func:`~abstain_guard.serve.openai_format.sse_decided_end`). The decision is
    recorded (monitor, counts, span) before its chunk leaves; a stream that ends otherwise
    (the client went away) gives its place back and stops generation."""
    sink, model, parsed = served.link, served.service.model_name, call.parsed
    assert parsed is not None
    created = int(time.time())
    finished = False
    try:
        with trace.use_span(call.span, end_on_exit=True):
            yield sse_role(call.id, model, created)
            kind, value = first
            while kind == "text":
                if value:
                    yield sse_released(call.id, model, created, value)
                kind, value = await anext(events)
            answer, rest = value
            if call.admitted and answer.outcome:
                await sink.finish(call.id, answer.outcome)
            finished = True
            call.decided(served, answer)
            for part in sse_decided_end(
                answer,
                rest,
                completion_id=call.id,
                model=model,
                created=created,
                logprobs=call.logprobs,
                include_usage=parsed.include_usage,
            ):
                yield part
    except Exception as exc:  # the stream broke off (its span records the error)
        served.link.refused("failed", type(exc).__name__)
        raise
    finally:
        if call.admitted and not finished:
            sink.release(call.id)
        await events.aclose()


# --- feedback and the monitor ------------------------------------------------------------


class FeedbackRequest(BaseModel):
    """``POST /v1/feedback``: the completion id and whether its answer was right (for an
    abstention: whether the withheld answer was). Other fields are refused."""

    model_config = ConfigDict(extra="forbid")

    id: str
    correct: StrictBool


async def _feedback(request: Request) -> JSONResponse:
    served = _served(request)
    try:
        _check_feedback_taken(served)
        body = await _read_body(request, served.limits)
        try:
            fb = FeedbackRequest.model_validate_json(body)
        except ValidationError as exc:
            raise RequestRefused(
                'Invalid feedback: send {"id": "<completion id>", "correct": true|false} '
                f"and nothing else ({exc.error_count()} problem(s): "
                f"{exc.errors()[0].get('msg')} at {exc.errors()[0].get('loc')}).",
            ) from exc
        answer = await _label(served, fb)
    except RequestRefused as exc:
        return _refusal(exc)
    return JSONResponse(answer)


def _check_feedback_taken(served: Served) -> None:
    """Feedback is taken by a guard's server on loopback or with an API key.

    Raises:
        RequestRefused: 403 beyond loopback without a key, 404 without a guard.
    """
    if not served.feedback_open:
        raise RequestRefused(
            "Feedback is refused: this server listens beyond loopback without an API "
            "key. Restart it with --api-key (or ABSTAIN_GUARD_API_KEY) and send "
            "'Authorization: Bearer <key>'.",
            status=403,
            kind="permission_error",
        )
    if not served.link.monitored:
        raise RequestRefused(
            "This server runs no guard (--no-guard): there are no decisions to label.",
            status=404,
            kind="not_found_error",
        )


async def _label(served: Served, fb: FeedbackRequest) -> dict[str, Any]:
    """Label decision ``fb.id`` (a decision held behind an earlier request is waited for).

    Raises:
        RequestRefused: 404 for an unknown id, 409 for one already labeled, 503 when the
            monitor did not answer.
    """
    try:
        return await served.link.feedback(fb.id, fb.correct)
    except UnknownRunError as exc:
        raise RequestRefused(str(exc), status=404, param="id", code="unknown_id") from exc
    except DuplicateFeedbackError as exc:
        raise RequestRefused(str(exc), status=409, param="id", code="duplicate") from exc
    except MonitorUnavailableError as exc:
        raise _monitor_down(exc, served.service.retry_after_s) from exc


async def _monitor_state(request: Request) -> Response:
    return await _monitor_view(request, lambda link: link.state(), JSONResponse)


async def _dashboard(request: Request) -> Response:
    """The monitor's page: participation and score drift over time, decisions by reason
    (:func:`~abstain_guard.monitor.report.live_page`); open, as ``/metrics`` is."""
    return await _monitor_view(request, lambda link: link.dashboard(), HTMLResponse)


async def _monitor_view(
    request: Request, view: Callable[[MonitorLink], Awaitable[Any]], response: type[Response]
) -> Response:
    """The monitor link's ``view`` as a ``response``; 404 without a guard, 503 when the
    monitor does not answer."""
    served = _served(request)
    if not served.link.monitored:
        return _refusal(
            RequestRefused("This server runs no guard (--no-guard).", status=404,
                           kind="not_found_error")
        )  # fmt: skip
    try:
        return response(await view(served.link))
    except MonitorUnavailableError as exc:
        return _refusal(_monitor_down(exc, served.service.retry_after_s))


# --- models, health and metrics ----------------------------------------------------------


async def _models(request: Request) -> dict[str, object]:
    entry = {"id": _served(request).service.model_name, "object": "model", "created": 0}
    return {"object": "list", "data": [{**entry, "owned_by": "abstain-guard"}]}


async def _livez(_: Request) -> JSONResponse:
    """Liveness: the process answers (whatever its guard, backend or monitor)."""
    return JSONResponse({"status": "alive"})


async def _readyz(request: Request) -> JSONResponse:
    """Readiness: the guard in force and its load, ``monitor`` (every decision reached the
    journal and the log; with replicas, the monitor actor answers) and ``backend`` (the
    model answers); 503 while draining or when either is not ok."""
    served = _served(request)
    info = served.service.describe()
    info["monitor"] = await served.link.health()
    info["backend"] = await served.service.backend_health()
    if not (info["monitor"]["ok"] and info["backend"]["ok"]) and not served.service.draining:
        info["status"] = "unready"
    return JSONResponse(info, status_code=200 if info["status"] == "ok" else 503)


async def _prometheus(request: Request) -> Response:
    """This process's own metrics, then the deployment's; without the latter while the
    monitor does not answer (``abstain_guard_monitor_up 0``)."""
    served = _served(request)
    try:
        shared, up = await served.link.metrics(), True
    except MonitorUnavailableError as exc:
        logger.warning("/metrics without the monitor's counts: %s", exc)
        shared, up = b"", False
    return Response(served.metrics.render(up) + shared, media_type=CONTENT_TYPE_LATEST)
