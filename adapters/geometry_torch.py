"""Torch versions of the geometry math in :mod:`abstain_guard.adapters.geometry`.

:class:`~abstain_guard.adapters.capture.CaptureSession` computes the signals online with
these (float32, on the model's device); the NumPy functions define them and the exactness
tests compare the two. Same conventions: angles in radians, ``pi/2`` for a zero vector,
an all-zero proximity row when its normaliser is zero.
"""

from __future__ import annotations

import math

import torch

#: Norms at or below this count as zero vectors.
_ZERO = 1e-30


def torch_angles(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Stable angle along the last axis, pi/2 when a vector is zero. ``[..., D] -> [...]``."""
    nx = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    ny = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
    ux = x / nx.clamp_min(_ZERO)
    uy = y / ny.clamp_min(_ZERO)
    ang = 2.0 * torch.atan2(
        torch.linalg.vector_norm(ux - uy, dim=-1), torch.linalg.vector_norm(ux + uy, dim=-1)
    )
    ok = (nx[..., 0] > _ZERO) & (ny[..., 0] > _ZERO)
    return torch.where(ok, ang, torch.full_like(ang, math.pi / 2))


def l1_distances(z: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """``|z - parts_i|_1`` (fused, no temporaries).

    ``z [..., D]``, ``parts [..., n, D]`` -> ``[..., n]``."""
    lead = parts.shape[:-2]
    n, d = parts.shape[-2], parts.shape[-1]
    dist = torch.cdist(z.reshape(-1, 1, d), parts.reshape(-1, n, d), p=1.0)
    return dist.reshape(*lead, n)


def torch_proximity(z: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """Normalised L1 proximity. ``z [..., D]``, ``parts [..., n, D]`` -> ``[..., n]``."""
    zn = z.abs().sum(-1, keepdim=True)
    num = (zn - l1_distances(z, parts)).clamp_min(0.0)
    den = num.sum(-1, keepdim=True)
    return torch.where(den > 0, num / den.clamp_min(_ZERO), torch.zeros_like(num))


def mlp_proximity(post_attn: torch.Tensor, post_mlp: torch.Tensor) -> torch.Tensor:
    """``C_MLP[t, t] = prox(e[t], m[t])`` over the parts (e~[t], m[t]). ``[..., D] -> [...]``."""
    m = post_mlp - post_attn
    zn = post_mlp.abs().sum(-1)
    num_m = (zn - post_attn.abs().sum(-1)).clamp_min(0.0)  # |z - m| = |e~|
    num_a = (zn - m.abs().sum(-1)).clamp_min(0.0)  # |z - e~| = |m|
    den = num_m + num_a
    return torch.where(den > 0, num_m / den.clamp_min(_ZERO), torch.zeros_like(den))


__all__ = ["l1_distances", "mlp_proximity", "torch_angles", "torch_proximity"]
