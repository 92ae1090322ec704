"""Tool calling on GeometryChatModel: the formats of adapters/tools/formats.py (detection, parsing,
prefill), the rendering of tool calls and results (adapters/engine/encoding.py), bind_tools on
tiny random models of every family with hand-written templates of each format (prompt ids,
generation record, forced calls, replay, streaming, batch, create_agent), and a few calls
of the real embedded model (marked ``model`` and ``slow``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tiny_models
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from tiny_models import FAMILIES, char_tokenizer, tiny_chat_model

from abstain_guard.adapters import GeometryChatModel
from abstain_guard.adapters.engine.encoding import ToolRendering, chat_dicts, short_id
from abstain_guard.adapters.engine.streaming import reply_chunks
from abstain_guard.adapters.tools.calls import (
    NO_TOOLS_RECORD,
    call_id,
    decode_keeping,
    normalize_tool_choice,
    parse_tool_calls,
    prompted_tool_block,
    run_seed,
    tool_prefill,
)
from abstain_guard.adapters.tools.formats import (
    FORMATS,
    HERMES,
    LLAMA3,
    MISTRAL,
    PROMPTED,
    detect_tool_call_format,
    prompted_call_text,
    template_has_tool_role,
)
from abstain_guard.adapters.tools.schema import tool_args_error
from abstain_guard.contract.deployment import sha256_text, tools_sha256
from abstain_guard.errors import InvalidInputError


@tool
def lookup_country(country: str) -> str:
    """Look up facts about a country: its capital, population and languages."""
    return f"{country}: capital Lima, population 34 million, languages Spanish and Quechua"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


SCHEMA = convert_to_openai_tool(lookup_country)
NAMES = ["lookup_country", "add"]
QUESTION = "What is the capital of Peru?"
EOS = 2  # <|im_end|> of the character tokenizer

# -- hand-written templates of each format (ChatML framing of the character tokenizer) ------

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}"
    "{%- for c in m.get('tool_calls', []) %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nEnvironment: ipython\n"
    'Answer a call as {"name": ..., "parameters": ...}\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
    "{%- for c in m['tool_calls'] %}<|python_tag|>"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|im_end|>\n"
    "{%- elif m['role'] in ['tool', 'ipython'] %}<|im_start|>ipython\n{{ m['content'] }}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{%- elif m['role'] == 'system' %}[SYS]{{ m['content'] }}[/SYS]"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') %}[TOOL_CALLS]["
    "{%- for c in m['tool_calls'] %}"
    "{%- if c['id'] | length != 9 %}{{ raise_exception('ids must have 9 characters') }}"
    "{%- endif %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
    '"id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>'
    "{%- elif m['role'] == 'assistant' %}{{ m['content'] }}<|im_end|>"
    '{%- elif m["role"] == "tool" %}[TOOL_RESULTS]{"call_id": "{{ m.tool_call_id }}", '
    '"content": {{ m.content | tojson }}}[/TOOL_RESULTS]'
    "{%- endif %}{%- endfor %}"
)

TEMPLATES = {
    HERMES: HERMES_TEMPLATE,
    LLAMA3: LLAMA3_TEMPLATE,
    MISTRAL: MISTRAL_TEMPLATE,
    PROMPTED: tiny_models.CHAT_TEMPLATE,  # takes no tools, has no tool role
}


# -- detection -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (HERMES_TEMPLATE, HERMES),
        (LLAMA3_TEMPLATE, LLAMA3),
        (MISTRAL_TEMPLATE, MISTRAL),
        (tiny_models.CHAT_TEMPLATE, PROMPTED),
        (None, PROMPTED),
        ("", PROMPTED),
        ("{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}", PROMPTED),  # no tools
        ("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}", PROMPTED),  # unknown
        ("{% if tools %}<|python_tag|>{% endif %}", LLAMA3),
        ("{% if tools %}{% endif %}{% if m.role == 'ipython' %}{% endif %}", LLAMA3),
        ("{{ tools }}[TOOL_CALLS]", MISTRAL),
    ],
)
def test_detection_is_a_function_of_the_template(template: str | None, expected: str) -> None:
    assert detect_tool_call_format(template) == expected


def test_tool_role_detection() -> None:
    assert template_has_tool_role(HERMES_TEMPLATE)
    assert template_has_tool_role(LLAMA3_TEMPLATE)
    assert not template_has_tool_role(tiny_models.CHAT_TEMPLATE)
    assert not template_has_tool_role(None)


# -- parsing ---------------------------------------------------------------------------------


def _call(name: str, args: dict[str, Any]) -> str:
    return json.dumps({"name": name, "arguments": args})


def _valid(reply: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c["name"], c["args"]) for c in reply.tool_calls]


def _invalid(reply: Any) -> list[tuple[str | None, str]]:
    return [(c["name"], c["error"]) for c in reply.invalid_tool_calls]


@pytest.mark.parametrize("fmt", [HERMES, PROMPTED])
def test_hermes_paths(fmt: str) -> None:
    one = f"<tool_call>\n{_call('add', {'a': 1, 'b': 2})}\n</tool_call>"
    reply = parse_tool_calls(one, fmt, NAMES, "seed")
    assert reply.content == "" and _valid(reply) == [("add", {"a": 1, "b": 2})]
    assert reply.invalid_tool_calls == []
    tc = reply.tool_calls[0]
    assert tc["type"] == "tool_call" and tc["id"] == call_id("seed", 0)
    assert tc["id"].startswith("call_") and len(tc["id"]) == 29

    two = f"Let me check.\n{one}\n<tool_call>{_call('lookup_country', {'country': 'Peru'})}"
    two += "</tool_call>\nDone."
    reply = parse_tool_calls(two, fmt, NAMES, "seed")
    assert reply.content == "Let me check.\n\n\nDone."
    assert _valid(reply) == [("add", {"a": 1, "b": 2}), ("lookup_country", {"country": "Peru"})]
    assert len({c["id"] for c in reply.tool_calls}) == 2

    assert parse_tool_calls("Lima is the capital.", fmt, NAMES).content == "Lima is the capital."
    assert parse_tool_calls("Lima.", fmt, NAMES).tool_calls == []

    bad = parse_tool_calls(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>', fmt, NAMES
    )
    assert bad.tool_calls == [] and _invalid(bad)[0][0] == "add"
    assert "not valid JSON" in str(_invalid(bad)[0][1])
    assert bad.invalid_tool_calls[0]["args"] == '{"name": "add", "arguments": {"a": 1,}'

    unknown = parse_tool_calls(f"<tool_call>{_call('search', {'q': 'x'})}</tool_call>", fmt, NAMES)
    assert _invalid(unknown) == [("search", unknown.invalid_tool_calls[0]["error"])]
    assert "unknown tool" in str(unknown.invalid_tool_calls[0]["error"])
    assert json.loads(str(unknown.invalid_tool_calls[0]["args"])) == {"q": "x"}

    nameless = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', fmt, NAMES)
    assert _invalid(nameless) == [(None, "the tool call has no name")]

    not_obj = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', fmt, NAMES
    )
    assert "not a JSON object" in str(_invalid(not_obj)[0][1])

    as_string = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert _valid(parse_tool_calls(as_string, fmt, NAMES)) == [("add", {"a": 1, "b": 2})]

    no_args = parse_tool_calls('<tool_call>{"name": "add"}</tool_call>', fmt, NAMES)
    assert _valid(no_args) == [("add", {})]


def test_hermes_unclosed_last_call() -> None:
    """The answer ended (EOS or budget) before ``</tool_call>``: the JSON object is read,
    what follows is text; a truncated object is an invalid call."""
    done = parse_tool_calls(f"<tool_call>\n{_call('add', {'a': 1, 'b': 2})}\n", HERMES, NAMES)
    assert _valid(done) == [("add", {"a": 1, "b": 2})] and done.content == ""
    more = parse_tool_calls(f"<tool_call>{_call('add', {'a': 1, 'b': 2})}}} ok", HERMES, NAMES)
    assert _valid(more) == [("add", {"a": 1, "b": 2})] and more.content == "} ok"
    cut = parse_tool_calls(
        '<tool_call>\n{"name": "lookup_country", "arguments": {"coun', HERMES, NAMES
    )
    assert cut.tool_calls == [] and _invalid(cut)[0][0] == "lookup_country"


def test_llama3_paths() -> None:
    one = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert _valid(parse_tool_calls(one, LLAMA3, NAMES)) == [("add", {"a": 1, "b": 2})]
    tagged = parse_tool_calls("<|python_tag|>" + one, LLAMA3, NAMES)
    assert _valid(tagged) == [("add", {"a": 1, "b": 2})] and tagged.content == ""
    two = one + '; {"name": "lookup_country", "parameters": {"country": "Peru"}}'
    assert [n for n, _ in _valid(parse_tool_calls(two, LLAMA3, NAMES))] == [
        "add",
        "lookup_country",
    ]
    before = parse_tool_calls("Checking.<|python_tag|>" + one + " That is all.", LLAMA3, NAMES)
    assert _valid(before) == [("add", {"a": 1, "b": 2})]
    assert before.content == "Checking. That is all."
    arguments_key = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert _valid(parse_tool_calls(arguments_key, LLAMA3, NAMES)) == [("add", {"a": 1, "b": 2})]

    plain = parse_tool_calls("The capital of Peru is Lima.", LLAMA3, NAMES)
    assert plain.content == "The capital of Peru is Lima." and not plain.invalid_tool_calls
    json_answer = '{"capital": "Lima"}'  # JSON that is not a call: plain text
    assert parse_tool_calls(json_answer, LLAMA3, NAMES).content == json_answer
    assert parse_tool_calls("{not json at all", LLAMA3, NAMES).invalid_tool_calls == []

    bad = parse_tool_calls('{"name": "add", "parameters": {"a": 1', LLAMA3, NAMES)
    assert bad.tool_calls == [] and _invalid(bad)[0][0] == "add"
    unknown = parse_tool_calls('{"name": "search", "parameters": {}}', LLAMA3, NAMES)
    assert "unknown tool" in str(_invalid(unknown)[0][1])
    nameless = parse_tool_calls('<|python_tag|>{"parameters": {}}', LLAMA3, NAMES)
    assert _invalid(nameless) == [(None, "the tool call has no name")]
    not_obj = parse_tool_calls('{"name": "add", "parameters": 3}', LLAMA3, NAMES)
    assert "not a JSON object" in str(_invalid(not_obj)[0][1])


def test_mistral_paths() -> None:
    one = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    reply = parse_tool_calls(one, MISTRAL, NAMES, "seed")
    assert _valid(reply) == [("add", {"a": 1, "b": 2})] and reply.content == ""
    cid = reply.tool_calls[0]["id"]
    assert cid is not None and len(cid) == 9 and cid.isalnum()  # what Mistral templates need
    two = (
        'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "lookup_country", "arguments": {"country": "Peru"}}] ok'
    )
    reply = parse_tool_calls(two, MISTRAL, NAMES)
    assert [n for n, _ in _valid(reply)] == ["add", "lookup_country"]
    assert reply.content == "Sure.  ok"
    newer = (
        '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]lookup_country[ARGS]{"country": "Peru"}'
    )
    reply = parse_tool_calls(newer, MISTRAL, NAMES)
    assert _valid(reply) == [("add", {"a": 1, "b": 2}), ("lookup_country", {"country": "Peru"})]

    assert parse_tool_calls("Lima.", MISTRAL, NAMES).content == "Lima."
    bad = parse_tool_calls('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1', MISTRAL, NAMES)
    assert bad.tool_calls == [] and _invalid(bad)[0][0] == "add"
    bad_args = parse_tool_calls("[TOOL_CALLS]add[ARGS]{oops", MISTRAL, NAMES)
    assert _invalid(bad_args)[0][0] == "add"
    unknown = parse_tool_calls('[TOOL_CALLS][{"name": "search", "arguments": {}}]', MISTRAL, NAMES)
    assert "unknown tool" in str(_invalid(unknown)[0][1])
    nameless = parse_tool_calls('[TOOL_CALLS][{"arguments": {}}]', MISTRAL, NAMES)
    assert _invalid(nameless) == [(None, "the tool call has no name")]
    not_obj = parse_tool_calls('[TOOL_CALLS][{"name": "add", "arguments": 1}]', MISTRAL, NAMES)
    assert "not a JSON object" in str(_invalid(not_obj)[0][1])
    garbage = parse_tool_calls("[TOOL_CALLS] whatever", MISTRAL, NAMES)
    assert len(garbage.invalid_tool_calls) == 1 and garbage.tool_calls == []


def test_call_ids_are_deterministic_per_run() -> None:
    assert call_id("s", 0) == call_id("s", 0) != call_id("s", 1) != call_id("t", 1)
    assert call_id(None, 0) != call_id(None, 0)  # no seed: random (uuid)
    assert len(call_id("s", 0, short=True)) == 9
    assert short_id("abcDEF123") == "abcDEF123" and len(short_id("call_xyz")) == 9


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_prompted_calls_parse_in_every_format_without_exception(fmt: str) -> None:
    """Anything at all parses (never raises)."""
    for text in ["", "{", "[TOOL_CALLS]", "<tool_call>", "<|python_tag|>", '{"name": 1}', "}]"]:
        reply = parse_tool_calls(text, fmt, NAMES)
        assert isinstance(reply.content, str)


# -- tool choice and prefill -----------------------------------------------------------------


def test_normalize_tool_choice() -> None:
    assert normalize_tool_choice(None, NAMES) is None
    assert normalize_tool_choice("none", NAMES) == "none"
    assert normalize_tool_choice(False, NAMES) == "none"
    assert normalize_tool_choice("auto", NAMES) == "auto"
    assert normalize_tool_choice("any", NAMES) == "any"
    assert normalize_tool_choice("required", NAMES) == "any"
    assert normalize_tool_choice(True, NAMES) == "any"
    assert normalize_tool_choice("add", NAMES) == "add"
    fn = {"type": "function", "function": {"name": "lookup_country"}}
    assert normalize_tool_choice(fn, NAMES) == "lookup_country"
    with pytest.raises(InvalidInputError, match="search"):
        normalize_tool_choice("search", NAMES)
    with pytest.raises(InvalidInputError):
        normalize_tool_choice({"type": "function", "function": {"name": "search"}}, NAMES)


CHOICES: list[Any] = [
    None,
    "none",
    False,
    "auto",
    "any",
    "required",
    True,
    "add",
    {"type": "function", "function": {"name": "add"}},
    {"type": "tool", "name": "add"},
    {"type": "any"},
    {"type": "none"},
]


def _recorded_choice(choice: Any) -> Any:
    """What agent calibration records as a model call's ``tool_choice``."""
    from uuid import uuid4

    from abstain_guard.calibration.building.answering.agents import OfferRecorder

    recorder = OfferRecorder()
    params = {"tools": [SCHEMA], "tool_choice": choice}
    recorder.on_chat_model_start({}, [[HumanMessage(QUESTION)]], run_id=uuid4(),
                                 invocation_params=params)  # fmt: skip
    return recorder.calls[0]["tool_choice"]


