"""abstain_guard: LangChain guardrail that lets a language model say "I don't know" with a
conformal finite-sample guarantee.

Core (this package) imports neither torch nor transformers; a guard around an API chat
model that returns logprobs works with the likelihood scorers alone.

Typical use::

    from abstain_guard import AbstentionGuard, GuardConfig, default_artifact_path
    guard = AbstentionGuard.from_artifact(default_artifact_path(), chat_model,
                                          config=GuardConfig(mode="risk", risk_target=0.2))
    msg = guard.invoke("Who wrote Hamlet?")
    msg.response_metadata["abstention"]["abstained"]

Which package owns what, and which may import which: docs/architecture.md.

May import: ``abstain_guard.guard``, ``abstain_guard.monitor``, ``abstain_guard.artifact``,
``abstain_guard.contract``, ``abstain_guard.config``, ``abstain_guard.default``,
``abstain_guard._version``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from abstain_guard._version import __version__
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.contract.prompts import question_prompt
from abstain_guard.default import default_artifact_path
from abstain_guard.guard.runnable import AbstentionGuard
from abstain_guard.monitor.guard_monitor import GuardMonitor

if TYPE_CHECKING:
    from abstain_guard.guard.middleware import AbstentionMiddleware as AbstentionMiddleware


__all__ = [
    "AbstentionGuard",
    "CalibrationSet",
    "GuardArtifact",
    "GuardConfig",
    "GuardMonitor",
    "__version__",
    "default_artifact_path",
    "question_prompt",
]


# AbstentionMiddleware is exported lazily (attribute access) and kept out of __all__, so that
# neither `import abstain_guard` nor `from abstain_guard import *` needs the optional
# `agents` extra (langchain v1).
def __getattr__(name: str) -> Any:
    if name == "AbstentionMiddleware":
        from abstain_guard.guard.middleware import AbstentionMiddleware as AbstentionMiddleware

        return AbstentionMiddleware
    raise AttributeError(f"module 'abstain_guard' has no attribute {name!r}")
