"""abstain_guard: LangChain guardrail that lets a language model say "I don't know" with a
conformal finite-sample guarantee.

Core (this package) imports neither torch nor transformers; a guard around an API chat
model that returns logprobs works with the likelihood scorers alone.

Typical use::

    from abstain_guard import AbstentionGuard, GuardArtifact, GuardConfig
    guard = AbstentionGuard.from_artifact("guard/", chat_model,
                                          config=GuardConfig(mode="risk", risk_target=0.2))
    msg = guard.invoke("Who wrote Hamlet?")
    msg.response_metadata["abstention"]["abstained"]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from abstain_guard import conformal, deprecated_paths, errors
from abstain_guard._version import __version__
from abstain_guard.artifact import GuardArtifact
from abstain_guard.config import GuardConfig
from abstain_guard.decision import DecisionRule
from abstain_guard.default import default_artifact_path
from abstain_guard.guard import AbstentionGuard
from abstain_guard.metadata import ResponseMetadata
from abstain_guard.monitor import GuardMonitor
from abstain_guard.policy import AbstentionPolicy
from abstain_guard.prompts import question_prompt
from abstain_guard.scorers import (
    MaxSequenceProbabilityScorer,
    MeanTokenEntropyScorer,
    PerplexityScorer,
    Scorer,
    ScorerState,
    build_scorer,
    register_scorer,
    scorer_names,
)

# Old import paths (abstain_guard.scoring, abstain_guard.likelihood,
# abstain_guard.calibration.inference.*) keep working for one release, with a DeprecationWarning.
deprecated_paths.install()

if TYPE_CHECKING:
    from abstain_guard.middleware import AbstentionMiddleware as AbstentionMiddleware


__all__ = [
    "AbstentionGuard",
    "AbstentionPolicy",
    "DecisionRule",
    "GuardArtifact",
    "GuardConfig",
    "GuardMonitor",
    "MaxSequenceProbabilityScorer",
    "MeanTokenEntropyScorer",
    "PerplexityScorer",
    "ResponseMetadata",
    "Scorer",
    "ScorerState",
    "__version__",
    "build_scorer",
    "conformal",
    "default_artifact_path",
    "errors",
    "question_prompt",
    "register_scorer",
    "scorer_names",
]


# AbstentionMiddleware is exported lazily (attribute access) and kept out of __all__, so that
# neither `import abstain_guard` nor `from abstain_guard import *` needs the optional
# `agents` extra (langchain v1).
def __getattr__(name: str) -> Any:
    if name == "AbstentionMiddleware":
        from abstain_guard.middleware import AbstentionMiddleware as AbstentionMiddleware

        return AbstentionMiddleware
    raise AttributeError(f"module 'abstain_guard' has no attribute {name!r}")