@pytest.mark.parametrize("choice", CHOICES, ids=repr)
def test_one_reading_of_tool_choice_everywhere(choice: Any) -> None:
    """The local model (applies it), agent calibration (records it) and the server (compares
    a request's with the calibrated one) read a tool_choice the same way: one function."""
    from abstain_guard.contract.tool_choice import tool_choice_name
    from abstain_guard.serve.conversation import requested_tool_choice

    applied = normalize_tool_choice(choice, NAMES)
    assert applied == tool_choice_name(choice) == _recorded_choice(choice)
    assert applied == requested_tool_choice(choice)


def test_an_unreadable_tool_choice_is_refused_by_the_model_and_the_server() -> None:
    from abstain_guard.serve.conversation import requested_tool_choice
    from abstain_guard.serve.schemas import RequestRefused

    for bad in ({"type": "function"}, 3, ""):
        with pytest.raises(InvalidInputError):
            normalize_tool_choice(bad, NAMES)
        with pytest.raises(RequestRefused) as refused:
            requested_tool_choice(bad)
        assert refused.value.status == 400 and refused.value.param == "tool_choice"


# -- arguments against the tool's schema ------------------------------------------------------


def test_arguments_that_do_not_validate_are_invalid_calls() -> None:
    """As LangChain's parsers do: a call whose arguments do not validate against its tool's
    JSON Schema is an InvalidToolCall with an error; an argument the tool does not declare
    counts (the embedded model's ``{"country": "Pepón", "type": "string"}``)."""
    schemas = [SCHEMA, convert_to_openai_tool(add)]
    cases = {
        '{"country": "Pepón", "type": "string"}': "'type' was unexpected",
        '{"country": 3}': "3 is not of type 'string' (at country)",
        "{}": "'country' is a required property",
    }
    for args, error in cases.items():
        text = prompted_call_text("lookup_country", json.loads(args))
        reply = parse_tool_calls(text, PROMPTED, NAMES, "seed", schemas=schemas)
        assert reply.tool_calls == [], args
        [bad] = reply.invalid_tool_calls
        assert bad["name"] == "lookup_country" and json.loads(bad["args"]) == json.loads(args)
        assert bad["error"] is not None and error in bad["error"], bad["error"]
        assert bad["id"] == call_id("seed", 0)
    good = prompted_call_text("lookup_country", {"country": "Peru"})
    reply = parse_tool_calls(good, PROMPTED, NAMES, "seed", schemas=schemas)
    assert [c["args"] for c in reply.tool_calls] == [{"country": "Peru"}]
    assert not reply.invalid_tool_calls
    assert tool_args_error(convert_to_openai_tool(add), {"a": 1, "b": 2}) is None
    assert "'x' is not of type 'integer'" in str(tool_args_error(schemas[1], {"a": "x", "b": 2}))


