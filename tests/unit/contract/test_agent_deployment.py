"""What an agent artifact records and how responses are checked against it
(abstain_guard/contract/deployment.py: AgentRecord, tool_mismatches)."""

from __future__ import annotations

from abstain_guard.contract.deployment import (
    AgentRecord,
    DeploymentRecord,
    PromptRecord,
    generation_mismatches,
    sha256_text,
    tools_sha256,
)

SCHEMA = [{"type": "function", "function": {"name": "country_facts", "parameters": {}}}]
OTHER = [{"type": "function", "function": {"name": "web_search", "parameters": {}}}]


def _record(tools=SCHEMA, agent=True) -> DeploymentRecord:
    return DeploymentRecord(
        model_fingerprint="fp",
        chat_template_sha256="tpl",
        decoding={"temperature": 0.0},
        prompts={"open": PromptRecord(system_prompt="S", max_new_tokens=48)},
        tools=tools,
        agent=AgentRecord(
            factory="examples.country_agent:build_agent",
            system_prompt="S",
            step_limit=8,
            tool_call_format="prompted",
            tool_prompt_sha256=sha256_text("block"),
            runs={"n": 3},
        )
        if agent
        else None,
    )


def _generation(**over) -> dict:
    gen = {
        "max_new_tokens": 48,
        "temperature": 0.0,
        "system_prompt_sha256": sha256_text("S"),
        "chat_template_sha256": "tpl",
        "tools_sha256": tools_sha256(SCHEMA),
        "tool_call_format": "prompted",
        "tool_prompt_sha256": sha256_text("block"),
        "tool_choice": "auto",
    }
    gen.update(over)
    return gen


def test_a_response_of_the_calibrated_agent_matches():
    assert generation_mismatches(_record(), _generation()) == []


def test_other_tools_format_or_tool_block_are_mismatches():
    record = _record()
    (tools,) = generation_mismatches(record, _generation(tools_sha256=tools_sha256(OTHER)))
    assert "other tools" in tools and "country_facts" in tools
    (fmt,) = generation_mismatches(record, _generation(tool_call_format="hermes"))
    assert "tool_call_format='hermes'" in fmt and "'prompted'" in fmt
    (block,) = generation_mismatches(record, _generation(tool_prompt_sha256=sha256_text("x")))
    assert "tool block" in block


def test_a_tool_less_artifact_refuses_responses_generated_with_tools():
    record = _record(tools=None, agent=False)
    (problem,) = generation_mismatches(record, _generation())
    assert "other tools" in problem and "no tools" in problem
    # and a response without tool keys (a model that records none) is a tool-less response
    assert generation_mismatches(record, _generation(tools_sha256=None)) == []


def test_an_agent_artifact_refuses_a_response_generated_without_tools():
    (problem,) = generation_mismatches(_record(), _generation(tools_sha256=None))
    assert "without tools" in problem


def test_the_agent_record_round_trips_through_artifact_metadata():
    record = _record()
    again = DeploymentRecord.from_metadata({"deployment": record.to_json()})
    assert again == record and again.agent is not None and again.agent.step_limit == 8
    # artifacts written before agents have no agent record
    old = record.to_json()
    del old["agent"]
    assert DeploymentRecord.from_metadata({"deployment": old}).agent is None
