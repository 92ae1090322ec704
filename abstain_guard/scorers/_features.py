"""Reading one response's per-token inputs for the geometry scorer.

The token vector is ``ν = (Ω, Θ, Φ^in, Φ^out) ∈ R^{8L−4}`` (``capture="full"``) or, for
scorers fitted on what fast capture produces, ``ν_fast = (ω_dir, Θ, Φ^in, Φ^out) ∈
R^{7L−3}`` (``capture="fast"``: no ω_prop). Ω and Θ come from the response's ``geometry``;
Φ comes from hidden states and fitted reference means (a ``ReplayResult`` with ``states``)
or from ``geometry['phi_in'/'phi_out']`` written by a model that carries the scorer's means
(``model.with_reference(...)``). The fast vector is read from a fast-capture response
(``omega_dir``) or from a full-capture one (its ω_dir columns, ``omega[:, 0::2]``).

The reference means are the adapters' :class:`~abstain_guard.adapters.ReferenceMeans`, so a
geometry scorer's means (and Φ from hidden states) need the ``local`` extra
(:func:`adapters_module`); a message that carries Φ is read with numpy alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from abstain_guard.contract.metadata import ResponseMetadata
from abstain_guard.contract.runnables import map_chat_models
from abstain_guard.errors import InsufficientDataError, InvalidInputError, ScoringError
from abstain_guard.scorers._base import optional_module

if TYPE_CHECKING:
    from abstain_guard.adapters import ReferenceMeans

FAMILIES: tuple[str, ...] = ("omega", "theta", "phi_in", "phi_out")
"""The four geometry families, in token-vector order (with ``capture="fast"`` the first is
ω_dir only)."""

CaptureMode = Literal["full", "fast"]
"""The features a scorer reads: ``"full"`` (Ω, Θ, Φ: ``8L−4`` per token) or ``"fast"``
(ω_dir, Θ, Φ: ``7L−3``; what ``GeometryChatModel(capture="fast")`` produces)."""


def adapters_module() -> ModuleType:
    """:mod:`abstain_guard.adapters` (torch), where the reference means and Φ live.

    Raises:
        MissingExtraError: torch or transformers is not installed.
    """
    return optional_module("abstain_guard.adapters", "The geometry scorers' reference means")


def _omega_width(num_layers: int, capture: CaptureMode) -> int:
    return 2 * num_layers - 1 if capture == "full" else num_layers


def feature_width(num_layers: int, capture: CaptureMode = "full") -> int:
    """Width of the token vector: ``8L−4`` (full) or ``7L−3`` (fast)."""
    return _omega_width(num_layers, capture) + 3 * (2 * num_layers - 1)


def layers_of_width(width: int, capture: CaptureMode = "full") -> int | None:
    """L such that :func:`feature_width` ``(L, capture) == width``, or None."""
    shift, step = (4, 8) if capture == "full" else (3, 7)
    return (width + shift) // step if (width + shift) % step == 0 else None


def family_slices(num_layers: int, capture: CaptureMode = "full") -> dict[str, slice]:
    """Column ranges of Ω (fast: ω_dir), Θ, Φ^in, Φ^out in the token vector."""
    k = 2 * num_layers - 1
    first = _omega_width(num_layers, capture)
    out = {"omega": slice(0, first)}
    for i, name in enumerate(FAMILIES[1:]):
        out[name] = slice(first + i * k, first + (i + 1) * k)
    return out


@dataclass
class TokenBlock:
    """Per-token inputs of one response.

    Attributes:
        geometry: ``[N, 8L−4]`` (Ω, Θ, Φ^in, Φ^out), or ``[N, 7L−3]`` (ω_dir, Θ, Φ^in,
            Φ^out) when read with ``capture="fast"``.
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


def _omega_columns(meta: ResponseMetadata, capture: CaptureMode) -> np.ndarray:
    """The response's Ω ``[N, 2L−1]`` (full) or ω_dir ``[N, L]`` (fast: ``omega_dir`` of a
    fast-capture response, the even columns of a full-capture response's Ω).

    Raises:
        CaptureModeError: ``capture="full"`` and the response was captured fast (no ω_prop).
    """
    if capture == "full":
        geometry = meta.geometry(capture="full")  # Ω needs ω_prop: fast responses refused
        return np.asarray(geometry.get("omega"), dtype=np.float64)
    geometry = meta.geometry()
    if meta.capture_mode() == "fast":
        return np.asarray(geometry.get("omega_dir"), dtype=np.float64)
    omega = np.asarray(geometry.get("omega"), dtype=np.float64)
    return omega[:, 0::2] if omega.ndim == 2 else omega