def test_a_schema_that_allows_more_arguments_is_followed() -> None:
    open_schema = {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                           "additionalProperties": True},
        },
    }  # fmt: skip
    assert tool_args_error(open_schema, {"q": "x", "lang": "en"}) is None
    no_params = {"type": "function", "function": {"name": "now"}}
    assert tool_args_error(no_params, {}) is None
    assert "unexpected" in str(tool_args_error(no_params, {"tz": "UTC"}))


def test_a_tool_whose_schema_is_not_json_schema_is_refused_when_bound(
    tiny: dict[str, GeometryChatModel],
) -> None:
    broken = {
        "type": "function",
        "function": {"name": "broken", "parameters": {"type": "object", "properties": 3}},
    }
    model = _with_template(tiny["llama"], HERMES)
    with pytest.raises(InvalidInputError, match="not valid JSON Schema"):
        model.bind_tools([broken]).invoke(QUESTION)


@pytest.mark.parametrize(
    ("fmt", "any_", "named"),
    [
        (HERMES, '<tool_call>\n{"name": "', '<tool_call>\n{"name": "add", "arguments": '),
        (PROMPTED, '<tool_call>\n{"name": "', '<tool_call>\n{"name": "add", "arguments": '),
        (LLAMA3, '{"name": "', '{"name": "add", "parameters": '),
        (MISTRAL, '[TOOL_CALLS][{"name": "', '[TOOL_CALLS][{"name": "add", "arguments": '),
    ],
)
def test_prefill_per_format(fmt: str, any_: str, named: str) -> None:
    assert tool_prefill(fmt, None) == tool_prefill(fmt, "auto") == ""
    assert tool_prefill(fmt, "any") == any_
    assert tool_prefill(fmt, "add") == named
    # a call completed after the named prefill parses
    closing = {HERMES: "}\n</tool_call>", PROMPTED: "}\n</tool_call>", LLAMA3: "}", MISTRAL: "}]"}
    reply = parse_tool_calls(named + '{"a": 1, "b": 2}' + closing[fmt], fmt, NAMES)
    assert _valid(reply) == [("add", {"a": 1, "b": 2})]


