"""``abstain-guard serve``: the guarded model behind an OpenAI-compatible HTTP endpoint.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client, opentelemetry-api). Nothing
outside this package imports FastAPI: ``import abstain_guard`` stays light, and the CLI
imports the server lazily.
See ``docs/serving.md``.

May import: ``abstain_guard.guard``, ``abstain_guard.monitor``, ``abstain_guard.artifact``,
``abstain_guard.backends``, ``abstain_guard.adapters`` (inside the Ray replicas),
``abstain_guard.contract``, ``abstain_guard.guarantee``, ``abstain_guard.config``,
``abstain_guard.errors``, ``abstain_guard._version`` (``build_info``, the span's tracer).
"""
