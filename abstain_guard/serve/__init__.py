"""``abstain-guard serve``: the guarded model behind an OpenAI-compatible HTTP endpoint.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client). Nothing outside this package
imports FastAPI: ``import abstain_guard`` stays light, and the CLI imports the server lazily.
See ``docs/serving.md``.
"""

from __future__ import annotations