def test_prompted_block_lists_each_tool() -> None:
    schemas = [SCHEMA, convert_to_openai_tool(add)]
    block = prompted_tool_block(schemas)
    assert block == prompted_tool_block(schemas)  # pure
    for s in schemas:
        fn = s["function"]
        assert f"- {fn['name']}: {fn['description']}" in block
        assert json.dumps(fn["parameters"]) in block
    assert prompted_call_text("lookup_country", {"country": "<country>"}) in block
    assert block.endswith("If no tool is needed, answer directly.")


# -- rendering -------------------------------------------------------------------------------

CALL = {
    "name": "lookup_country",
    "args": {"country": "Peru"},
    "id": "call_abc",
    "type": "tool_call",
}


def _conversation() -> list[Any]:
    return [
        HumanMessage(QUESTION),
        AIMessage(content="", tool_calls=[CALL]),
        ToolMessage(content="Peru: capital Lima", tool_call_id="call_abc"),
    ]


def test_rendering_for_templates_with_tools() -> None:
    dicts = chat_dicts(_conversation(), None, ToolRendering(HERMES))
    assert dicts[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "id": "call_abc",
                "function": {"name": "lookup_country", "arguments": {"country": "Peru"}},
            }
        ],
    }
    assert dicts[2] == {
        "role": "tool",
        "content": "Peru: capital Lima",
        "tool_call_id": "call_abc",
        "name": "lookup_country",  # from the AI message's call of that id
    }
    mistral = chat_dicts(_conversation(), None, ToolRendering(MISTRAL))
    assert mistral[1]["tool_calls"][0]["id"] == mistral[2]["tool_call_id"] == short_id("call_abc")


def test_rendering_for_the_prompted_fallback() -> None:
    block = prompted_tool_block([SCHEMA])
    no_role = chat_dicts(_conversation(), None, ToolRendering(PROMPTED, False, block))
    assert no_role[0] == {"role": "system", "content": block}
    assert no_role[2] == {
        "role": "assistant",
        "content": prompted_call_text("lookup_country", {"country": "Peru"}),
    }
    assert no_role[3] == {
        "role": "user",
        "content": "<tool_response>\nPeru: capital Lima\n</tool_response>",
    }
    with_role = chat_dicts(_conversation(), "Be brief.", ToolRendering(PROMPTED, True, block))
    assert with_role[0] == {"role": "system", "content": "Be brief.\n\n" + block}
    assert with_role[3]["role"] == "tool"
    text = AIMessage(content="Checking.", tool_calls=[CALL])
    dicts = chat_dicts([HumanMessage("q"), text], None, ToolRendering(PROMPTED))
    assert dicts[1]["content"] == "Checking.\n" + prompted_call_text("lookup_country", CALL["args"])


