"""The OpenAI-compatible request the server accepts, and why it refuses one.

A request is parsed from its raw body (:func:`parse_request`) so that every problem, from a
body that is too large or not JSON to a field of the wrong type, becomes one
:class:`RequestRefused` with an HTTP status, the offending parameter and a message saying
what to send instead; the app turns it into OpenAI's error format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, ValidationError


@dataclass(frozen=True)
class RequestLimits:
    """Size limits of one request.

    Attributes:
        max_body_bytes: the largest request body accepted (413 above).
        max_messages: the most messages in one request.
        max_chars: the longest message content, in characters.
    """

    max_body_bytes: int = 64 * 1024
    max_messages: int = 16
    max_chars: int = 8000


class RequestRefused(Exception):
    """A request the server will not run: HTTP ``status``, OpenAI error ``kind`` and
    ``param``, and a message that says what was wrong and what to send instead."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.kind = kind
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class TextPart(BaseModel):
    """One part of a message's content; only text parts can be guarded."""

    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    """The function of a tool call an assistant message made: its name and arguments (a
    JSON string, as OpenAI sends them, or an object)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """One tool call of an earlier assistant message (OpenAI format)."""

    id: str
    type: str = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    """One message of the conversation (its role is checked against the calibrated prompt
    later, with a message that says which roles are accepted): ``tool_calls`` of an
    assistant message, ``tool_call_id`` (and ``name``) of a ``tool`` result."""

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as text (text parts joined).

        Raises:
            RequestRefused: a part is not text (images, audio: the guard was calibrated on
                text questions).
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        kinds = sorted({p.type for p in self.content if p.type != "text"})
        if kinds:
            raise RequestRefused(
                f"Message content parts of type {kinds} cannot be guarded; send text only.",
                param="messages",
            )
        return "".join(p.text or "" for p in self.content)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a usage chunk before ``[DONE]``."""

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The fields of OpenAI's chat completion request the server reads. Fields that would
    change how the answer is generated (budget, decoding, tools) are checked against the
    calibration by the service; other unknown fields (``user``, ...) are ignored (pydantic's
    default, as for every model here).
    ``metadata`` (string values) carries the question's group for a guard with
    ``group_by="<key>"``."""

    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None

    @property
    def token_budget(self) -> int | None:
        """The budget asked for (``max_completion_tokens`` or the older ``max_tokens``)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One readable line for pydantic's errors, and the first offending parameter."""
    parts, param = [], None
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        param = param or (loc or None)
        got = json.dumps(err.get("input"), default=str)[:80]
        parts.append(f"{loc or '<body>'}: {err.get('msg')} (got {got})")
    return "Invalid chat completion request: " + "; ".join(parts) + ".", param


def parse_request(body: bytes, limits: RequestLimits) -> ChatCompletionRequest:
    """The request in ``body``, within ``limits``.

    Raises:
        RequestRefused: 413 for a body over the size limit, 400 for anything else wrong
            (not JSON, not an object, a field of the wrong type, too many messages, a
            message too long).
    """
    if len(body) > limits.max_body_bytes:
        raise RequestRefused(
            f"The request body is over {limits.max_body_bytes} bytes, the most this server "
            "accepts. Send a shorter question.",
            status=413,
        )
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestRefused(
            f"The request body is not JSON ({exc}); send a chat completion request object."
        ) from exc
    if not isinstance(raw, dict):
        raise RequestRefused(
            f"The request body is a JSON {type(raw).__name__}, not an object; send "
            '{"model": ..., "messages": [...]}.'
        )
    try:
        request = ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        message, param = _validation_message(exc)
        raise RequestRefused(message, param=param) from exc
    if len(request.messages) > limits.max_messages:
        raise RequestRefused(
            f"The request has {len(request.messages)} messages; at most "
            f"{limits.max_messages} are accepted.",
            param="messages",
        )
    for i, entry in enumerate(request.messages):
        if len(entry.text()) > limits.max_chars:
            raise RequestRefused(
                f"Message {i} has {len(entry.text())} characters; at most "
                f"{limits.max_chars} are accepted.",
                param=f"messages.{i}.content",
            )
    return request
