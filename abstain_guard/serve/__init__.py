"""``abstain-guard serve``: the guarded model behind an OpenAI-compatible HTTP endpoint.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client). Nothing outside this package
imports FastAPI: ``import abstain_guard`` stays light, and the CLI imports the server lazily.
See ``docs/serving.md``.

May import: ``abstain_guard.guard``, ``abstain_guard.monitor``, ``abstain_guard.artifact``,
``abstain_guard.backends``, ``abstain_guard.adapters`` (inside the Ray replicas),
``abstain_guard.contract``, ``abstain_guard.guarantee``, ``abstain_guard.config``,
``abstain_guard.errors``.
"""

from __future__ import annotations

from abstain_guard.serve.app import create_app
from abstain_guard.serve.passthrough import ModelService
from abstain_guard.serve.ray_serve import ReplicaServer, ReplicaSpec
from abstain_guard.serve.runner import ServerThread, serve
from abstain_guard.serve.schemas import RequestLimits, RequestRefused
from abstain_guard.serve.service import GuardedAnswer, GuardService

__all__ = [
    "GuardService",
    "GuardedAnswer",
    "ModelService",
    "ReplicaServer",
    "ReplicaSpec",
    "RequestLimits",
    "RequestRefused",
    "ServerThread",
    "create_app",
    "serve",
]