def test_rendering_without_tool_messages_is_the_plain_one() -> None:
    msgs = [SystemMessage("S"), HumanMessage("Q"), AIMessage("A"), HumanMessage("Q2")]
    plain = chat_dicts(msgs, "sys")
    assert plain == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Q2"},
    ]
    for fmt in FORMATS:
        assert chat_dicts(msgs, "sys", ToolRendering(fmt)) == plain


def test_decode_keeps_special_markers() -> None:
    tok = char_tokenizer()
    tok.add_tokens(["[TOOL_CALLS]"], special_tokens=True)
    ids = tok("hi[TOOL_CALLS][1]", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "hi[1]"
    assert decode_keeping(tok, ids, ["[TOOL_CALLS]"]) == "hi[TOOL_CALLS][1]"
    assert decode_keeping(tok, [*ids, 2], ["[TOOL_CALLS]", "<tool_call>"]) == "hi[TOOL_CALLS][1]"


def test_reply_chunks_add_up_to_the_message() -> None:
    msg = AIMessage(
        content="Checking.",
        tool_calls=[CALL],
        invalid_tool_calls=[
            {
                "type": "invalid_tool_call",
                "name": "add",
                "args": '{"a": 1',
                "id": "c2",
                "error": "x",
            }
        ],
    )
    total = _sum([c.message for c in reply_chunks(msg)])
    assert total.content == msg.content and total.tool_calls == msg.tool_calls
    (inv,) = total.invalid_tool_calls
    assert (inv["name"], inv["id"], json.loads(str(inv["args"]))) == ("add", "c2", '{"a": 1')


# -- tiny models -----------------------------------------------------------------------------


def _sum(chunks: list[Any]) -> AIMessageChunk:
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    return total


#: Tool calling is prompt rendering and parsing: it does not depend on the architecture (every
#: tiny model shares one tokenizer), so five families cover it; capture on all 13 families is
#: tested in test_adapters_exactness / test_families.
TOOL_FAMILIES = FAMILIES[:5]


@pytest.fixture(scope="module")
def tiny() -> Iterator[dict[str, GeometryChatModel]]:
    """One tiny model per family, with a context long enough for tool schemas."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "CONTEXT", 1024)
        yield {f: tiny_chat_model(f, seed=1, max_new_tokens=12) for f in TOOL_FAMILIES}


def _with_template(model: GeometryChatModel, fmt: str) -> GeometryChatModel:
    model.tokenizer.chat_template = TEMPLATES[fmt]
    assert model.tool_call_format == fmt
    return model


def _decoded_prompt(model: GeometryChatModel, msg: AIMessage) -> str:
    return str(model.tokenizer.decode(msg.response_metadata["prompt_token_ids"]))


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_plain_prompt_ids_are_unchanged(tiny: dict[str, GeometryChatModel], family: str) -> None:
    """Without tools the prompt is the template of the plain role/content dicts, byte for
    byte (the shipped guard's calibration depends on those ids)."""
    model = _with_template(tiny[family], PROMPTED)
    want = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True
    )
    assert model.encode_chat(QUESTION)[0] == list(want["input_ids"])
    msg = model.invoke(QUESTION)
    assert msg.response_metadata["prompt_token_ids"] == model.encode_chat(QUESTION)[0]
    record = msg.response_metadata["generation"]
    assert {k: record[k] for k in NO_TOOLS_RECORD} == NO_TOOLS_RECORD
    assert not msg.tool_calls and not msg.invalid_tool_calls


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_bind_tools_renders_schemas_and_records_them(
    tiny: dict[str, GeometryChatModel], family: str, fmt: str
) -> None:
    model = _with_template(tiny[family], fmt)
    msg = model.bind_tools([lookup_country]).invoke(QUESTION)
    assert isinstance(msg, AIMessage)
    prompt = _decoded_prompt(model, msg)
    fn = SCHEMA["function"]
    if fmt == PROMPTED:
        assert f"- {fn['name']}: {fn['description']}" in prompt
        assert json.dumps(fn["parameters"]) in prompt
    else:
        assert json.dumps(SCHEMA) in prompt  # the template's own rendering (tojson)
    record = msg.response_metadata["generation"]
    assert record["tools_sha256"] == tools_sha256([SCHEMA])
    assert record["tool_choice"] is None
    assert record["tool_call_format"] == fmt
    want_block = sha256_text(prompted_tool_block([SCHEMA])) if fmt == PROMPTED else None
    assert record["tool_prompt_sha256"] == want_block
    assert record["system_prompt_sha256"] is None
    assert len(msg.response_metadata["geometry"]["omega"]) == len(
        msg.response_metadata["token_ids"]
    )


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("choice", ["lookup_country", "any"])
def test_forced_choice_ends_the_prompt_with_the_prefill(
    tiny: dict[str, GeometryChatModel], fmt: str, choice: str
) -> None:
    model = _with_template(tiny["qwen2"], fmt)
    msg = model.bind_tools([lookup_country, add], tool_choice=choice).invoke(QUESTION)
    prefill = tool_prefill(fmt, "any" if choice == "any" else choice)
    prefill_ids = model.tokenizer(prefill, add_special_tokens=False)["input_ids"]
    prompt = msg.response_metadata["prompt_token_ids"]
    assert prompt[-len(prefill_ids) :] == prefill_ids
    assert _decoded_prompt(model, msg).endswith(prefill)
    assert msg.response_metadata["generation"]["tool_choice"] == choice
    calls = msg.tool_calls + msg.invalid_tool_calls  # garbage from a random model
    assert calls  # the forced opening always reads as a call attempt
    if choice != "any":
        assert calls[0]["name"] == choice
    # geometry covers the generated tokens only
    assert len(msg.response_metadata["geometry"]["omega"]) == len(
        msg.response_metadata["token_ids"]
    )


@pytest.mark.parametrize("family", TOOL_FAMILIES)
def test_replay_of_a_tool_generation_reproduces_it(
    tiny: dict[str, GeometryChatModel], family: str
) -> None:
    model = _with_template(tiny[family], HERMES)
    tools = [lookup_country]
    msg = model.bind_tools(tools, tool_choice="lookup_country").invoke(QUESTION)
    meta = msg.response_metadata
    res = model.replay(QUESTION, meta["token_ids"], tools=tools, tool_choice="lookup_country")
    assert res.metadata["prompt_token_ids"] == meta["prompt_token_ids"]
    assert res.metadata["token_ids"] == meta["token_ids"]
    for key in ("omega", "theta"):
        np.testing.assert_allclose(
            np.asarray(res.metadata["geometry"][key]),
            np.asarray(meta["geometry"][key]),
            atol=1e-4,
            rtol=0,
        )
    got = [c["logprob"] for c in res.metadata["logprobs"]["content"]]
    want = [c["logprob"] for c in meta["logprobs"]["content"]]
    np.testing.assert_allclose(got, want, atol=1e-4)


def _fields(msg: AIMessage) -> tuple[Any, ...]:
    """What two runs of the same call share (message ids differ per run)."""
    return (msg.content, msg.tool_calls, msg.invalid_tool_calls, msg.response_metadata)


def _check_stream_equals_invoke(chunks: list[AIMessageChunk], ref: AIMessage) -> None:
    total = _sum(chunks)
    assert total.content == ref.content
    assert total.tool_calls == ref.tool_calls
    assert [(c["name"], c["id"]) for c in total.invalid_tool_calls] == [
        (c["name"], c["id"]) for c in ref.invalid_tool_calls
    ]
    assert [json.loads(str(c["args"])) for c in total.invalid_tool_calls] == [
        c["args"] for c in ref.invalid_tool_calls
    ]
    assert chunks[-1].chunk_position == "last"
    assert chunks[-1].response_metadata == ref.response_metadata


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("choice", [None, "lookup_country"])
def test_stream_adds_up_to_invoke_with_tools(
    tiny: dict[str, GeometryChatModel], fmt: str, choice: str | None
) -> None:
    model = _with_template(tiny["llama"], fmt)
    bound = model.bind_tools([lookup_country], tool_choice=choice)
    ref = bound.invoke(QUESTION)
    _check_stream_equals_invoke(list(bound.stream(QUESTION)), ref)

    async def main() -> list[AIMessageChunk]:
        return [c async for c in bound.astream(QUESTION)]

    _check_stream_equals_invoke(asyncio.run(main()), ref)
    assert _fields(asyncio.run(bound.ainvoke(QUESTION))) == _fields(ref)


def test_a_parsed_call_streams_as_a_tool_call_chunk() -> None:
    reply = parse_tool_calls(
        tool_prefill(HERMES, "lookup_country") + '{"country": "Peru"}}\n</tool_call>',
        HERMES,
        ["lookup_country"],
        "seed",
    )
    parsed = AIMessage(content=reply.content, tool_calls=reply.tool_calls)
    chunks = [c.message for c in reply_chunks(parsed)]
    assert len(chunks) == 1 and chunks[0].tool_call_chunks == [
        {
            "name": "lookup_country",
            "args": '{"country": "Peru"}',
            "id": call_id("seed", 0),
            "index": 0,
            "type": "tool_call_chunk",
        }
    ]
    assert _sum(chunks).tool_calls == parsed.tool_calls


def test_batch_with_tools_equals_invoke(tiny: dict[str, GeometryChatModel]) -> None:
    model = _with_template(tiny["mistral"], HERMES)
    bound = model.bind_tools([lookup_country], tool_choice="any")
    questions = [QUESTION, "How many people live in Peru?"]
    batched = bound.batch(questions)
    for q, got in zip(questions, batched, strict=True):
        assert _fields(got) == _fields(bound.invoke(q))


def test_system_prompt_hash_excludes_the_tool_block(tiny: dict[str, GeometryChatModel]) -> None:
    model = _with_template(tiny["gpt2"], PROMPTED)
    convo = [SystemMessage("You answer with one word."), HumanMessage(QUESTION)]
    plain = model.invoke(convo)
    msg = model.bind_tools([lookup_country]).invoke(convo)
    record = msg.response_metadata["generation"]
    assert record["system_prompt_sha256"] == sha256_text("You answer with one word.")
    assert (
        record["system_prompt_sha256"]
        == plain.response_metadata["generation"]["system_prompt_sha256"]
    )
    prompt = _decoded_prompt(model, msg)
    assert prompt.index("You answer with one word.") < prompt.index("- lookup_country:")


def test_tool_results_round_trip_through_rendering(tiny: dict[str, GeometryChatModel]) -> None:
    """A scripted agent turn (question, AI tool call, tool result) is rendered the
    template's way for every format, and the model answers it with the geometry captured."""
    model = tiny["qwen2"]
    expected = {
        HERMES: ['"arguments": {"country": "Peru"}', "<tool_response>\nPeru: capital Lima"],
        LLAMA3: [
            '<|python_tag|>{"name": "lookup_country", "parameters": {"country": "Peru"}}',
            "ipython\nPeru: capital Lima",
        ],
        MISTRAL: [f'"id": "{short_id("call_abc")}"', '"call_id": "' + short_id("call_abc")],
        PROMPTED: [
            prompted_call_text("lookup_country", {"country": "Peru"}),
            "user\n<tool_response>\nPeru: capital Lima\n</tool_response>",
        ],
    }
    for fmt, pieces in expected.items():
        _with_template(model, fmt)
        msg = model.bind_tools([lookup_country]).invoke(_conversation())
        prompt = _decoded_prompt(model, msg)
        for piece in pieces:
            assert piece in prompt, (fmt, piece)
        assert msg.response_metadata["geometry"] is not None
    _with_template(model, PROMPTED)


def test_bad_tool_settings_are_typed_errors(tiny: dict[str, GeometryChatModel]) -> None:
    model = _with_template(tiny["llama"], HERMES)
    with pytest.raises(InvalidInputError, match="search"):
        model.bind_tools([lookup_country], tool_choice="search")
    with pytest.raises(InvalidInputError, match="needs tools"):
        model.invoke(QUESTION, tool_choice="any")
    with pytest.raises(InvalidInputError, match="unknown generation options"):
        model.bind_tools([lookup_country], parallel_tool_calls=False, frobnicate=1).invoke("q")


def test_create_agent_runs_on_a_tiny_model(tiny: dict[str, GeometryChatModel]) -> None:
    from langchain.agents import create_agent

    model = _with_template(tiny["qwen2"], HERMES)
    agent = create_agent(model, tools=[lookup_country])
    out = agent.invoke({"messages": [HumanMessage(QUESTION)]}, {"recursion_limit": 8})
    last = out["messages"][-1]
    assert isinstance(last, AIMessage)
    assert last.response_metadata["generation"]["tools_sha256"] == tools_sha256([SCHEMA])


@contextlib.contextmanager
def scripted(model: GeometryChatModel, *replies: str) -> Iterator[None]:
    """Make the tiny model write ``replies`` (one per call, in order; then the last again)
    token by token, then EOS: a forward hook overrides the last position's logits. The
    forward itself (and so the geometry capture) runs as always."""
    scripts = [[*model.tokenizer(r, add_special_tokens=False)["input_ids"], EOS] for r in replies]
    state = {"call": -1, "step": 0}

    def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:  # a prefill: the next call begins
            state["call"] += 1
            state["step"] = 0
        script = scripts[min(state["call"], len(scripts) - 1)]
        tok = script[min(state["step"], len(script) - 1)]
        state["step"] += 1
        output.logits[:, -1, :] = -30.0
        output.logits[:, -1, tok] = 30.0

    handle = model.hf_model.register_forward_hook(hook, with_kwargs=True)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(model, "max_new_tokens", 160)
            yield
    finally:
        handle.remove()


WELL_FORMED = {
    HERMES: prompted_call_text("lookup_country", {"country": "Peru"}),  # the same syntax
    LLAMA3: '<|python_tag|>{"name": "lookup_country", "parameters": {"country": "Peru"}}',
    MISTRAL: '[TOOL_CALLS][{"name": "lookup_country", "arguments": {"country": "Peru"}}]',
    PROMPTED: prompted_call_text("lookup_country", {"country": "Peru"}),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_written_call_is_parsed_and_streamed(
    tiny: dict[str, GeometryChatModel], fmt: str
) -> None:
    model = _with_template(tiny["gemma3_text"], fmt)
    bound = model.bind_tools([lookup_country, add])
    with scripted(model, "Let me look that up.\n" + WELL_FORMED[fmt]):
        msg = bound.invoke(QUESTION)
        chunks = list(bound.stream(QUESTION))
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [
        ("lookup_country", {"country": "Peru"})
    ]
    assert msg.content == "Let me look that up."
    assert not msg.invalid_tool_calls
    cid = msg.tool_calls[0]["id"]
    assert cid == call_id(
        run_seed(msg.response_metadata["prompt_token_ids"], msg.response_metadata["token_ids"]),
        0,
        short=fmt == MISTRAL,
    )
    _check_stream_equals_invoke(chunks, msg)
    assert any(c.tool_call_chunks for c in chunks)
    n = len(msg.response_metadata["token_ids"])
    assert len(msg.response_metadata["geometry"]["omega"]) == n


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_forced_call_completed_by_the_model_is_parsed(
    tiny: dict[str, GeometryChatModel], fmt: str
) -> None:
    model = _with_template(tiny["llama"], fmt)
    bound = model.bind_tools([lookup_country, add], tool_choice="lookup_country")
    rest = {HERMES: "}\n</tool_call>", PROMPTED: "}\n</tool_call>", LLAMA3: "}", MISTRAL: "}]"}
    with scripted(model, '{"country": "Peru"}' + rest[fmt]):
        msg = bound.invoke(QUESTION)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [
        ("lookup_country", {"country": "Peru"})
    ]
    assert msg.content == ""
    # the generated tokens are only the model's part; the opening is in the prompt
    assert model.tokenizer.decode(msg.response_metadata["token_ids"], skip_special_tokens=True) == (
        '{"country": "Peru"}' + rest[fmt]
    )


def test_tool_choice_none_reads_no_call(tiny: dict[str, GeometryChatModel]) -> None:
    """``tool_choice="none"`` (OpenAI's meaning): the tools stay in the prompt, a call the
    model writes anyway is text, and the record says "none" (not the "auto" of a bare
    bind)."""
    model = _with_template(tiny["llama"], HERMES)
    call = WELL_FORMED[HERMES]
    with scripted(model, call):
        none = model.bind_tools([lookup_country], tool_choice="none").invoke(QUESTION)
        auto = model.bind_tools([lookup_country]).invoke(QUESTION)
    assert none.tool_calls == [] and none.invalid_tool_calls == []
    assert none.content == call
    assert none.response_metadata["generation"]["tool_choice"] == "none"
    assert "lookup_country" in _decoded_prompt(model, none)  # the tools are still shown
    assert [c["name"] for c in auto.tool_calls] == ["lookup_country"]
    assert auto.response_metadata["generation"]["tool_choice"] is None


def test_an_invalid_call_is_the_same_in_calibration_and_live(
    tiny: dict[str, GeometryChatModel],
) -> None:
    """A call with an argument the tool does not declare is an invalid tool call on the
    model itself, so an agent run (calibration) and a bound model (live, serve) both get
    it, with one error, and the agent never runs the tool."""
    from langchain.agents import create_agent

    from abstain_guard.calibration.building.answering.agents import run_agent

    ran: list[str] = []

    @tool
    def lookup_capital(country: str) -> str:
        """The capital city of a country."""
        ran.append(country)
        return "Lima"

    model = _with_template(tiny["qwen2"], HERMES)
    invented = prompted_call_text("lookup_capital", {"country": "Pepón", "type": "string"})
    with scripted(model, invented):
        live = model.bind_tools([lookup_capital]).invoke(QUESTION)
    with scripted(model, invented):
        run = run_agent(create_agent(model, tools=[lookup_capital]), [HumanMessage(QUESTION)], 8)
    assert live.tool_calls == [] and len(live.invalid_tool_calls) == 1
    error = live.invalid_tool_calls[0]["error"]
    assert error is not None and "'type' was unexpected" in error
    assert run.final is not None and run.final.tool_calls == []
    assert run.final.invalid_tool_calls == live.invalid_tool_calls
    assert (run.tool_calls, run.invalid_tool_calls, ran) == (0, 1, [])


def test_an_agent_round_trip_on_a_scripted_tiny_model(tiny: dict[str, GeometryChatModel]) -> None:
    """create_agent: the model calls lookup_country, the tool runs, its result is rendered
    into the next prompt the template's way, and the model answers."""
    from langchain.agents import create_agent

    model = _with_template(tiny["qwen2"], HERMES)
    agent = create_agent(model, tools=[lookup_country])
    with scripted(model, WELL_FORMED[HERMES], "Lima."):
        out = agent.invoke({"messages": [HumanMessage(QUESTION)]}, {"recursion_limit": 8})
    _, call, result, answer = out["messages"]
    assert call.tool_calls[0]["args"] == {"country": "Peru"}
    assert isinstance(result, ToolMessage) and result.tool_call_id == call.tool_calls[0]["id"]
    assert answer.content == "Lima." and not answer.tool_calls
    prompt = _decoded_prompt(model, answer)
    result_text = lookup_country.invoke({"country": "Peru"})
    assert f"<tool_response>\n{result_text}\n</tool_response>" in prompt
    assert '{"name": "lookup_country", "arguments": {"country": "Peru"}}' in prompt
    assert answer.response_metadata["generation"]["tools_sha256"] == tools_sha256([SCHEMA])


def test_structured_output_through_tool_calling(tiny: dict[str, GeometryChatModel]) -> None:
    """with_structured_output (LangChain's default: bind_tools with tool_choice="any") works
    through invoke and batch."""
    from pydantic import BaseModel

    class Capital(BaseModel):
        """The capital of a country."""

        country: str
        capital: str

    model = _with_template(tiny["llama"], HERMES)
    structured = model.with_structured_output(Capital)
    with scripted(model, 'Capital", "arguments": {"country": "Peru", "capital": "Lima"}}'):
        assert structured.invoke(QUESTION) == Capital(country="Peru", capital="Lima")
        assert structured.batch([QUESTION]) == [Capital(country="Peru", capital="Lima")]


# -- the real embedded model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def forced(default_model: GeometryChatModel) -> tuple[Any, AIMessage]:
    bound = default_model.bind_tools([lookup_country], tool_choice="lookup_country")
    return bound, bound.invoke(QUESTION)


@pytest.mark.model
@pytest.mark.slow
def test_real_model_forced_call(default_model: GeometryChatModel, forced: Any) -> None:
    """SmolLM2's template takes no tools: the prompted fallback. Forced to call
    lookup_country, it writes a call that parses with that name; its arguments are checked
    against the tool's schema (this model adds one the tool does not have, ``{"country":
    "Pepón", "type": "string"}``: an invalid call, with the schema's error)."""
    assert default_model.tool_call_format == PROMPTED
    plain = default_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True
    )
    plain_ids = list(plain["input_ids"])
    assert default_model.encode_chat(QUESTION)[0] == plain_ids  # tool-less ids unchanged
    _, msg = forced
    calls = msg.tool_calls + msg.invalid_tool_calls
    assert calls and calls[0]["name"] == "lookup_country"
    for call in msg.tool_calls:  # a valid call's arguments validate (they may be poor)
        assert tool_args_error(SCHEMA, call["args"]) is None
    for bad in msg.invalid_tool_calls:
        assert bad["error"] == tool_args_error(SCHEMA, json.loads(str(bad["args"])))
    record = msg.response_metadata["generation"]
    assert record["tool_call_format"] == PROMPTED and record["tool_choice"] == "lookup_country"
    assert record["tool_prompt_sha256"] == sha256_text(prompted_tool_block([SCHEMA]))


@pytest.mark.model
@pytest.mark.slow
def test_real_model_stream_adds_up_and_auto_never_raises(
    default_model: GeometryChatModel, forced: Any
) -> None:
    bound, ref = forced
    _check_stream_equals_invoke(list(bound.stream(QUESTION)), ref)
    auto = default_model.bind_tools([lookup_country], tool_choice="auto").invoke(QUESTION)
    assert isinstance(auto, AIMessage)
    assert auto.tool_calls or auto.invalid_tool_calls or str(auto.content).strip()
