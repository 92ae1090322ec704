"""Tool calling for local chat models.

* :mod:`.calls` — what the chat model uses: the formats' registry, detection from the chat
  template, forced-call prefill, parsing a reply into tool calls;
* :mod:`.formats` — how each chat-template family writes a call, and reading one;
* :mod:`.schema` — a call's arguments against the tool's JSON Schema.

The package exports what the module ``abstain_guard.adapters.tools`` exported before it
became a package.

May import: ``abstain_guard.contract``, ``abstain_guard.errors``.
"""

from __future__ import annotations

from .calls import (
    FORMATS,
    HERMES,
    LLAMA3,
    MISTRAL,
    NO_TOOLS_RECORD,
    PROMPTED,
    Found,
    ParsedReply,
    ToolCallFormat,
    ToolSetup,
    call_id,
    decode_keeping,
    detect_tool_call_format,
    normalize_tool_choice,
    parse_tool_calls,
    prompted_call_text,
    prompted_tool_block,
    run_seed,
    schema_name,
    template_has_tool_role,
    tool_args_error,
    tool_call_format,
    tool_parameters,
    tool_prefill,
    tool_setup,
    with_tool_calls,
)

__all__ = [
    "FORMATS",
    "HERMES",
    "LLAMA3",
    "MISTRAL",
    "NO_TOOLS_RECORD",
    "PROMPTED",
    "Found",
    "ParsedReply",
    "ToolCallFormat",
    "ToolSetup",
    "call_id",
    "decode_keeping",
    "detect_tool_call_format",
    "normalize_tool_choice",
    "parse_tool_calls",
    "prompted_call_text",
    "prompted_tool_block",
    "run_seed",
    "schema_name",
    "template_has_tool_role",
    "tool_args_error",
    "tool_call_format",
    "tool_parameters",
    "tool_prefill",
    "tool_setup",
    "with_tool_calls",
]
