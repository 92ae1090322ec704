"""Torch versions of the geometry math in :mod:`abstain_guard.adapters.capture.geometry`.

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


def mlp_proximity(post_attn: torch.Tensor, post_mlp: torch.Tensor) -> torch.Tensor:
    """``C_MLP[t, t] = prox(e[t], m[t])`` over the parts (e~[t], m[t]). ``[..., D] -> [...]``."""
    m = post_mlp - post_attn
    zn = post_mlp.abs().sum(-1)
    num_m = (zn - post_attn.abs().sum(-1)).clamp_min(0.0)  # |z - m| = |e~|
    num_a = (zn - m.abs().sum(-1)).clamp_min(0.0)  # |z - e~| = |m|
    den = num_m + num_a
    return torch.where(den > 0, num_m / den.clamp_min(_ZERO), torch.zeros_like(den))


def row_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | torch.Tensor | None,
    rows: slice,
    q_len: int,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities of the query rows ``rows``, ``[..., H, R, S_k]`` (float32).

    ``query [..., H, Q, Dh]``, ``key [..., H_kv, S_k, Dh]``; leading dims broadcast. ``mask``
    is the model's mask (bool or additive); without one, the block of ``q_len`` new
    positions is masked causally. A fully masked row (padding) comes out as NaN (all zeros
    with sinks). ``softcap``: Gemma-2's attention logit soft-capping, ``c·tanh(x / c)`` of
    the scaled scores before the mask. ``sinks [H]``: gpt-oss's per-head sink logits, one
    extra column of the softmax that is then dropped, so a row sums to less than 1 over the
    tokens (the sink takes the rest of the mass and contributes nothing to the output).
    """
    *lead, h, _, dh = query.shape
    hkv, s_k = key.shape[-3], key.shape[-2]
    n_rep = h // hkv
    r = rows.stop - rows.start
    q_rows = query[..., rows, :].float()
    scores = torch.matmul(
        q_rows.reshape(*lead, hkv, n_rep * r, dh), key.float().transpose(-1, -2)
    ).view(*lead, h, r, s_k)
    scores = scores * (scaling if scaling is not None else dh**-0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        m = mask[..., rows, :]
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.float()
    elif q_len > 1:
        q_pos = torch.arange(rows.start, rows.stop, device=scores.device)
        k_pos = torch.arange(s_k, device=scores.device) - (s_k - q_len)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().reshape(h, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
