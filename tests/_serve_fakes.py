"""A scripted tool-calling chat model and hand-built artifacts for the serve tests with tools
and conversations (owned by test_serve_tools.py).

:class:`ToolScriptModel` records its generation settings as ``GeometryChatModel`` does
(``response_metadata["generation"]``: prompt hashes, budget, decoding, ``history_messages``
and the tool keys), so the guard's deployment checks run on it unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field

from abstain_guard import GuardArtifact
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.contract.deployment import (
    AgentRecord,
    DeploymentRecord,
    PromptRecord,
    sha256_text,
    tools_sha256,
)
from abstain_guard.scorers import PerplexityScorer

AGENT_PROMPT = "You answer questions about capitals. Use the tools."
QA_PROMPT = "Answer the question with only the answer."
DECODING = {"temperature": 0.0, "top_p": 1.0, "top_k": None, "stop": []}
CONFIDENT, UNSURE = -0.05, -4.0
#: A tool call's log-probability per token (perplexity ~1.65: under the fake artifact's τ,
#: above a confident final answer's ~1.05), for questions about Chile.
MIDDLING = -0.5


@tool
def capital_lookup(country: str) -> str:
    """The capital city of a country."""
    return {"Peru": "Lima", "Chile": "Santiago"}.get(country, "unknown")


TOOLS = [convert_to_openai_tool(capital_lookup)]


def _logprobs(text: str, logprob: float) -> dict[str, Any]:
    tokens = text.split() or [text]
    return {
        "content": [
            {"token": t, "logprob": logprob, "top_logprobs": [{"token": t, "logprob": logprob}]}
            for t in tokens
        ]
    }


def earlier_messages(messages: list[BaseMessage]) -> int:
    """Non-system messages before the last user message (the generation record's count)."""
    users = [i for i, m in enumerate(messages) if isinstance(m, HumanMessage)]
    head = messages[: users[-1]] if users else []
    return sum(1 for m in head if not isinstance(m, SystemMessage))


class ToolScriptModel(BaseChatModel):
    """With tools bound, answers a question with a ``capital_lookup`` call and a tool result
    with the result as its answer (unsure for ``"unknown"``); without tools, answers
    ``"Lima"``. The call is for Peru (confident), Chile (:data:`MIDDLING`) or, for any
    other country named last in the question, that country (unsure). Every call's messages
    and options are kept in ``seen``."""

    fingerprint: str = "m-1"
    seen: list[tuple[list[BaseMessage], dict[str, Any]]] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "tool-script-test-chat-model"

    def bind_tools(self, tools: Any, *, tool_choice: Any = None, **kwargs: Any) -> Any:
        schemas = [convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=schemas, tool_choice=tool_choice, **kwargs)

    def _generation(self, messages: list[BaseMessage], kwargs: dict[str, Any]) -> dict[str, Any]:
        system = "\n".join(str(m.content) for m in messages if isinstance(m, SystemMessage))
        tools = kwargs.get("tools")
        return {
            "max_new_tokens": kwargs.get("max_new_tokens", kwargs.get("max_tokens", 24)),
            **DECODING,
            "system_prompt_sha256": sha256_text(system or None),
            "chat_template_sha256": "t",
            "history_messages": earlier_messages(messages),
            "tools_sha256": tools_sha256(tools),
            "tool_choice": kwargs.get("tool_choice"),
            "tool_call_format": "hermes" if tools else None,
            "tool_prompt_sha256": None,
        }

    def _reply(self, messages: list[BaseMessage], tools: Any) -> AIMessage:
        last = messages[-1]
        if tools and isinstance(last, HumanMessage):
            country = str(last.content).rstrip("?").split()[-1]
            lp = {"Peru": CONFIDENT, "Chile": MIDDLING}.get(country, UNSURE)
            call = {"name": "capital_lookup", "args": {"country": country}, "id": "call_1"}
            return AIMessage(content="", tool_calls=[call], response_metadata={"lp": lp})
        if isinstance(last, ToolMessage):
            text = str(last.content)
            return AIMessage(
                content=text, response_metadata={"lp": UNSURE if text == "unknown" else CONFIDENT}
            )
        return AIMessage(content="Lima", response_metadata={"lp": CONFIDENT})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.seen.append((list(messages), dict(kwargs)))
        reply = self._reply(messages, kwargs.get("tools"))
        lp = reply.response_metadata.get("lp", CONFIDENT)
        text = str(reply.content) or "<tool_call>"
        meta = {
            "logprobs": _logprobs(text, lp),
            "generation": self._generation(messages, kwargs),
            "finish_reason": "stop",
        }
        msg = AIMessage(
            content=reply.content,
            tool_calls=reply.tool_calls,
            response_metadata=meta,
            usage_metadata={"input_tokens": 10, "output_tokens": 2, "total_tokens": 12},
        )
        return ChatResult(generations=[ChatGeneration(message=msg)])


def artifact(
    *, tools: bool = False, conversations: bool = False, **agent_fields: Any
) -> GuardArtifact:
    """A perplexity guard "calibrated" on :class:`ToolScriptModel`: confident answers
    (perplexity ~1.05) are answered, unsure ones (~55) withheld at participation 0.8. With
    ``tools`` the record is an agent's (its tools, system prompt, format; ``agent_fields``:
    :class:`AgentRecord` fields, e.g. ``gating``, ``call_tool_choices``, ``tool_steps``)."""
    scores = np.linspace(1.0, 3.0, 60)
    correct = np.arange(scores.size) % 3 != 0
    agent = None
    if tools:
        agent_fields.setdefault("call_tool_choices", {"0": [None], "1": [None]})  # free calls
        agent = AgentRecord(
            factory="tests._serve_fakes:agent",
            system_prompt=AGENT_PROMPT,
            step_limit=10,
            tool_call_format="hermes",
            conversations=conversations,
            **agent_fields,
        )
    record = DeploymentRecord(
        model_fingerprint="m-1",
        chat_template_sha256="t",
        decoding=DECODING,
        prompts={
            "open": PromptRecord(
                system_prompt=AGENT_PROMPT if tools else QA_PROMPT, max_new_tokens=24
            )
        },
        tools=TOOLS if tools else None,
        agent=agent,
        conversations=conversations,
    )
    return GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, correct),
        model_fingerprint="m-1",
        metadata={"deployment": record.to_json()},
    )
