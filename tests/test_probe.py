"""The built-in probe set: offline, deterministic, with relations, aliases and popularity."""

from __future__ import annotations

from collections import Counter

import pytest

from abstain_guard.calibration.build.datasets import split_items
from abstain_guard.calibration.build.judges import LexicalJudge, normalize_answer
from abstain_guard.calibration.build.probe import PROBE_RELATIONS, builtin_probe_set
from abstain_guard.errors import InvalidInputError


@pytest.fixture(scope="module")
def probe():
    return builtin_probe_set()


def test_size_relations_and_unique_ids(probe) -> None:
    counts = Counter(it.group for it in probe)
    assert set(counts) == set(PROBE_RELATIONS)
    assert 900 <= len(probe) <= 1300
    assert counts["capital"] > 200 and counts["element_name"] == 118
    assert len({it.id for it in probe}) == len(probe)
    assert all(it.kind == "open" and it.answers and it.question.endswith("?") for it in probe)


def test_deterministic_and_seeded_order(probe) -> None:
    assert builtin_probe_set() == probe
    other = builtin_probe_set(seed=1)
    assert other != probe
    assert sorted(other, key=lambda it: it.id) == sorted(probe, key=lambda it: it.id)


def test_known_facts_and_aliases(probe) -> None:
    by_id = {it.id: it for it in probe}
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
        assert max(pops) - min(pops) > 1.5, rel


def test_relation_subset_and_errors() -> None:
    caps = builtin_probe_set(relations=["capital"])
    assert {it.group for it in caps} == {"capital"}
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
