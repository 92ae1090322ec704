"""A tool call's arguments against the tool's JSON Schema.

:func:`tool_parameters` is the schema a call's arguments must satisfy (the tool's
``parameters``, closed to arguments it does not declare), :func:`tool_args_error` the one
check of a call's arguments, whoever generated it (calibration, an agent, the server).
Tools are in OpenAI format (``{"type": "function", "function": {...}}``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import jsonschema

from abstain_guard.errors import InvalidInputError

# -- arguments against the tool's schema -----------------------------------------------------

#: Keywords by which a parameters schema says what it does with arguments it does not list.
_OPEN_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def tool_parameters(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON Schema a call's arguments must satisfy: the tool's ``parameters`` (an object
    with no properties when it has none), closed to arguments it does not declare
    (``additionalProperties: false``) unless it says itself what to do with them. A
    model that invents an argument has not called the tool it was shown."""
    fn = schema.get("function", schema)
    params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
    if not any(key in params for key in _OPEN_KEYWORDS):
        params["additionalProperties"] = False
    return params


@functools.lru_cache(maxsize=256)
def _validator(parameters_json: str) -> Any:
    """A jsonschema validator of one parameters schema (given as canonical JSON, the cache
    key); the dialect is the schema's ``$schema`` (draft 2020-12 without one).

    Raises:
        jsonschema.SchemaError: the schema is not valid JSON Schema.
    """
    parameters = json.loads(parameters_json)
    cls = jsonschema.validators.validator_for(parameters)
    cls.check_schema(parameters)
    return cls(parameters)


def schema_validator(schema: Mapping[str, Any]) -> Any:
    """The validator of ``schema``'s closed parameters (:func:`tool_parameters`).

    Raises:
        InvalidInputError: the tool's parameters are not valid JSON Schema.
    """
    parameters = tool_parameters(schema)
    try:
        return _validator(json.dumps(parameters, sort_keys=True, ensure_ascii=False))
    except jsonschema.SchemaError as exc:
        raise InvalidInputError(
            f"the parameters of tool {schema_name(schema)!r} are not valid JSON Schema: "
            f"{exc.message}"
        ) from exc


def tool_args_error(schema: Mapping[str, Any], args: Mapping[str, Any]) -> str | None:
    """Why ``args`` do not validate against the tool ``schema`` (OpenAI format; see
    :func:`tool_parameters`), or None when they do. The one check of a call's arguments,
    whoever generated it (calibration, an agent, the server)."""
    error = jsonschema.exceptions.best_match(schema_validator(schema).iter_errors(dict(args)))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    at = f" (at {where})" if where else ""
    return (
        f"the arguments of {schema_name(schema)!r} do not match its parameters schema: "
        f"{error.message}{at}"
    )


def schema_name(schema: Mapping[str, Any]) -> str:
    """The tool name of an OpenAI-format schema."""
    return str(schema.get("function", schema).get("name", ""))
