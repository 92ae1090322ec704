"""``abstain-guard serve --no-guard``: the raw model behind the same endpoint, no guard.

An OpenAI-compatible stand-in for an API model, with OpenAI-style logprobs, to calibrate a
perplexity guard on as an API chat model. A request may carry a conversation, its own system
prompt, ``max_tokens`` up to the server's limit, and ``tools`` / ``tool_choice`` (bound on the
model; its calls come back as ``message.tool_calls``). docs/serving.md, "Without a guard".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import BaseMessage

from abstain_guard.contract.tool_choice import AUTO, NONE
from abstain_guard.errors import InvalidInputError, SchedulerFullError
from abstain_guard.serve.admission import Admission
from abstain_guard.serve.conversation import requested_tool_choice, to_messages
from abstain_guard.serve.guard_rules import request_tools
from abstain_guard.serve.schemas import ChatCompletionRequest, RequestRefused
from abstain_guard.serve.service import GuardedAnswer, answer_of


@dataclass(frozen=True)
class ModelCall:
    """One request as the model runs it: the messages, the call options, the tools (OpenAI
    format) and the model with them and their ``tool_choice`` bound (None: no tools)."""

    messages: list[BaseMessage]
    options: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)
    runnable: Any = None


class ModelService(Admission):
    """The raw chat model, answering OpenAI requests with logprobs and no guard.

    Args:
        model: a local chat model (``GeometryChatModel``).
        model_name: the id ``/v1/models`` lists and responses carry.
        max_tokens: the most new tokens a request may ask for, and what it gets when it
            names no ``max_tokens``.
        max_in_flight: requests admitted at once (default: the model's batch plus queue).
        retry_after_s: the ``Retry-After`` an overloaded server sends.
    """

    def __init__(
        self,
        model: Any,
        *,
        model_name: str = "abstain-guard",
        max_tokens: int = 256,
        max_in_flight: int | None = None,
        retry_after_s: int = 1,
    ) -> None:
        self.chat_model = model
        self.model = model.bind(capture_geometry=False)
        self.model_name = model_name
        self.max_tokens = int(max_tokens)
        self._open(max_in_flight, retry_after_s)

    def question(self, request: ChatCompletionRequest) -> ModelCall:
        """The messages, options and tools of ``request``.

        Raises:
            RequestRefused: an unknown role, a malformed tool call or tool result, no user
                message, a budget over the server's limit, or options the model lacks.
        """
        messages = to_messages(request.messages)
        if not any(m.role == "user" for m in request.messages):
            raise RequestRefused("The request has no user message; send one.", param="messages")
        tools = request_tools(request)
        choice = request.tool_choice
        if not tools and requested_tool_choice(choice) not in (None, NONE, AUTO):
            raise RequestRefused(f"tool_choice={choice!r} needs tools; send them.", param="tools")
        options = self._options(request)
        return ModelCall(messages, options, tools, self._with_tools(tools, choice))

    def _with_tools(self, tools: list[dict[str, Any]], choice: Any) -> Any:
        """The model with ``tools`` and ``choice`` bound (None without tools).

        Raises:
            RequestRefused: the model cannot call tools, or ``choice`` names no tool.
        """
        if not tools:
            return None
        try:
            bound = self.chat_model.bind_tools(tools, tool_choice=choice)
        except (NotImplementedError, InvalidInputError) as exc:
            raise RequestRefused(f"tools cannot be bound: {exc}", param="tool_choice") from exc
        return bound.bind(capture_geometry=False)

    def _options(self, request: ChatCompletionRequest) -> dict[str, Any]:
        budget = request.token_budget or self.max_tokens
        if budget > self.max_tokens:
            param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
            raise RequestRefused(
                f"{param}={budget}, but this server generates at most {self.max_tokens} "
                f"tokens per answer; send at most {self.max_tokens}.",
                param=param,
            )
        unsupported = self.unsupported_option(request)
        if unsupported is not None:
            raise RequestRefused(f"{unsupported} is not supported; omit it.", param=unsupported)
        options: dict[str, Any] = {"max_new_tokens": int(budget)}
        for name in ("temperature", "top_p", "seed"):
            if getattr(request, name) is not None:
                options[name] = getattr(request, name)
        if request.stop:
            options["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
        return options

    async def answer(self, call: ModelCall) -> GuardedAnswer:
        """The model's answer to ``call`` (a place must have been taken with :meth:`admit`;
        it is given back here).

        Raises:
            RequestRefused: 400 for input the model cannot take (too long for its context,
                options out of range), 503 when its queue is full.
        """
        model = self.model if call.runnable is None else call.runnable
        try:
            message = await model.ainvoke(call.messages, **call.options)
        except SchedulerFullError as exc:
            raise self.queue_full(exc) from exc
        except InvalidInputError as exc:  # ContextLengthError too
            raise RequestRefused(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.in_flight -= 1
        return answer_of(message)

    def describe(self) -> dict[str, Any]:
        """What ``/readyz`` reports: no guard, the budget limit and the load."""
        return {
            "status": "draining" if self.draining else "ok",
            "model": self.model_name,
            "guard": None,
            "max_tokens": self.max_tokens,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
        }
