"""Reading one response's per-token inputs for the geometry scorer.

The token vector is ``ν = (Ω, Θ, Φ^in, Φ^out) ∈ R^{8L−4}``. Ω and Θ come from the
response's ``geometry``; Φ comes from hidden states and fitted reference means (a
``ReplayResult`` with ``states``) or from ``geometry['phi_in'/'phi_out']`` written by a
model that carries the scorer's means (``model.with_reference(...)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from abstain_guard.adapters import ReferenceMeans
from abstain_guard.adapters.geometry import phi_from_states
from abstain_guard.errors import InsufficientDataError, InvalidInputError, ScoringError
from abstain_guard.metadata import ResponseMetadata
from abstain_guard.runnables import map_chat_models

__all__ = [
    "FAMILIES",
    "ReferenceInputs",
    "TokenBlock",
    "family_slices",
    "install_reference",
    "means_from_state",
    "means_state",
    "reference_inputs",
    "token_block",
]

FAMILIES: tuple[str, ...] = ("omega", "theta", "phi_in", "phi_out")
"""The four geometry families, in token-vector order."""


def family_slices(num_layers: int) -> dict[str, slice]:
    """Column ranges of Ω, Θ, Φ^in, Φ^out in the ``8L−4`` token vector."""
    k = 2 * num_layers - 1
    return {name: slice(i * k, (i + 1) * k) for i, name in enumerate(FAMILIES)}


@dataclass
class TokenBlock:
    """Per-token inputs of one response.

    Attributes:
        geometry: ``[N, 8L−4]`` (Ω, Θ, Φ^in, Φ^out).
        logprob: ``[N]`` log-probability of each generated token (EOS included when generated).
        entropy: ``[N]`` full-vocabulary entropy (NaN where the message has none).
    """

    geometry: np.ndarray
    logprob: np.ndarray
    entropy: np.ndarray


def _split_response(response: Any) -> tuple[ResponseMetadata, Any]:
    """``(metadata, states_or_None)`` of a ReplayResult, message or metadata mapping."""
    if hasattr(response, "metadata") and hasattr(response, "states"):
        meta = response.metadata
        if not isinstance(meta, Mapping):
            raise InvalidInputError("ReplayResult.metadata must be a mapping.")
        return ResponseMetadata(meta), response.states
    return ResponseMetadata.of(response), None


def _as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").float().numpy()
    return np.asarray(x, dtype=np.float64)


def token_block(
    response: Any,
    means: Any | None,
    *,
    require_states: bool = False,
) -> TokenBlock:
    """Assemble the per-token inputs of one response.

    Φ comes from the response's hidden states and ``means`` when it has states, otherwise
    from ``geometry['phi_in'/'phi_out']``.

    Raises:
        ScoringError: missing geometry, logprobs, Φ or states; inconsistent lengths;
            NaN/inf features.
        CaptureModeError: the response was captured with ``capture="fast"``.
    """
    meta, states = _split_response(response)
    geometry = meta.geometry(capture="full")  # Ω needs ω_prop: fast-capture responses refused
    omega = np.asarray(geometry.get("omega"), dtype=np.float64)
    theta = np.asarray(geometry.get("theta"), dtype=np.float64)
    n = omega.shape[0] if omega.ndim == 2 else 0
    logprob = meta.logprobs()
    if states is not None and means is not None:
        post_attn = _as_numpy(states.post_attn)
        post_mlp = _as_numpy(states.post_mlp)
        phi_in = _as_numpy(
            phi_from_states(post_attn, post_mlp, means.post_attn_in, means.post_mlp_in)
        )
        phi_out = _as_numpy(
            phi_from_states(post_attn, post_mlp, means.post_attn_out, means.post_mlp_out)
        )
    elif require_states:
        raise ScoringError(
            "Reference responses need hidden states to fit the mean directions: pass "
            "ReplayResults from model.replay(..., return_states=True)."
        )
    else:
        if geometry.get("phi_in") is None or geometry.get("phi_out") is None:
            raise ScoringError(
                "The response carries no Φ^in/Φ^out. Score messages produced by the model "
                "returned by scorer.prepare(model) (it calls model.with_reference(...)), or "
                "pass a ReplayResult with states."
            )
        phi_in = np.asarray(geometry["phi_in"], dtype=np.float64)
        phi_out = np.asarray(geometry["phi_out"], dtype=np.float64)
    if n == 0 or logprob.shape[0] == 0:
        raise ScoringError(
            "The response has no generated tokens; nothing to score. (An answer that is only "
            "an EOS token still has one token; a response with zero tokens has none.)"
        )
    parts = [omega, theta, phi_in, phi_out]
    width = omega.shape[1]
    if any(p.ndim != 2 or p.shape != (n, width) for p in parts) or logprob.shape[0] != n:
        raise ScoringError(
            "Inconsistent per-token shapes: omega "
            f"{omega.shape}, theta {theta.shape}, phi_in {phi_in.shape}, phi_out {phi_out.shape}, "
            f"logprobs {logprob.shape}. Each must have one row per generated token."
        )
    vec = np.concatenate(parts, axis=1)
    if not np.all(np.isfinite(vec)) or not np.all(np.isfinite(logprob)):
        raise ScoringError(
            "Token features contain NaN or inf (a zero-norm hidden state makes an angle "
            "undefined). This response cannot be scored by the geometry scorer."
        )
    ent = meta.entropy()
    entropy = ent if ent is not None and ent.shape == (n,) else np.full(n, np.nan, dtype=np.float64)
    return TokenBlock(geometry=vec, logprob=logprob, entropy=entropy)


@dataclass
class ReferenceInputs:
    """The reference split, read once for a geometry-family scorer's fit.

    Attributes:
        means: the reference mean directions Φ is measured against.
        blocks: one :class:`TokenBlock` per reference response (Φ with ``means``).
        labels: ``[n]`` bool, the responses' correctness.
        num_layers: L, from the token-vector width ``8L−4``.
    """

    means: ReferenceMeans
    blocks: list[TokenBlock]
    labels: np.ndarray
    num_layers: int

    def counts(self) -> dict[str, list[int]]:
        """``{"reference_responses": [correct, incorrect], "reference_tokens": [...]}``."""
        sizes = np.asarray([b.logprob.size for b in self.blocks])
        return {
            "reference_responses": [int(self.labels.sum()), int((~self.labels).sum())],
            "reference_tokens": [int(sizes[self.labels].sum()), int(sizes[~self.labels].sum())],
        }

    def tokens(self, correct: bool) -> np.ndarray:
        """``[N, 8L−4]`` token vectors of the correct (or incorrect) reference responses."""
        return np.concatenate(
            [b.geometry for b, c in zip(self.blocks, self.labels, strict=True) if c == correct]
        )


def reference_inputs(
    reference: Any,
    *,
    reference_means: ReferenceMeans | None = None,
    min_responses: int = 2,
) -> ReferenceInputs:
    """Fit the reference means (unless given) and read every reference response's tokens.

    Args:
        reference: ``(response, correct)`` pairs; each response a ReplayResult with states
            (the means are fitted from them) or, with ``reference_means``, any response
            whose geometry carries Φ computed with those means.
        reference_means: means already fitted on the reference states (calibration streams
            them from its cache, one answer in memory at a time).
        min_responses: the fewest correct and incorrect responses each.

    Raises:
        InsufficientDataError: too few correct or incorrect reference responses.
        ScoringError: a reference response lacks states (when the means are fitted here),
            geometry or log-probabilities.
        InvalidInputError: token vectors that are not ``8L−4`` wide.
    """
    ref = list(reference)
    labels = np.asarray([bool(c) for _, c in ref], dtype=bool)
    n_c = int(labels.sum())
    n_i = labels.size - n_c
    if n_c < min_responses or n_i < min_responses:
        raise InsufficientDataError(
            f"The reference split has {n_c} correct and {n_i} incorrect responses; at "
            f"least {min_responses} of each are needed to fit the mean directions and "
            "Gaussians. Use a larger reference split."
        )
    means = reference_means
    if means is None:
        states = [getattr(r, "states", None) for r, _ in ref]
        if any(s is None for s in states):
            raise ScoringError(
                "Every reference response must carry hidden states: pass ReplayResults from "
                "model.replay(..., return_states=True)."
            )
        means = ReferenceMeans.from_states(
            [s for s, c in zip(states, labels, strict=True) if c],
            [s for s, c in zip(states, labels, strict=True) if not c],
        )
        del states
    blocks = [token_block(r, means, require_states=reference_means is None) for r, _ in ref]
    width = blocks[0].geometry.shape[1]
    if (width + 4) % 8 != 0:
        raise InvalidInputError(f"Token vectors of width {width} are not 8L−4 wide.")
    return ReferenceInputs(means, blocks, labels, (width + 4) // 8)


_MEANS_PREFIX = "reference_means."


def means_state(means: ReferenceMeans) -> dict[str, np.ndarray]:
    """The means as named artifact arrays (``reference_means.<name>``)."""
    return {f"{_MEANS_PREFIX}{k}": np.asarray(v) for k, v in means.to_arrays().items()}


def means_from_state(arrays: Mapping[str, np.ndarray]) -> ReferenceMeans:
    """The means stored by :func:`means_state` among a scorer state's arrays."""
    return ReferenceMeans.from_arrays(
        {k[len(_MEANS_PREFIX) :]: v for k, v in arrays.items() if k.startswith(_MEANS_PREFIX)}
    )


def install_reference(runnable: Any, means: ReferenceMeans) -> Any:
    """``runnable`` with ``means`` installed into every GeometryChatModel inside it, so the
    messages it produces carry Φ^in/Φ^out (a geometry-family scorer's ``prepare``)."""

    def install(model: Any) -> Any:
        return model.with_reference(means) if hasattr(model, "with_reference") else model

    return map_chat_models(runnable, install)
