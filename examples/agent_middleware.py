"""The guard as LangChain v1 agent middleware (``create_agent``).

    python examples/agent_middleware.py

``AbstentionMiddleware`` scores the agent's final answer after each model call and, when it
is unreliable, replaces it with the abstention message and ends the run.
"""

from __future__ import annotations

from typing import Any

from langchain.agents import create_agent

from abstain_guard import AbstentionMiddleware, GuardConfig, default_artifact_path
from abstain_guard.contract.prompts import SHORT_ANSWER_SYSTEM_PROMPT


def main(model: Any = None) -> list[Any]:
    """Run the agent on two questions; return the final messages."""
    if model is None:
        from abstain_guard.adapters import load_default_model

        model = load_default_model(max_new_tokens=24)  # as calibrated
    agent = create_agent(
        model,
        tools=[],
        system_prompt=SHORT_ANSWER_SYSTEM_PROMPT,
        middleware=[
            AbstentionMiddleware(default_artifact_path(), config=GuardConfig(participation=0.5))
        ],
    )
    finals = []
    for question in ["What is the capital of Germany?", "What is the capital of Nauru?"]:
        state = agent.invoke({"messages": [{"role": "user", "content": question}]})
        final = state["messages"][-1]
        info = final.response_metadata["abstention"]
        print(f"{question} -> {final.content!r} (abstained={info['abstained']})")
        finals.append(final)
    return finals


if __name__ == "__main__":
    main()
