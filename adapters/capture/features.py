"""Per-block feature assembly of a capture session: Θ, Φ, ω_dir from the rows' states (the
definitions: docs/method.md, "The quantities"), and the ``StepFeatures`` container both
capture modes return. ω_prop needs the per-source parts (:mod:`.source_parts`), which only
``"full"`` capture computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from abstain_guard.contract.metadata import probe_layers

from .geometry_torch import mlp_proximity, torch_angles

#: Capture modes: "full" (Ω, Θ, Φ; exact per-source decomposition) and "fast" (Θ, Φ and
#: ω_dir only; the attention kernel runs untouched).
CAPTURE_MODES = ("full", "fast")


@dataclass
class StepFeatures:
    """Features of the rows of one block; arrays ``[B, R, 2L-1]`` (float64).

    ``capture="full"``: ``omega`` is Ω ``[B, R, 2L-1]``. ``capture="fast"``: ``omega`` holds
    ω_dir only, ``[B, R, L]`` (ω_prop is not computed). ``post_attn``/``post_mlp``:
    ``[B, R, L, D]`` when states were kept. ``hidden``: the rows' residual stream e^l[T]
    at the probe layers (:func:`abstain_guard.contract.metadata.probe_layers`), ``[B, R, K, D]``
    float32, always kept (the probe scorers' input; a few vectors per answer).
    """

    omega: np.ndarray
    theta: np.ndarray
    phi_in: np.ndarray | None
    phi_out: np.ndarray | None
    post_attn: np.ndarray | None  # [B, R, L, D]
    post_mlp: np.ndarray | None
    capture: str = "full"
    hidden: np.ndarray | None = None

    @classmethod
    def of_rows(cls, rows: Callable[[str], np.ndarray | None], capture: str) -> StepFeatures:
        """Features without states whose arrays are ``rows(name)`` (some rows of other
        blocks: a slice, or several steps stacked)."""
        omega, theta = rows("omega"), rows("theta")
        assert omega is not None and theta is not None
        return cls(
            omega, theta, rows("phi_in"), rows("phi_out"), None, None, capture, rows("hidden")
        )


def interleave_torch(direct: torch.Tensor, prop: torch.Tensor) -> np.ndarray:
    """``direct [L, B, R]``, ``prop [L-1, B, R]`` -> ``[B, R, 2L-1]`` float64 (dir, prop, ...)."""
    n_layers = direct.shape[0]
    out = torch.empty((*direct.shape[1:], 2 * n_layers - 1), dtype=torch.float64)
    out[..., 0::2] = direct.permute(1, 2, 0).double().cpu()
    out[..., 1::2] = prop.permute(1, 2, 0).double().cpu()
    return out.numpy()


def block_features(
    post_attn: torch.Tensor,
    post_mlp: torch.Tensor,
    omega_prop: torch.Tensor | None,
    reference: dict[str, torch.Tensor] | None,
    keep_states: bool,
) -> StepFeatures:
    """Features of one block from the rows' states ``post_attn, post_mlp [L, B, R, D]``.

    ``omega_prop [L-1, B, R]`` (full capture) or None (fast capture: ``omega`` is ω_dir
    ``[B, R, L]``). ``reference``: the means ``post_attn_in``, ... as ``[L, D]`` tensors.
    """
    et, eo = post_attn.float(), post_mlp.float()
    omega_dir = torch.nan_to_num(mlp_proximity(et, eo), nan=0.0)  # [L, B, R]
    theta = interleave_torch(torch_angles(et, eo), torch_angles(eo[:-1], et[1:]))
    phi: dict[str, np.ndarray | None] = {"in": None, "out": None}
    if reference is not None:
        for side in ("in", "out"):
            eta = reference["post_mlp_" + side][:, None, None, :]  # [L, 1, 1, D]
            eta_t = reference["post_attn_" + side][1:, None, None, :]
            phi[side] = interleave_torch(torch_angles(eta, eo), torch_angles(eta_t, et[1:]))
    if omega_prop is None:
        omega = omega_dir.permute(1, 2, 0).double().cpu().numpy()
    else:
        omega = interleave_torch(omega_dir, omega_prop)

    def states(x: torch.Tensor) -> np.ndarray | None:
        return x.permute(1, 2, 0, 3).cpu().numpy().copy() if keep_states else None

    layers = torch.tensor(probe_layers(eo.shape[0]), device=eo.device)
    hidden = eo.index_select(0, layers).permute(1, 2, 0, 3).cpu().numpy().copy()
    return StepFeatures(
        omega=omega,
        theta=theta,
        phi_in=phi["in"],
        phi_out=phi["out"],
        post_attn=states(et),
        post_mlp=states(eo),
        capture="full" if omega_prop is not None else "fast",
        hidden=hidden,
    )
