"""The built-in probe set: offline, deterministic, with relations, aliases and popularity."""

from __future__ import annotations

from collections import Counter

import pytest

from abstain_guard.calibration.building.judges import LexicalJudge
from abstain_guard.calibration.building.questions.answer_text import normalize_answer
from abstain_guard.calibration.building.questions.datasets import QAItem, split_items
from abstain_guard.calibration.building.questions.probe import (
    PROBE_RELATIONS,
    _probe_items,
    builtin_probe_set,
)
from abstain_guard.calibration.building.questions.probe_relations import RELATIONS
from abstain_guard.errors import InvalidInputError


@pytest.fixture(scope="module")
def probe() -> list[QAItem]:
    return builtin_probe_set()


def test_size_relations_and_unique_ids_and_questions(probe) -> None:
    counts = Counter(it.group for it in probe)
    assert set(counts) == set(PROBE_RELATIONS)
    assert len(probe) >= 3000
    assert counts["capital"] > 200 and counts["element_name"] == 118
    assert counts["state_capital"] == 50 and counts["city_country"] > 1000
    assert counts["country_of_capital"] > 200 and counts["city_state"] > 300
    assert len({it.id for it in probe}) == len(probe)
    # a question asked twice could land in two splits; compare them as the judge reads text
    assert len({normalize_answer(it.question) for it in probe}) == len(probe)
    assert all(it.kind == "open" and it.answers and it.question.endswith("?") for it in probe)
    assert all(it.source.startswith("builtin:") for it in probe)


def test_deterministic_and_seeded_order(probe) -> None:
    _probe_items.cache_clear()  # built afresh, not read from this process's cache
    assert builtin_probe_set() == probe
    # each call returns a list of its own: a caller's edits reach no other caller
    mine = builtin_probe_set()
    mine.pop()
    assert builtin_probe_set() == probe
    # the relations' order in the argument does not matter
    assert builtin_probe_set(relations=list(reversed(PROBE_RELATIONS))) == probe
    other = builtin_probe_set(seed=1)
    assert other != probe
    assert sorted(other, key=lambda it: it.id) == sorted(probe, key=lambda it: it.id)


def test_known_facts_and_aliases(probe) -> None:
    by_id = {it.id: it for it in probe}
    by_question = {it.question: it for it in probe}
    peru = by_id["probe:capital:PE"]
    assert peru.question == "What is the capital of Peru?" and peru.answers[0] == "Lima"
    us = by_id["probe:currency:US"]
    assert us.question == "What is the currency of the United States called?"
    assert {"Dollar", "United States dollar", "US dollar", "USD"} <= set(us.answers)
    assert "Kiev" in by_id["probe:capital:UA"].answers
    assert by_id["probe:continent:FR"].answers == ("Europe",)
    assert by_id["probe:element_symbol:26"].answers == ("Fe",)
    assert by_id["probe:element_name:13"].answers == ("Aluminum", "Aluminium")
    assert by_id["probe:element_number:1"].question.endswith("atomic number 1?")
    judge = LexicalJudge()
    assert judge.judge(us.question, us.answers, "It is the US dollar.").correct
    assert judge.judge(peru.question, peru.answers, "The capital is Cusco.").correct is False

    leeds = by_question["In which country is the city Leeds?"]
    assert leeds.answers[0] == "United Kingdom" and {"UK", "England"} <= set(leeds.answers)
    assert judge.judge(leeds.question, leeds.answers, "Leeds is in England.").correct
    houston = by_question["In which country is the city Houston?"]
    assert judge.judge(houston.question, houston.answers, "USA").correct
    paris = by_question["Which country has the capital Paris?"]
    assert paris.answers[0] == "France" and "France's" in paris.answers
    assert judge.judge(paris.question, paris.answers, "It is a French city.").correct
    assert not judge.judge(paris.question, paris.answers, "It is in French Guiana.").correct
    assert by_id["probe:country_of_capital:NL"].answers[0] == "Netherlands"
    assert by_question["Which US state is Chicago in?"].answers == ("Illinois",)
    assert by_question["Which US state is Portland in?"].answers == ("Oregon",)  # not Maine
    albany = by_id["probe:state_capital:NY"]
    assert albany.question == "What is the capital of the US state New York?"
    assert albany.answers == ("Albany",)
    # names beyond Latin-1 are asked in ASCII, Latin-1 accents stay
    assert "In which country is the city Mazar-e Sharif?" in by_question
    assert "In which country is the city São Paulo?" in by_question


