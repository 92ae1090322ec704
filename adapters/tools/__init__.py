"""Tool calling for local chat models.

* :mod:`.calls` — what the chat model uses: the formats' registry, detection from the chat
  template, forced-call prefill, parsing a reply into tool calls;
* :mod:`.formats` — how each chat-template family writes a call, and reading one;
* :mod:`.schema` — a call's arguments against the tool's JSON Schema.

May import: ``abstain_guard.contract``, ``abstain_guard.errors``.
"""
