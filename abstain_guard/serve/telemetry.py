"""What a server tells its operators besides ``/metrics``: JSON log lines, each with the id
and the trace id of the request it was written for, and the guard's own OpenTelemetry span
around each chat completion (opentelemetry-api: a no-op until an SDK is configured).

A request's id is its ``X-Request-Id`` (a proxy's), else a new one, and comes back in that
header; its trace id is that of its W3C ``traceparent`` (or of the span an instrumentation
started), else a new one. docs/serving.md, "Metrics, logs and traces".
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import secrets
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from abstain_guard._version import __version__

REQUEST_ID_HEADER = "X-Request-Id"

_tracer = trace.get_tracer("abstain_guard.serve", __version__)


@dataclass
class RequestIds:
    """The ids every log line written for one request carries (``completion_id``: its chat
    completion's, once it has one)."""

    request_id: str
    trace_id: str
    completion_id: str | None = None


_current: ContextVar[RequestIds | None] = ContextVar("abstain_guard_request", default=None)


def request_ids(headers: Mapping[str, str]) -> RequestIds:
    """The ids of the request with ``headers``, in force for the log lines written while it
    runs (see the module docstring; a sent id is kept to its first 128 characters)."""
    parent = trace.get_current_span().get_span_context()  # an instrumentation's span
    if not parent.is_valid:
        parent = trace.get_current_span(propagate.extract(headers)).get_span_context()
    trace_id = format(parent.trace_id, "032x") if parent.is_valid else secrets.token_hex(16)
    sent = (headers.get(REQUEST_ID_HEADER.lower()) or "")[:128]
    ids = RequestIds(sent or secrets.token_hex(16), trace_id)
    _current.set(ids)
    return ids


def start_span(headers: Mapping[str, str], model: str, completion_id: str) -> Span:
    """The guard's span of chat completion ``completion_id`` (not yet current): a child of
    the span in context (an instrumented server's), else a server span continuing
    ``headers``' ``traceparent``. The request's log lines take its ids."""
    inside = trace.get_current_span().get_span_context().is_valid
    span = _tracer.start_span(
        f"chat {model}",
        context=None if inside else propagate.extract(headers),
        kind=SpanKind.INTERNAL if inside else SpanKind.SERVER,
        attributes={"gen_ai.operation.name": "chat", "gen_ai.request.model": model},
    )
    ids = _current.get()
    if ids is not None:
        ids.completion_id = completion_id
        if span.get_span_context().is_valid:  # recorded by an SDK: its trace
            ids.trace_id = format(span.get_span_context().trace_id, "032x")
    return span


def end_span(span: Span, status: int, outcome: str, reason: str, **attributes: Any) -> None:
    """Record how the chat completion ended on ``span`` (HTTP status, ``abstain_guard.outcome``
    and ``.reason`` as in the metrics, more ``attributes``); a 5xx is an error."""
    span.set_attributes({"http.response.status_code": status, **attributes})
    span.set_attributes({"abstain_guard.outcome": outcome, "abstain_guard.reason": reason})
    if status >= 500:
        span.set_attribute("error.type", reason)
        span.set_status(Status(StatusCode.ERROR, reason))


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the request's ids, the
    guard's decision (the ``abstention`` record of abstain_guard.guard.tracing) and the
    exception, where there are."""

    def format(self, record: logging.LogRecord) -> str:
        time = _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc)
        line: dict[str, Any] = {
            "time": time.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ids = _current.get()
        if ids is not None:
            line.update({k: v for k, v in asdict(ids).items() if v is not None})
        decision = getattr(record, "abstention", None)
        if decision is not None:
            line["decision"] = decision
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def configure_logging(level: str) -> None:
    """Log every logger's records at ``level`` and above as JSON lines on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
