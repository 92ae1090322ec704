"""Exact attention proximities ``C_Attn[T, s]`` without a per-source cache of ``u^h_s``.

For a row of interest T of one layer the parts are ``a(T, s) = 1{s=T} e^{l-1}[T] + f ⊙ Σ_h
A^h[T, s] u^h_s`` with ``u^h_s = W_O^h v^h_s`` (``f``: the frozen attention-output norm, else
1), and ``C_Attn[T, :]`` is the normalised L1 proximity of the parts to ``z = e~^l[T]``; only
the numerators ``n_s = |z|_1 - |z - a(T, s)|_1`` are needed. Three exact ways to get them:
:func:`cached_numerators` (from kept ``u``), :func:`dense_numerators` (parts materialised in
chunks of sources) and :func:`sparse_numerators` (a linear term plus corrections only where
a bound says they can be non-zero). The derivation: docs/method.md, "Generation and replay".

Shapes: ``B`` batch, ``H`` query heads, ``H_kv`` KV heads (query head ``h = j·n_rep + r``
reads KV head j), ``R`` rows, ``S`` sources, ``Dh`` head dim, ``D`` hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .geometry_torch import l1_distances

#: Relative slack on the bound β (covers float32 rounding of the computed parts).
BOUND_SLACK = 1e-3

#: Tiers of the number of coordinates computed exactly per source (then all of D).
_TIERS = (4, 16, 64, 192)


@dataclass(frozen=True)
class Rows:
    """The rows of interest of one layer: ``z = e~^l[T] [B, R, D]``, ``e_self = e^{l-1}[T]
    [B, R, D]`` (the residual term of each row's own part), ``t_idx [R]`` (the own position
    of each row in source coordinates) and ``factor [B, R, D]`` (the frozen attention-output
    norm) or None."""

    z: torch.Tensor
    e_self: torch.Tensor
    t_idx: torch.Tensor
    factor: torch.Tensor | None = None


def heads_by_query(wo_kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``W_O`` rows in query-head order: ``wo_kv [H_kv, Dh, n_rep·D]`` -> ``[H·Dh, D]``
    (a copy; a session computes it once per layer)."""
    hkv, dh, width = wo_kv.shape
    d = width // (num_heads // hkv)
    return wo_kv.view(hkv, dh, num_heads // hkv, d).permute(0, 2, 1, 3).reshape(num_heads * dh, d)


def head_max_abs(
    v: torch.Tensor, wo_kv: torch.Tensor, hidden: int, chunk: int = 256
) -> torch.Tensor:
    """``‖u^h_s‖_∞`` of source positions, ``u`` built ``chunk`` positions at a time
    (:func:`new_parts`).

    ``v [B, H_kv, Q, Dh]``, ``wo_kv [H_kv, Dh, n_rep·D]`` -> ``[B, Q, H]`` (float32).
    """
    res = [
        new_parts(v[:, :, a : a + chunk], wo_kv, hidden).abs().amax(-1).transpose(1, 2)
        for a in range(0, v.shape[2], chunk)
    ]
    return res[0] if len(res) == 1 else torch.cat(res, dim=1)


def self_parts(
    probs: torch.Tensor, v: torch.Tensor, wo_kv: torch.Tensor, rows: Rows
) -> torch.Tensor:
    """The part of each row's own position, ``e_self + f ⊙ Σ_h A^h[T, T] u^h_T``: ``[B, R, D]``.

    ``probs [B, H, R, S]``, ``v [B, H_kv, S, Dh]``.
    """
    b, h, r, _ = probs.shape
    hkv = v.shape[1]
    d = rows.e_self.shape[-1]
    t_idx = rows.t_idx
    u = torch.matmul(v[:, :, t_idx].float(), wo_kv).view(b, hkv, r, h // hkv, d)
    p = probs[:, :, torch.arange(r, device=probs.device), t_idx]  # [B, H, R]
    a = torch.einsum("bjqnd,bjnq->bqd", u, p.view(b, hkv, h // hkv, r))
    if rows.factor is not None:
        a = a * rows.factor
    return a + rows.e_self


def new_parts(v: torch.Tensor, wo_kv: torch.Tensor, hidden: int) -> torch.Tensor:
    """``u^h_s = W_O^h v^h_s`` of new positions, heads in query order (``h = j·n_rep + r``).

    ``v [B, H_kv, Q, Dh]``, ``wo_kv [H_kv, Dh, n_rep·D]`` -> ``[B, H, Q, D]`` (float32).
    """
    b, hkv, q, _ = v.shape
    u = torch.matmul(v.float(), wo_kv).view(b, hkv, q, -1, hidden)  # [B, H_kv, Q, n_rep, D]
    return u.permute(0, 1, 3, 2, 4).reshape(b, -1, q, hidden)


def cached_numerators(probs: torch.Tensor, u: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``|z|_1 - |z - a(T, s)|_1`` from the sources' kept ``u`` (:func:`new_parts`): ``[B, R, S]``.

    ``probs [B, H, R, S]``, ``u [B, H, S, D]``. The head sum is an elementwise multiply-add
    (a batched ``[1, H] @ [H, D]`` product per source is several times slower on CPU); the
    L1 distances are computed directly (small ``R``).
    """
    z = rows.z
    h = probs.shape[1]
    parts = u[:, 0, None] * probs[:, 0, :, :, None]  # [B, R, S, D]
    for k in range(1, h):
        parts.addcmul_(u[:, k, None], probs[:, k, :, :, None])
    if rows.factor is not None:
        parts = parts * rows.factor[:, :, None, :]
    at = torch.arange(parts.shape[1], device=parts.device)
    parts[:, at, rows.t_idx] += rows.e_self
    return z.abs().sum(-1, keepdim=True) - (z[:, :, None, :] - parts).abs().sum(-1)


def dense_numerators(
    probs: torch.Tensor,
    v: torch.Tensor,
    wo_kv: torch.Tensor,
    rows: Rows,
    max_chunk_elems: int = 1 << 22,
) -> torch.Tensor:
    """``|z|_1 - |z - a(T, s)|_1`` for every row and source: ``[B, R, S]``.

    Parts are materialised for a chunk of sources at a time (``u`` recomputed from ``v``),
    at most about ``max_chunk_elems`` numbers each. Arguments as in :func:`self_parts`.
    """
    z, factor = rows.z, rows.factor
    b, h, r, s = probs.shape
    hkv = v.shape[1]
    d = z.shape[-1]
    chunk = max(1, max_chunk_elems // max(1, b * d * (h + r)))
    pk = probs.view(b, hkv, h // hkv, r, s)
    zn = z.abs().sum(-1, keepdim=True)
    out = []
    for a in range(0, s, chunk):
        stop = min(s, a + chunk)
        u = torch.matmul(v[:, :, a:stop].float(), wo_kv).view(b, hkv, stop - a, h // hkv, d)
        parts = torch.einsum("bjcnd,bjnqc->bqcd", u, pk[..., a:stop])  # [B, R, c, D]
        if factor is not None:
            parts = parts * factor[:, :, None, :]
        out.append(zn - l1_distances(z, parts))
    num = out[0] if len(out) == 1 else torch.cat(out, dim=-1)
    return _with_self(num, rows, self_parts(probs, v, wo_kv, rows))


def _with_self(num: torch.Tensor, rows: Rows, a_self: torch.Tensor) -> torch.Tensor:
    """``num [B, R, S]`` with each row's own source replaced by the numerator of ``a_self``."""
    z = rows.z
    at = torch.arange(num.shape[1], device=num.device)
    own = z.abs().sum(-1) - (z - a_self).abs().sum(-1)  # [B, R]
    num[:, at, rows.t_idx] = own
    return num


def sparse_numerators(
    probs: torch.Tensor,
    v: torch.Tensor,
    unorm: torch.Tensor,
    wo_kv: torch.Tensor,
    rows: Rows,
    w_flat: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same as :func:`dense_numerators` (exactly), linear term plus sparse corrections.

    ``unorm [B, S, H]``: ``‖u^h_s‖_∞`` of every source (:func:`head_max_abs`); ``w_flat``:
    :func:`heads_by_query` of ``wo_kv`` if already at hand.
    """
    z, factor = rows.z, rows.factor
    b, h, r, s = probs.shape
    hkv, dh = v.shape[1], v.shape[3]
    d = z.shape[-1]
    sigma = torch.sign(z) if factor is None else torch.sign(z) * factor  # [B, R, D]
    zabs = z.abs()
    w4 = wo_kv.view(hkv, dh, h // hkv, d)
    g = torch.einsum("jknd,bqd->bqjnk", w4, sigma)  # W_O^h σ: [B, R, H_kv, n_rep, Dh]
    vg = torch.einsum("bjsk,bqjnk->bjnqs", v.float(), g).reshape(b, h, r, s)
    num = (vg * probs).sum(1)  # linear term [B, R, S]
    beta = torch.einsum("bhqs,bsh->bqs", probs, unorm) * (1.0 + BOUND_SLACK)
    thr = zabs if factor is None else zabs / factor.abs()  # |f_d| = 0: inf, never needed
    thr_sorted, perm = torch.sort(thr, dim=-1)
    counts = torch.searchsorted(thr_sorted.contiguous(), beta.contiguous())  # [B, R, S]
    counts[:, torch.arange(r, device=num.device), rows.t_idx] = 0
    for bi in range(b):
        for qi in range(r):
            c = counts[bi, qi]
            src = torch.nonzero(c).squeeze(-1)
            if src.numel():
                if w_flat is None:  # only where a correction is needed
                    w_flat = heads_by_query(wo_kv, h)
                num[bi, qi, src] -= 2.0 * _corrections(
                    probs[bi, :, qi, src],
                    v[bi, :, src].float(),
                    c[src],
                    w_flat,
                    sigma[bi, qi],
                    zabs[bi, qi],
                    perm[bi, qi],
                )
    return _with_self(num, rows, self_parts(probs, v, wo_kv, rows))


def _corrections(
    p: torch.Tensor,
    v: torch.Tensor,
    counts: torch.Tensor,
    w_flat: torch.Tensor,
    sigma: torch.Tensor,
    zabs: torch.Tensor,
    perm: torch.Tensor,
) -> torch.Tensor:
    """``Σ_d max(0, σ_d a_{s,d} - |z_d|)`` over the first ``counts[s]`` coordinates of
    ``perm`` (all others are 0), one row: ``p [H, n]``, ``v [H_kv, n, Dh]``, ``counts [n]``,
    ``w_flat [H·Dh, D]``, ``sigma, zabs [D]``, ``perm [D]`` -> ``[n]``."""
    h, n = p.shape
    hkv, _, dh = v.shape
    wv = (p.t().view(n, hkv, h // hkv, 1) * v.transpose(0, 1).unsqueeze(2)).reshape(n, h * dh)
    out = torch.empty(n, device=p.device)
    lo = 0
    d = sigma.shape[0]
    for k in (*_TIERS, d):
        k = min(k, d)
        sel = torch.nonzero((counts > lo) & (counts <= k)).squeeze(-1)
        lo = k
        if sel.numel() == 0:
            continue
        cols = perm[:k]
        a = wv[sel] @ (w_flat if k == d else w_flat[:, cols])  # [n_k, k]
        sg, za = (sigma, zabs) if k == d else (sigma[cols], zabs[cols])
        out[sel] = (a * sg - za).clamp_min(0.0).sum(-1)
        if lo >= d:
            break
    return out


def proximity_from_numerators(num: torch.Tensor) -> torch.Tensor:
    """Normalised L1 proximity from numerators ``[..., S]``: ``max(0, n) / Σ max(0, n)``
    (all zeros where nothing is positive)."""
    pos = num.clamp_min(0.0)
    den = pos.sum(-1, keepdim=True)
    return torch.where(den > 0, pos / den.clamp_min(1e-30), torch.zeros_like(pos))
