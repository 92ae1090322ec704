"""Backends: the engines a guarded chat model generates on, and what each gives a scorer.

The one interface between scorers and engines is the set of response fields a scorer reads
(:func:`scorer_needs`) and the set a backend writes (:data:`BACKEND_FIELDS`):

============  ==========================================================================
backend       writes
============  ==========================================================================
``exact``     the project's engine (:class:`~abstain_guard.adapters.GeometryChatModel`):
              logprobs, entropy, hidden states, geometry (Ω, Θ, Φ), and re-forward passes
              for the model-based and sampling scorers
``vllm``      :class:`~abstain_guard.backends.vllm_chat.VLLMChatModel`: logprobs, entropy,
              the probe layers' hidden states, in vLLM's own batches
``api``       any other LangChain chat model: logprobs (when asked for), and the k samples
              a black-box scorer draws through it (``samples``; text only)
============  ==========================================================================

A scorer is calibrated, and deployed, only on a backend that writes what it reads;
:func:`check_backend_serves` says which one to use otherwise.

May import: ``abstain_guard.scorers``, ``abstain_guard.adapters`` (inside the vLLM chat model),
``abstain_guard.contract``, ``abstain_guard.errors``.
"""

from __future__ import annotations

from typing import Any

from abstain_guard.errors import ConfigError
from abstain_guard.scorers._registry import scorer_spec

__all__ = [
    "BACKEND_FIELDS",
    "VLLM_CHAT_MODEL",
    "backend_of_model",
    "check_backend_serves",
    "scorer_needs",
]

#: What each backend's responses carry (see the module docstring).
BACKEND_FIELDS: dict[str, frozenset[str]] = {
    "exact": frozenset({"logprobs", "entropy", "hidden", "geometry", "model"}),
    "vllm": frozenset({"logprobs", "entropy", "hidden"}),
    "api": frozenset({"logprobs", "samples"}),
}

#: The ``class_path`` of the vLLM backend's chat model (what ``backend: vllm`` builds).
VLLM_CHAT_MODEL = "abstain_guard.backends.vllm_chat:VLLMChatModel"


def scorer_needs(kind: str) -> frozenset[str]:
    """The response fields scorer ``kind`` reads, as its class declares them
    (:attr:`Scorer.reads <abstain_guard.scorers.Scorer>`; a custom scorer that declares none:
    the exact engine's)."""
    reads = scorer_spec(kind).reads
    return BACKEND_FIELDS["exact"] if reads is None else reads


def backend_of_model(model_class: Any) -> str:
    """``"vllm"`` for the vLLM backend's chat model class, else ``"api"``."""
    path = f"{getattr(model_class, '__module__', '')}:{getattr(model_class, '__qualname__', '')}"
    return "vllm" if path == VLLM_CHAT_MODEL else "api"


def check_backend_serves(kind: str, backend: str, label: str = "") -> None:
    """Raise when ``backend`` does not write what scorer ``kind`` reads.

    Raises:
        ConfigError: naming what is missing and the backend that serves the scorer.
    """
    missing = scorer_needs(kind) - BACKEND_FIELDS[backend]
    if not missing:
        return
    on = f"the {backend} backend" + (f" ({label})" if label else "")
    serves = [b for b, fields in BACKEND_FIELDS.items() if scorer_needs(kind) <= fields]
    raise ConfigError(
        f"scorer {kind!r} reads {', '.join(sorted(missing))}, which {on} does not provide; "
        f"it runs on the {' or '.join(serves)} backend"
        + (
            " (model: 'default' or a local Hugging Face folder, backend: exact)"
            if serves == ["exact"]
            else ""
        )
        + ". On vLLM use a probe or likelihood scorer (probe_mid, likelihood_probe, "
        "perplexity, ...)."
    )
