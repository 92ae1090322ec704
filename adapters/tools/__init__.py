"""Tool calling for local chat models.

* :mod:`.calls` — the tools bound to a call, forced-call prefill, a reply read for calls;
* :mod:`.formats` — how each chat-template family writes a call, detection from the chat
  template, and reading one;
* :mod:`.schema` — a call's arguments against the tool's JSON Schema.

May import: ``abstain_guard.contract``, ``abstain_guard.errors``.
"""
