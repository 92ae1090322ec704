"""An OpenAI-compatible endpoint that returns no logprobs: the embedded model behind
``abstain-guard serve --no-guard``'s app (FastAPI on uvicorn, a free loopback port), with
every chat completion's ``logprobs`` stripped on the way out whatever the request asked,
as a hosted API without logprobs (or a gateway that drops them) answers. What the black-box
scorers are calibrated against end to end (``langchain_openai.ChatOpenAI`` pointed at it).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.runner import ServerThread

__all__ = ["StripLogprobs", "strip_logprobs", "text_only_server"]

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]

COMPLETIONS = "/v1/chat/completions"


def _stripped(document: Any) -> Any:
    if isinstance(document, dict):
        for choice in document.get("choices") or ():
            if isinstance(choice, dict) and "logprobs" in choice:
                choice["logprobs"] = None
    return document


def strip_logprobs(body: bytes) -> bytes:
    """A completion body (JSON, or server-sent events of JSON chunks) with every choice's
    ``logprobs`` set to null; anything else unchanged."""
    try:
        return json.dumps(_stripped(json.loads(body))).encode()
    except ValueError:
        pass
    lines = []
    for line in body.decode().split("\n"):
        data = line.removeprefix("data: ")
        if line.startswith("data: ") and data.strip() != "[DONE]":
            line = "data: " + json.dumps(_stripped(json.loads(data)))
        lines.append(line)
    return "\n".join(lines).encode()


class StripLogprobs:
    """ASGI middleware: the responses of :data:`COMPLETIONS` buffered and sent on without
    logprobs (:func:`strip_logprobs`; ``content-length`` recomputed); other paths pass."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(
        self,
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope.get("type") != "http" or scope.get("path") != COMPLETIONS:
            await self.app(scope, receive, send)
            return
        start: Message = {}
        parts: list[bytes] = []

        async def buffered(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            parts.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = strip_logprobs(b"".join(parts))
            headers = [
                (k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, buffered)


def text_only_server(model: Any, *, model_name: str = "smollm2", max_tokens: int = 64) -> Any:
    """A :class:`~abstain_guard.serve.runner.ServerThread` (not started; use ``with``)
    serving ``model`` with logprobs stripped from every completion."""
    server = ServerThread(ModelService(model, model_name=model_name, max_tokens=max_tokens))
    server.server.config.app = StripLogprobs(server.server.config.app)
    return server