def test_ambiguous_and_leaking_names_are_not_asked(probe) -> None:
    questions = {it.question for it in probe}
    ids = {it.id for it in probe}
    # Hyderabad: India 7.0 M, Pakistan 1.9 M; Kansas City: Missouri and Kansas
    assert "In which country is the city Hyderabad?" not in questions
    assert "Which US state is Kansas City in?" not in questions
    # the answer is in the question
    assert "Which US state is Oklahoma City in?" not in questions
    assert "Which country has the capital Luxembourg?" not in questions
    # Kingston: Jamaica and Norfolk Island; Basseterre and Basse-Terre read the same
    assert "probe:country_of_capital:JM" not in ids
    assert "probe:country_of_capital:KN" not in ids
    # capitals are asked backwards, not as cities; territories' cities are not asked
    assert "In which country is the city Paris?" not in questions
    assert not any(it.id.startswith("probe:city_country:") and "San Juan" in it.question
                   for it in probe)  # fmt: skip
    # geonames lists Mandaluyong twice, once as "Mandaluyong City": one question
    assert ("In which country is the city Mandaluyong?" in questions) != (
        "In which country is the city Mandaluyong City?" in questions
    )
    # not a city: a numbered quarter, a province
    assert "In which country is the city Sector 2?" not in questions
    assert not any("Province" in q for q in questions)


def test_popularity(probe) -> None:
    by_id = {it.id: it for it in probe}
    assert all(it.popularity is not None for it in probe)
    assert by_id["probe:capital:CN"].popularity > 9 > by_id["probe:capital:TV"].popularity
    h, og = by_id["probe:element_name:1"], by_id["probe:element_name:118"]
    assert h.popularity > by_id["probe:element_name:26"].popularity > og.popularity
    assert 0.0 < og.popularity < 0.01
    # popularity varies within every relation, so known and unknown questions both occur
    for rel in PROBE_RELATIONS:
        pops = [it.popularity for it in probe if it.group == rel]
        assert max(pops) - min(pops) > 1.0, rel


def test_relation_subset_and_errors() -> None:
    caps = builtin_probe_set(relations=["capital"])
    assert {it.group for it in caps} == {"capital"}
    states = builtin_probe_set(relations=["state_capital", "city_state"])
    assert {it.group for it in states} == {"state_capital", "city_state"}
    with pytest.raises(InvalidInputError, match="choose from"):
        builtin_probe_set(relations=["rivers"])


def test_stratified_split(probe) -> None:
    parts = split_items(probe, seed=0)
    assert sum(len(v) for v in parts.values()) == len(probe)
    for part in parts.values():
        assert set(Counter(it.group for it in part)) == set(PROBE_RELATIONS)


def test_no_gold_alias_leaks_into_its_question(probe) -> None:
    for it in probe:
        q = f" {normalize_answer(it.question)} "
        assert not any(f" {normalize_answer(a)} " in q for a in it.answers), it
    ids = {it.id for it in probe}
    assert "probe:capital:SM" not in ids  # San Marino's capital is San Marino
    assert "probe:capital:MX" in ids  # "Mexico City" stays, the alias "Mexico" does not
    assert "probe:element_symbol:49" not in ids  # indium's symbol "In" matches any "in"


@pytest.mark.model
@pytest.mark.slow
def test_the_default_model_knows_the_popular_new_questions(probe, default_model) -> None:
    """The new relations are answerable and their aliases judge the model's answers: of the
    ten most popular questions of each, the model gets some right (measured: 9, 10, 3 and 4
    of 10)."""
    from abstain_guard.contract.prompts import build_messages

    judge = LexicalJudge()
    tops = [
        sorted((it for it in probe if it.group == rel), key=lambda it: -it.popularity)[:10]
        for rel in RELATIONS
    ]
    # only the text is judged: one batch, without geometry capture (the same greedy tokens)
    asked = [it for top in tops for it in top]
    # eight in flight, the rows one decode step holds (the model's max_batch_size), not the
    # six of LangChain's default thread pool on two cores: fewer steps, the same tokens
    answers = default_model.batch(
        [build_messages(it) for it in asked],
        config={"max_concurrency": default_model.max_batch_size},
        capture_geometry=False,
    )
    judged = [
        bool(judge.judge(it.question, it.answers, str(msg.content)).correct)
        for it, msg in zip(asked, answers, strict=True)
    ]
    correct = {rel: sum(judged[10 * i : 10 * i + 10]) for i, rel in enumerate(RELATIONS)}
    assert all(n >= 1 for n in correct.values()), correct
    assert 12 <= sum(correct.values()) <= 38, correct
