"""Plain data containers of the adapters package (NumPy only, no torch)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from abstain_guard.errors import InsufficientDataError, InvalidInputError

from .geometry import phi_from_states


@dataclass
class TokenStates:
    """Residual-stream states at the last input position T of every generated token.

    ``post_attn [N, L, D]``: e~^l (after attention + residual, before the MLP block).
    ``post_mlp  [N, L, D]``: e^l (decoder-layer output; the last layer is NOT final-normed).
    """

    post_attn: np.ndarray
    post_mlp: np.ndarray

    def __post_init__(self) -> None:
        if self.post_attn.ndim != 3 or self.post_attn.shape != self.post_mlp.shape:
            raise InvalidInputError(
                "TokenStates needs post_attn and post_mlp of the same shape [N, L, D]; got "
                f"{self.post_attn.shape} and {self.post_mlp.shape}"
            )

    @property
    def num_tokens(self) -> int:
        """N, the number of generated tokens."""
        return int(self.post_attn.shape[0])


@dataclass
class ReplayResult:
    """What :meth:`GeometryChatModel.replay` returns for one (prompt, response) pair.

    ``metadata`` has the keys of ``AIMessage.response_metadata`` (JSON-serializable);
    ``states`` is filled only with ``return_states=True``.
    """

    metadata: dict[str, Any]
    states: TokenStates | None = None
    #: the metadata of the response cut after each requested number of tokens (certified
    #: streaming's chunk ends), from the same forward pass: what the engine's message would
    #: have been had generation stopped there (``finish_reason="partial"``)
    cuts: list[dict[str, Any]] = field(default_factory=list)


_MEAN_KEYS = ("post_attn_in", "post_mlp_in", "post_attn_out", "post_mlp_out")


@dataclass
class ReferenceMeans:
    """Per-layer mean directions for Φ^in / Φ^out (paper §4.3), each ``[L, D]``.

    ``*_in`` are means over tokens of correct reference responses, ``*_out`` over tokens
    of incorrect ones; ``post_attn`` is eta~ (mean e~^l), ``post_mlp`` is eta (mean e^l).
    """

    post_attn_in: np.ndarray
    post_mlp_in: np.ndarray
    post_attn_out: np.ndarray
    post_mlp_out: np.ndarray

    def __post_init__(self) -> None:
        shapes = {k: np.shape(getattr(self, k)) for k in _MEAN_KEYS}
        first = shapes["post_attn_in"]
        if len(first) != 2 or any(s != first for s in shapes.values()):
            raise InvalidInputError(f"ReferenceMeans arrays must all be [L, D]; got {shapes}")
        for k in _MEAN_KEYS:
            arr = np.asarray(getattr(self, k), dtype=np.float64)
            if not np.all(np.isfinite(arr)):
                raise InvalidInputError(f"ReferenceMeans.{k} contains NaN or infinite values")
            setattr(self, k, arr)

    @property
    def num_layers(self) -> int:
        """L."""
        return int(self.post_attn_in.shape[0])

    @property
    def hidden_size(self) -> int:
        """D."""
        return int(self.post_attn_in.shape[1])

    def phi(self, states: TokenStates) -> tuple[np.ndarray, np.ndarray]:
        """Φ^in and Φ^out ``[N, 2L-1]`` (float64) of ``states`` against these means
        (:func:`.geometry.phi_from_states`): what a model prepared with them returns."""
        pa, pm = states.post_attn, states.post_mlp
        return (
            phi_from_states(pa, pm, self.post_attn_in, self.post_mlp_in),
            phi_from_states(pa, pm, self.post_attn_out, self.post_mlp_out),
        )

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The four arrays by name (for ``np.savez``)."""
        return {k: np.asarray(getattr(self, k)) for k in _MEAN_KEYS}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> ReferenceMeans:
        """Inverse of :meth:`to_arrays`; raises InvalidInputError on missing keys."""
        missing = [k for k in _MEAN_KEYS if k not in arrays]
        if missing:
            raise InvalidInputError(
                f"ReferenceMeans.from_arrays: missing arrays {missing}; expected {_MEAN_KEYS}"
            )
        return cls(**{k: np.asarray(arrays[k], dtype=np.float64) for k in _MEAN_KEYS})

    @classmethod
    def from_states(
        cls,
        correct_states: Iterable[TokenStates],
        incorrect_states: Iterable[TokenStates],
    ) -> ReferenceMeans:
        """Running means over all tokens of correct (in) and incorrect (out) responses."""
        attn_in, mlp_in = _running_mean(correct_states, "correct")
        attn_out, mlp_out = _running_mean(incorrect_states, "incorrect")
        if attn_in.shape != attn_out.shape:
            raise InvalidInputError(
                f"correct and incorrect states have different [L, D]: {attn_in.shape} vs "
                f"{attn_out.shape}"
            )
        return cls(attn_in, mlp_in, attn_out, mlp_out)


def _running_mean(states: Iterable[TokenStates], which: str) -> tuple[np.ndarray, np.ndarray]:
    sum_attn: np.ndarray | None = None
    sum_mlp: np.ndarray | None = None
    count = 0
    for st in states:
        if st.num_tokens == 0:
            continue
        a = np.asarray(st.post_attn, dtype=np.float64).sum(0)
        m = np.asarray(st.post_mlp, dtype=np.float64).sum(0)
        if sum_attn is None or sum_mlp is None:
            sum_attn, sum_mlp = a, m
        else:
            if a.shape != sum_attn.shape:
                raise InvalidInputError(
                    f"{which} states disagree on [L, D]: {a.shape} vs {sum_attn.shape}"
                )
            sum_attn = sum_attn + a
            sum_mlp = sum_mlp + m
        count += st.num_tokens
    if sum_attn is None or sum_mlp is None or count == 0:
        raise InsufficientDataError(
            f"ReferenceMeans.from_states: no tokens from {which} responses; replay at least "
            f"one {which} reference response with return_states=True"
        )
    return sum_attn / count, sum_mlp / count
