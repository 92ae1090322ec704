"""Questions for the lookup agent (``examples/lookup_agent.py``, ``--data builtin-lookup``),
each with the tool call a right run makes. The relations, why these facts and how the
questions are chosen: docs/agents.md, 'The built-in lookup questions'.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence

import numpy as np

from abstain_guard.errors import InvalidInputError

from .answer_text import normalize_answer
from .datasets import QAItem
from .lookup_facts import (
    STATE_CAPITAL_ALIASES,
    STATE_CAPITALS,
    city_facts_text,
    country_facts_text,
    geonames,
    largest_state_cities,
    name_key,
    state_facts_text,
)
from .probe import builtin_probe_set, chosen_relations, shuffled, without_leaked_aliases
from .tool_labels import ExpectedCall

#: The relations (``QAItem.group``) of :func:`lookup_questions`, in build order.
LOOKUP_RELATIONS: tuple[str, ...] = (
    "capital",
    "currency",
    "continent",
    "state_capital",
    "state_largest",
    "city_country",
    "city_state",
)
#: Questions per relation at most (evenly spaced over the relation's popularity).
PER_RELATION = 120
#: The tools' names and the argument each takes.
TOOLS: dict[str, str] = {"country_facts": "country", "state_facts": "state", "city_facts": "city"}
_LOOKUPS: dict[str, Callable[[str], str]] = {
    "country_facts": country_facts_text,
    "state_facts": state_facts_text,
    "city_facts": city_facts_text,
}
#: Relation → (tool, pattern whose group 1 is the entity in the probe's question).
_PROBE_FORMS: dict[str, tuple[str, re.Pattern[str]]] = {
    "capital": ("country_facts", re.compile(r"^What is the capital of (.+)\?$")),
    "currency": ("country_facts", re.compile(r"^What is the currency of (.+) called\?$")),
    "continent": ("country_facts", re.compile(r"^On which continent is (.+)\?$")),
    "city_country": ("city_facts", re.compile(r"^In which country is the city (.+)\?$")),
    "city_state": ("city_facts", re.compile(r"^Which US state is (.+) in\?$")),
}
_SOURCE = "builtin-lookup"


def _entity(text: str) -> str:
    """The entity as the question names it, without a leading "the"."""
    return re.sub(r"^the\s+", "", text.strip(), flags=re.IGNORECASE)


def _with_call(item: QAItem, relation: str, tool: str, entity: str) -> QAItem:
    """The item as a lookup question: id ``lookup:<relation>:<key>``, the expected call."""
    key = item.id.rsplit(":", 1)[-1]
    return QAItem(
        id=f"lookup:{relation}:{key}",
        question=item.question,
        answers=item.answers,
        group=relation,
        popularity=item.popularity,
        source=_SOURCE,
        expected_tool_calls=(ExpectedCall.of(tool, {TOOLS[tool]: entity}),),
    )


def _probe_items(relation: str) -> list[QAItem]:
    """The probe's items of one relation (in id order) with their expected call.

    Raises:
        InvalidInputError: a probe question no longer has the form this module reads.
    """
    tool, form = _PROBE_FORMS[relation]
    out = []
    for item in sorted(builtin_probe_set(relations=[relation]), key=lambda it: it.id):
        m = form.match(item.question)
        if m is None:
            raise InvalidInputError(
                f"probe question {item.question!r} ({item.id}) does not read as {form.pattern}; "
                "update agent_questions._PROBE_FORMS to the probe's new wording"
            )
        out.append(_with_call(item, relation, tool, _entity(m.group(1))))
    return out


def _state_items(relation: str) -> list[QAItem]:
    """``state_capital`` / ``state_largest`` questions, states in code order; Georgia (a
    country's name too) is not asked."""
    probe = {it.id.rsplit(":", 1)[-1]: it for it in builtin_probe_set(relations=["state_capital"])}
    countries, _, states = geonames()
    largest = largest_state_cities()
    country_keys = {name_key(str(c["name"])) for c in countries.values()}
    out = []
    for code in sorted(STATE_CAPITALS):
        name = str(states[code]["name"]).strip()
        if name_key(name) in country_keys:
            continue
        if relation == "state_capital":
            question = f"What is the capital of {name}?"
            answers = (STATE_CAPITALS[code], *STATE_CAPITAL_ALIASES.get(code, ()))
        else:
            question = f"What is the largest city in {name}?"
            answers = (largest[code],)
        base = probe.get(code)
        popularity = base.popularity if base is not None else None
        item = QAItem(id=f"probe:{relation}:{code}", question=question, answers=answers)
        item = _with_call(item, relation, "state_facts", name)
        out.append(dataclasses.replace(item, popularity=popularity))
    return out


def tool_result(item: QAItem) -> str:
    """What the item's (first) expected call returns."""
    call = item.expected_tool_calls[0]
    return _LOOKUPS[call.name](str(call.arguments()[TOOLS[call.name]]))


def _tool_gives_answer(item: QAItem) -> bool:
    """Whether the expected call's result holds the main gold answer (as whole tokens)."""
    gold = normalize_answer(item.answers[0])
    return bool(gold) and f" {gold} " in f" {normalize_answer(tool_result(item))} "


def _spread(items: Sequence[QAItem], k: int) -> list[QAItem]:
    """At most ``k`` items evenly spaced over the popularity order (ties by id)."""
    if len(items) <= k:
        return list(items)
    ranked = sorted(items, key=lambda it: (it.popularity or 0.0, it.id))
    picks = np.unique(np.rint(np.linspace(0, len(ranked) - 1, k)).astype(int))
    return [ranked[i] for i in picks]


@functools.lru_cache(maxsize=8)
def _relation(relation: str) -> tuple[QAItem, ...]:
    items = _probe_items(relation) if relation in _PROBE_FORMS else _state_items(relation)
    usable = [kept for it in items if (kept := without_leaked_aliases(it)) is not None]
    return tuple(_spread([it for it in usable if _tool_gives_answer(it)], PER_RELATION))


def lookup_questions(relations: Sequence[str] | None = None, seed: int = 0) -> list[QAItem]:
    """The lookup agent's questions with their expected calls (all relations: 698), in a
    seeded random order (content and ids do not depend on ``seed``); ``relations`` is a
    subset of :data:`LOOKUP_RELATIONS` (default: all).

    Raises:
        InvalidInputError: an unknown relation.
    """
    wanted = set(chosen_relations(relations, LOOKUP_RELATIONS, "lookup"))
    items = [it for rel in LOOKUP_RELATIONS if rel in wanted for it in _relation(rel)]
    return shuffled(items, seed)