def token_block(
    response: Any,
    means: Any | None,
    *,
    require_states: bool = False,
    capture: CaptureMode = "full",
) -> TokenBlock:
    """Assemble the per-token inputs of one response.

    Φ comes from the response's hidden states and ``means`` when it has states, otherwise
    from ``geometry['phi_in'/'phi_out']``. ``capture``: the features read — ``"full"``
    (Ω, ``[N, 8L−4]``) or ``"fast"`` (ω_dir, ``[N, 7L−3]``; from a response of either
    capture mode).

    Raises:
        ScoringError: missing geometry, logprobs, Φ or states; inconsistent lengths;
            NaN/inf features.
        CaptureModeError: ``capture="full"`` and the response was captured with
            ``capture="fast"``.
    """
    meta, states = _split_response(response)
    omega = _omega_columns(meta, capture)
    geometry = meta.geometry()
    theta = np.asarray(geometry.get("theta"), dtype=np.float64)
    n = omega.shape[0] if omega.ndim == 2 else 0
    logprob = meta.logprobs()
    if states is not None and means is not None:
        from abstain_guard.adapters.capture.geometry import phi_from_states

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
    width = theta.shape[1] if theta.ndim == 2 else -1
    omega_ok = omega.shape == (n, width if capture == "full" else (width + 1) // 2)
    if (
        not omega_ok
        or any(p.ndim != 2 or p.shape != (n, width) for p in parts[1:])
        or logprob.shape[0] != n
    ):
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
        num_layers: L, from the token-vector width (``8L−4`` full, ``7L−3`` fast).
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
        """``[N, width]`` token vectors of the correct (or incorrect) reference responses."""
        return np.concatenate(
            [b.geometry for b, c in zip(self.blocks, self.labels, strict=True) if c == correct]
        )


def reference_inputs(
    reference: Any,
    *,
    reference_means: ReferenceMeans | None = None,
    min_responses: int = 2,
    capture: CaptureMode = "full",
) -> ReferenceInputs:
    """Fit the reference means (unless given) and read every reference response's tokens.

    Args:
        reference: ``(response, correct)`` pairs; each response a ReplayResult with states
            (the means are fitted from them) or, with ``reference_means``, any response
            whose geometry carries Φ computed with those means.
        reference_means: means already fitted on the reference states (calibration streams
            them from its cache, one answer in memory at a time).
        min_responses: the fewest correct and incorrect responses each.
        capture: the features read (:func:`token_block`).

    Raises:
        InsufficientDataError: too few correct or incorrect reference responses.
        ScoringError: a reference response lacks states (when the means are fitted here),
            geometry or log-probabilities.
        InvalidInputError: token vectors that are not ``8L−4`` (fast: ``7L−3``) wide.
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
        means = adapters_module().ReferenceMeans.from_states(
            [s for s, c in zip(states, labels, strict=True) if c],
            [s for s, c in zip(states, labels, strict=True) if not c],
        )
        del states
    blocks = [
        token_block(r, means, require_states=reference_means is None, capture=capture)
        for r, _ in ref
    ]
    width = blocks[0].geometry.shape[1]
    num_layers = layers_of_width(width, capture)
    if num_layers is None:
        wanted = "8L−4" if capture == "full" else "7L−3"
        raise InvalidInputError(f"Token vectors of width {width} are not {wanted} wide.")
    return ReferenceInputs(means, blocks, labels, num_layers)


_MEANS_PREFIX = "reference_means."


def means_state(means: ReferenceMeans) -> dict[str, np.ndarray]:
    """The means as named artifact arrays (``reference_means.<name>``)."""
    return {f"{_MEANS_PREFIX}{k}": np.asarray(v) for k, v in means.to_arrays().items()}


def means_from_state(arrays: Mapping[str, np.ndarray]) -> ReferenceMeans:
    """The means stored by :func:`means_state` among a scorer state's arrays.

    Raises:
        MissingExtraError: the adapters (torch) are not installed.
    """
    return adapters_module().ReferenceMeans.from_arrays(  # type: ignore[no-any-return]
        {k[len(_MEANS_PREFIX) :]: v for k, v in arrays.items() if k.startswith(_MEANS_PREFIX)}
    )


def with_capture(model: Any, capture: CaptureMode | None) -> Any:
    """``model`` generating in capture mode ``capture`` (a shallow copy sharing the weights,
    lock and scheduler when its mode differs; ``model`` itself when it has no ``capture``
    field, already captures so, or ``capture`` is None)."""
    if capture is None or getattr(model, "capture", capture) == capture:
        return model
    return model.model_copy(update={"capture": capture})


def install_reference(
    runnable: Any, means: ReferenceMeans, capture: CaptureMode | None = None
) -> Any:
    """``runnable`` with ``means`` installed into every GeometryChatModel inside it, so the
    messages it produces carry Φ^in/Φ^out (a geometry-family scorer's ``prepare``); with
    ``capture``, each such model also generates in that capture mode (:func:`with_capture`)."""

    def install(model: Any) -> Any:
        if not hasattr(model, "with_reference"):
            return model
        return with_capture(model, capture).with_reference(means)

    return map_chat_models(runnable, install)
