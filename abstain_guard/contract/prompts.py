"""How a question becomes chat messages for the model under calibration.

The same function builds the prompt at calibration time and at evaluation time, so the
calibration scores are exchangeable with what the guard sees for the same kind of question.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder

from abstain_guard.errors import InvalidInputError


class Question(Protocol):
    """What :func:`build_messages` reads of a question (``QAItem`` is one)."""

    @property
    def kind(self) -> str:
        """``"open"``, ``"choice"`` or ``"numeric"``."""
        ...

    def prompt_text(self) -> str:
        """The user message: the question, with lettered options for ``kind="choice"``."""
        ...


SHORT_ANSWER_SYSTEM_PROMPT = (
    "Answer the question with only the answer: a name, a word or a short phrase, no explanation."
)
NUMERIC_SYSTEM_PROMPT = (
    "Solve the problem step by step, briefly. End with 'The answer is <number>.'"
)

#: New-token budget per question kind (short answers, one letter, a worked solution).
MAX_NEW_TOKENS = {"open": 24, "choice": 8, "numeric": 192}


#: How the user message is built from a question, per kind (recorded in the artifact).
RENDERING = {
    "open": "{question}",
    "choice": "{question}\n<letter>) <option> per line\n"
    "Answer with the letter of the correct option.",
    "numeric": "{question}",
}


def system_prompt_for(kind: str, system_prompt: str | None = None) -> str:
    """The system prompt a question of ``kind`` gets (``system_prompt`` overrides it)."""
    if system_prompt:
        return system_prompt
    return NUMERIC_SYSTEM_PROMPT if kind == "numeric" else SHORT_ANSWER_SYSTEM_PROMPT


def max_new_tokens_for(kind: str, max_new_tokens: int | None = None) -> int:
    """The token budget of ``kind`` (``max_new_tokens`` overrides it)."""
    return int(max_new_tokens or MAX_NEW_TOKENS[kind])


#: Roles of the earlier turns of a conversation row (``QAItem.history``), in the order a
#: conversation alternates them.
HISTORY_ROLES: tuple[str, str] = ("user", "assistant")


def history_messages(history: Sequence[Sequence[str]]) -> list[BaseMessage]:
    """The earlier turns ``(role, content)`` of a conversation as chat messages: ``"user"``
    → :class:`HumanMessage`, ``"assistant"`` → :class:`AIMessage`.

    Raises:
        InvalidInputError: a turn has another role.
    """
    out: list[BaseMessage] = []
    for role, content in history:
        if role == HISTORY_ROLES[0]:
            out.append(HumanMessage(content=content))
        elif role == HISTORY_ROLES[1]:
            out.append(AIMessage(content=content))
        else:
            raise InvalidInputError(
                f"a conversation turn has role {role!r}; use {' or '.join(HISTORY_ROLES)}"
            )
    return out


def history_problem(history: Sequence[Sequence[str]]) -> str | None:
    """What is wrong with ``history`` (``(role, content)`` pairs: user / assistant turns that
    alternate, start with the user and end with the reply; non-blank text), or None."""
    expected = HISTORY_ROLES[0]
    for i, turn in enumerate(history, start=1):
        if not isinstance(turn, (tuple, list)) or len(turn) != 2:
            return f"history turn {i} is not a (role, content) pair"
        role, content = turn
        if role not in HISTORY_ROLES:
            return history_role_problem(i, role)
        if not isinstance(content, str) or not content.strip():
            return f"history turn {i} ({role}) has no content; give every turn its text"
        if role != expected:
            return (
                f"history turn {i} is a {role!r} turn where a {expected!r} turn belongs: "
                "turns must alternate user / assistant, starting with the user (merge "
                "consecutive turns of one speaker)"
            )
        expected = HISTORY_ROLES[1] if role == HISTORY_ROLES[0] else HISTORY_ROLES[0]
    if history and expected != HISTORY_ROLES[0]:
        return (
            "the history ends with a user turn; its last turn must be the assistant's reply "
            "(the row's question is the next user turn): add the reply, or move that text "
            "into the question"
        )
    return None


def history_role_problem(index: int, role: object) -> str:
    """Why ``role`` cannot be a history turn's role, and what to write instead."""
    if role == "system":
        return (
            f"history turn {index} is a system message; the system prompt is the "
            "calibration's (config key system_prompt), not a turn: drop it from the history"
        )
    if role == "tool":
        return (
            f"history turn {index} is a tool result; tool calls are calibrated by running the "
            "agent (calibrate --agent), not written into the history: drop it"
        )
    return f"history turn {index} has role {role!r}; use 'user' or 'assistant'"


def build_messages(item: Question, system_prompt: str | None = None) -> list[BaseMessage]:
    """Chat messages for one question: a system prompt for the kind, the earlier turns of
    its conversation (``item.history``), then the question (with lettered options)."""
    system = system_prompt_for(item.kind, system_prompt)
    history = history_messages(getattr(item, "history", ()) or ())
    return [SystemMessage(content=system), *history, HumanMessage(content=item.prompt_text())]


def messages_to_json(messages: list[BaseMessage]) -> list[dict[str, str]]:
    """Role/content pairs, for cache keys and reports."""
    return [{"role": m.type, "content": str(m.content)} for m in messages]


def question_prompt(system_prompt: str | None = None, kind: str = "open") -> ChatPromptTemplate:
    """The prompt used at calibration for ``kind``, as an LCEL prompt with ``{question}``.

    Guard an open question exactly as it was calibrated::

        chain = question_prompt() | AbstentionGuard(model, artifact=artifact)
        chain.invoke({"question": "What is the capital of Peru?"})

    For ``kind="choice"`` pass the question already followed by its lettered options. An
    optional ``history`` list of earlier messages goes between the system prompt and the
    question, as :func:`build_messages` puts it.
    """
    system = system_prompt_for(kind, system_prompt).replace("{", "{{").replace("}", "}}")
    return ChatPromptTemplate.from_messages(
        [
            ("system", system),
            MessagesPlaceholder("history", optional=True),
            ("human", "{question}"),
        ]
    )
