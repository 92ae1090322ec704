"""Pure math of the geometry signals (paper §4), NumPy only: the definitions the torch
capture (:mod:`.geometry_torch`) computes online. Conventions (interleaved ``2L - 1``
trajectories, angles in radians, the safe values): docs/method.md, "Notation and shapes" and
"The quantities".
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.floating]

#: Norms at or below this count as zero vectors.
ZERO_NORM = 1e-30


def angles(x: FloatArray, y: FloatArray) -> NDArray[np.float64]:
    """Angle between ``x`` and ``y`` along the last axis, in radians.

    Shapes: ``x [..., D]``, ``y [..., D]`` (broadcast) -> ``[...]``. Zero vectors give ``pi/2``.
    """
    x64 = np.asarray(x, dtype=np.float64)
    y64 = np.asarray(y, dtype=np.float64)
    nx = np.linalg.norm(x64, axis=-1, keepdims=True)
    ny = np.linalg.norm(y64, axis=-1, keepdims=True)
    ok = (nx[..., 0] > ZERO_NORM) & (ny[..., 0] > ZERO_NORM)
    ux = x64 / np.where(nx > ZERO_NORM, nx, 1.0)
    uy = y64 / np.where(ny > ZERO_NORM, ny, 1.0)
    diff = np.linalg.norm(ux - uy, axis=-1)
    summ = np.linalg.norm(ux + uy, axis=-1)
    out = 2.0 * np.arctan2(diff, summ)
    return np.where(ok, out, np.pi / 2)


def interleave(direct: FloatArray, prop: FloatArray) -> NDArray[np.float64]:
    """Interleave ``direct [..., L]`` and ``prop [..., L-1]`` into ``[..., 2L-1]``."""
    d = np.asarray(direct, dtype=np.float64)
    p = np.asarray(prop, dtype=np.float64)
    n_layers = d.shape[-1]
    if p.shape[-1] != n_layers - 1:
        raise ValueError(f"prop must have L-1={n_layers - 1} entries, got {p.shape[-1]}")
    out = np.empty((*d.shape[:-1], 2 * n_layers - 1), dtype=np.float64)
    out[..., 0::2] = d
    out[..., 1::2] = p
    return out


def phi_from_states(
    post_attn: FloatArray, post_mlp: FloatArray, eta_tilde: FloatArray, eta: FloatArray
) -> NDArray[np.float64]:
    """Anisotropy alignment Φ (in or out, depending on the means given).

    ``phi_dir^l = angle(eta^l, e^l)``, ``phi_prop^l = angle(eta~^{l+1}, e~^{l+1})``.
    Shapes: ``post_attn [N, L, D]``, ``post_mlp [N, L, D]``, ``eta_tilde [L, D]`` (mean
    post-attention state), ``eta [L, D]`` (mean post-MLP state) -> ``[N, 2L-1]``.
    """
    pa = np.asarray(post_attn)
    pm = np.asarray(post_mlp)
    if pa.ndim != 3 or pa.shape != pm.shape:
        raise ValueError(
            f"post_attn and post_mlp must both be [N, L, D]; got {pa.shape} and {pm.shape}"
        )
    et = np.asarray(eta_tilde)
    e = np.asarray(eta)
    if et.shape != pa.shape[1:] or e.shape != pa.shape[1:]:
        raise ValueError(
            f"reference means must be [L, D]={pa.shape[1:]}; got {et.shape} and {e.shape}"
        )
    direct = angles(e[None], pm)
    prop = angles(et[None, 1:], pa[:, 1:])
    return interleave(direct, prop)
