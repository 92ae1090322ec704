"""The one reader of a chat model's ``response_metadata``: what scorers and checks read.

Every scorer, the guard's deployment checks and the calibration pipeline read a response
through :class:`ResponseMetadata`, so the keys (written by
:class:`~abstain_guard.adapters.GeometryChatModel`; an API model writes ``logprobs`` only;
docs/architecture.md, "Response metadata"), their layout and the errors for a missing or
malformed field live in one place. Accessors raise
:class:`~abstain_guard.errors.ScoringError` (the guard turns it into an abstention).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from abstain_guard.errors import (
    BackendCapabilityError,
    CaptureModeError,
    InvalidInputError,
    ScoringError,
)

LOGPROBS = "logprobs"
ENTROPY = "entropy"
TOKEN_IDS = "token_ids"
PROMPT_TOKEN_IDS = "prompt_token_ids"
GEOMETRY = "geometry"
GEOMETRY_CAPTURE = "capture"  # key inside ``geometry``: "full" or "fast"
CAPTURE_MODES = ("full", "fast")
GENERATION = "generation"
HIDDEN = "hidden"  # key inside ``geometry``: the probe layers' residual-stream summaries
BACKEND = "backend"
#: the backend name of a response without a ``backend`` record: the project's own engine
#: (:class:`~abstain_guard.adapters.GeometryChatModel`), or an API chat model
EXACT_ENGINE = "exact"
#: the question's type, set by the evaluation harness for the ``type_floor`` scorer (a chat
#: model never writes it)
QUESTION_GROUP = "question_group"

ResponseLike = Any
"""An ``AIMessage`` (or any object with ``response_metadata``) or a metadata mapping."""

_LOGPROB_TOLERANCE = 1e-6  # a log-probability above this is not one


def probe_layers(num_layers: int) -> tuple[int, int]:
    """The 0-based decoder layers whose outputs e^l the hidden-state probes read: a middle
    one (``L // 2``) and an upper one (``4L // 5``), as SAPLMA-style probes do (the very last
    layers specialise in the next token)."""
    if num_layers < 1:
        raise InvalidInputError(f"num_layers must be positive, got {num_layers}")
    return (num_layers // 2, min(num_layers - 1, (4 * num_layers) // 5))


def hidden_summary(states: np.ndarray, layers: Sequence[int]) -> dict[str, Any] | None:
    """``geometry["hidden"]`` from the per-token states at the probe layers ``[N, K, D]``
    (N generated tokens; None for N = 0): the last row and the mean over rows, as lists."""
    arr = np.asarray(states, dtype=np.float32)
    if arr.ndim != 3 or arr.shape[0] == 0:
        return None
    return {
        "layers": [int(x) for x in layers],
        "last": arr[-1].astype(np.float64).tolist(),
        "mean": arr.mean(axis=0, dtype=np.float64).astype(np.float32).astype(np.float64).tolist(),
    }


def response_metadata_of(response: ResponseLike) -> Mapping[str, Any]:
    """The ``response_metadata`` mapping of a message, or the mapping itself.

    Raises:
        InvalidInputError: if ``response`` is neither a message nor a mapping.
    """
    if isinstance(response, Mapping):
        return response
    meta = getattr(response, "response_metadata", None)
    if isinstance(meta, Mapping):
        return meta
    raise InvalidInputError(
        f"Expected an AIMessage (or a response_metadata dict), got {type(response).__name__}. "
        "Pass the message returned by the chat model."
    )


@dataclass(frozen=True)
class ResponseMetadata:
    """Typed, read-only view of one response's metadata (build it with :meth:`of`)."""

    raw: Mapping[str, Any]

    @classmethod
    def of(cls, response: ResponseLike) -> ResponseMetadata:
        """View of a message, a ``ReplayResult`` (its ``metadata``) or a mapping.

        Raises:
            ScoringError: when ``response`` carries no metadata mapping.
        """
        if isinstance(response, ResponseMetadata):
            return response
        if not isinstance(response, Mapping) and isinstance(
            getattr(response, "metadata", None), Mapping
        ):
            response = response.metadata
        try:
            return cls(response_metadata_of(response))
        except InvalidInputError as exc:  # the guard decides what an unscorable answer means
            raise ScoringError(str(exc)) from exc

    def logprob_entries(self) -> Sequence[Mapping[str, Any]]:
        """The OpenAI-style ``logprobs["content"]`` entries, one per generated token.

        Raises:
            ScoringError: no logprobs, not a content list, or no generated tokens.
        """
        logprobs = self.raw.get(LOGPROBS)
        if logprobs is None:
            raise ScoringError(
                "The response has no response_metadata['logprobs']. Ask the chat model for "
                "logprobs (for OpenAI-style APIs: logprobs=True; local GeometryChatModel "
                "always reports them)."
            )
        content = logprobs.get("content") if isinstance(logprobs, Mapping) else None
        if not isinstance(content, Sequence) or isinstance(content, (str, bytes)):
            raise ScoringError(
                "response_metadata['logprobs'] must be {'content': [{'token', 'logprob', ...}]} "
                f"(OpenAI style); got {type(logprobs).__name__} without a 'content' list."
            )
        if len(content) == 0:
            raise ScoringError(
                "The response has no generated tokens (empty logprobs content): an empty "
                "answer cannot be scored."
            )
        return content

    def logprobs(self) -> np.ndarray:
        """Log-probabilities of the generated tokens, shape ``[N]`` (N ≥ 1).

        Raises:
            ScoringError: logprobs missing, empty, not numbers, not finite, or above 0.
        """
        content = self.logprob_entries()
        values = np.empty(len(content), dtype=np.float64)
        for i, entry in enumerate(content):
            lp = entry.get("logprob") if isinstance(entry, Mapping) else None
            if isinstance(lp, bool) or not isinstance(lp, (int, float)):
                raise ScoringError(
                    f"logprobs content entry {i} has no numeric 'logprob' (got {entry!r:.80})."
                )
            values[i] = float(lp)
        bad_mask = ~np.isfinite(values) | (values > _LOGPROB_TOLERANCE)
        if bad_mask.any():
            bad = np.flatnonzero(bad_mask)[:5].tolist()
            raise ScoringError(
                f"logprobs at token positions {bad} are not finite log-probabilities (≤ 0); "
                "the response cannot be scored."
            )
        return values

    def entropy(self) -> np.ndarray | None:
        """Full-vocabulary entropy per generated token ``[N]``, or ``None`` when absent.

        Raises:
            ScoringError: the entry is not a list of numbers.
        """
        ent = self.raw.get(ENTROPY)
        if ent is None:
            return None
        try:
            return np.asarray(ent, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ScoringError("response_metadata['entropy'] must be a list of numbers.") from exc

    def token_ids(self) -> list[int]:
        """Generated token ids ``[N]``.

        Raises:
            ScoringError: the response was not produced by a local ``GeometryChatModel``.
        """
        return self._ids(TOKEN_IDS)

    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids.

        Raises:
            ScoringError: the response was not produced by a local ``GeometryChatModel``.
        """
        return self._ids(PROMPT_TOKEN_IDS)

    def _ids(self, key: str) -> list[int]:
        ids = self.raw.get(key)
        if ids is None:
            raise ScoringError(
                f"The response lacks response_metadata[{key!r}]; this scorer needs a message "
                "produced by the GeometryChatModel (abstain_guard.adapters)."
            )
        return [int(t) for t in ids]

    def geometry(self, capture: str | None = None) -> Mapping[str, Any]:
        """The per-token geometry mapping (``omega``, ``theta``, optionally ``phi_in/out``).

        ``capture``: the mode the caller's features were fitted on ("full" or "fast"); a
        response captured in the other mode is refused (None: any mode).

        Raises:
            ScoringError: the response carries no geometry.
            CaptureModeError: ``capture`` is given and the response's mode differs.
        """
        backend = self.backend_name()
        if backend != EXACT_ENGINE:
            raise BackendCapabilityError(
                f"The response was generated on the {backend} backend, which records hidden "
                "states and likelihoods but not the geometry (Ω, Θ, Φ need the attention "
                "decomposition of the project's exact engine). Score it with a probe or "
                "likelihood scorer (probe_mid, likelihood_probe, perplexity, ...), or "
                "generate with GeometryChatModel (abstain_guard.adapters) for geometry."
            )
        geometry = self.raw.get(GEOMETRY)
        if not isinstance(geometry, Mapping):
            raise ScoringError(
                "The response carries no geometry (response_metadata['geometry'] is missing). "
                "Generate it with a GeometryChatModel from abstain_guard.adapters."
            )
        if capture is not None:
            got = self.capture_mode()
            if got != capture:
                raise CaptureModeError(
                    f"The response's geometry was captured with capture={got!r}, but this "
                    f"scorer was fitted on capture={capture!r} features; the modes differ "
                    f"(fast capture has no ω_prop). Generate with GeometryChatModel("
                    f"capture={capture!r}) or use a scorer fitted on {got!r} features."
                )
        return geometry

    def hidden(self, summary: str) -> tuple[list[int], np.ndarray]:
        """``(layers, [K, D])``: the probe layers' residual stream, ``summary`` "last" or
        "mean" (``geometry["hidden"]``).

        Raises:
            ScoringError: the response has no hidden-state summary, or a malformed one.
        """
        geometry = self.raw.get(GEOMETRY)
        hidden = geometry.get(HIDDEN) if isinstance(geometry, Mapping) else None
        if not isinstance(hidden, Mapping) or summary not in hidden:
            raise ScoringError(
                "The response carries no hidden-state summary (response_metadata['geometry']"
                "['hidden']): generate it with a GeometryChatModel with capture on."
            )
        arr = np.asarray(hidden[summary], dtype=np.float64)
        if arr.ndim != 2 or not np.all(np.isfinite(arr)):
            raise ScoringError(
                f"response_metadata['geometry']['hidden'][{summary!r}] must be a finite "
                f"[K, D] array, got shape {arr.shape}."
            )
        return [int(x) for x in hidden.get("layers", [])], arr

    def capture_mode(self) -> str:
        """The capture mode of the response's geometry: "full" (also without the marker) or
        "fast".

        Raises:
            ScoringError: no geometry, or an unknown mode.
        """
        geometry = self.raw.get(GEOMETRY)
        if not isinstance(geometry, Mapping):
            raise ScoringError("The response carries no geometry; it has no capture mode.")
        mode = geometry.get(GEOMETRY_CAPTURE, "full")
        if mode not in CAPTURE_MODES:
            raise ScoringError(
                f"response_metadata['geometry']['capture'] is {mode!r}; expected one of "
                f"{CAPTURE_MODES}."
            )
        return str(mode)

    def generation(self) -> Mapping[str, Any] | None:
        """The settings the call ran with (budget, decoding, prompt hashes), if recorded."""
        gen = self.raw.get(GENERATION)
        return gen if isinstance(gen, Mapping) else None

    def backend(self) -> Mapping[str, Any] | None:
        """The record of the backend that generated the response (None: the project's
        exact engine or an API chat model, which write none)."""
        record = self.raw.get(BACKEND)
        return record if isinstance(record, Mapping) else None

    def backend_name(self) -> str:
        """``"vllm"`` for a response from the vLLM backend, :data:`EXACT_ENGINE` otherwise."""
        record = self.backend()
        return EXACT_ENGINE if record is None else str(record.get("name", "unknown"))
