"""The ``response_metadata`` a GeometryChatModel writes (generation and replay alike).

Keys and layout (read back by :class:`abstain_guard.contract.metadata.ResponseMetadata`)::

    model_name, finish_reason ("stop" | "length"), prompt_token_ids, token_ids [N],
    tokens [N], logprobs = {"content": [{token, token_id, logprob, bytes, top_logprobs}]},
    entropy [N] (nats, full vocabulary),
    geometry = {capture, num_layers, omega, theta, phi_in, phi_out} (each [N, 2L-1] or
        None; capture "full", or "fast": omega None and omega_dir [N, L] instead),
        and hidden = {layers, last, mean} ([K, D] each: the probe layers' residual stream),
    generation (generation only: the call's settings, with the model's dtype and device
        type from :func:`numerics_record`), replay_source (replay only)

:func:`token_metadata` writes everything but ``geometry``, ``generation`` and
``replay_source``, which the caller adds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from abstain_guard.contract.metadata import (
    ENTROPY,
    GEOMETRY_CAPTURE,
    HIDDEN,
    LOGPROBS,
    PROMPT_TOKEN_IDS,
    TOKEN_IDS,
    hidden_summary,
    probe_layers,
)

from ..capture.features import StepFeatures
from .kernels import kernel_facts


def token_metadata(
    tokenizer: Any,
    model_name: str,
    prompt: list[int],
    ids: list[int],
    logits: torch.Tensor,
    finish: str,
    top_k: int,
) -> dict[str, Any]:
    """Per-token metadata of ``ids`` from the ``logits [N, V]`` that predicted them.

    ``top_k`` alternatives per token go into ``top_logprobs`` (0: none).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)
    tokens = [tokenizer.decode([t]) for t in ids]
    content = []
    if ids:
        chosen = logp[torch.arange(len(ids)), torch.tensor(ids)].tolist()
        top_vals, top_idx = (
            logp.topk(min(top_k, logp.shape[-1]), dim=-1) if top_k > 0 else (None, None)
        )
        for k, (t, s) in enumerate(zip(ids, tokens, strict=True)):
            tops = []
            if top_vals is not None and top_idx is not None:
                tops = [
                    {"token": tokenizer.decode([int(j)]), "logprob": float(v)}
                    for v, j in zip(top_vals[k].tolist(), top_idx[k].tolist(), strict=True)
                ]
            content.append(
                {
                    "token": s,
                    "token_id": t,
                    "logprob": float(chosen[k]),
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": tops,
                }
            )
    return {
        "model_name": model_name,
        "finish_reason": finish,
        PROMPT_TOKEN_IDS: list(prompt),
        TOKEN_IDS: list(ids),
        "tokens": tokens,
        LOGPROBS: {"content": content},
        ENTROPY: [float(e) for e in entropy.tolist()],
    }


def numerics_record(hf_model: Any) -> dict[str, Any]:
    """How a loaded model computes: ``{"dtype": "bfloat16", "device_type": "cuda",
    "kernels": {...}}`` (the
    dtype of its floating-point weights without the ``torch.`` prefix; the device type of
    its first parameter, the same for every part of a model split with ``device_map``
    across GPUs). Goes into the generation record and the calibration's deployment record
    (:data:`abstain_guard.contract.deployment.NUMERICS_KEYS`); ``kernels``: the kernel facts of this
    process for that device (:func:`.kernels.kernel_facts`)."""
    first = next((p for p in hf_model.parameters() if p.dtype.is_floating_point), None)
    dtype = torch.float32 if first is None else first.dtype
    device = torch.device("cpu") if first is None else first.device
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "device_type": device.type,
        "kernels": kernel_facts(device),
    }


def geometry_json(
    num_layers: int, geo: StepFeatures | None, capture: str = "full"
) -> dict[str, Any]:
    """``metadata["geometry"]``: the ``[N, 2L-1]`` arrays of ``geo`` as float lists
    (``geo=None``: no tokens, empty arrays), with the capture mode (``geo.capture`` when
    given). Fast capture has no ω_prop: ``omega`` is None and ``omega_dir`` holds ω_dir
    ``[N, L]``, so nothing can read it as Ω."""

    def lst(x: np.ndarray | None) -> list[list[float]] | None:
        return None if x is None else np.asarray(x, dtype=np.float64).tolist()

    mode = geo.capture if geo is not None else capture
    if geo is None:
        empty: dict[str, Any] = {"omega": None, "omega_dir": []} if mode == "fast" else {}
        return {
            GEOMETRY_CAPTURE: mode,
            "num_layers": num_layers,
            "omega": [],
            "theta": [],
            "phi_in": None,
            "phi_out": None,
            **empty,
        }
    if mode == "fast":
        omega: dict[str, Any] = {"omega": None, "omega_dir": lst(geo.omega)}
    else:
        omega = {"omega": lst(geo.omega)}
    hidden = None if geo.hidden is None else hidden_summary(geo.hidden, probe_layers(num_layers))
    return {
        GEOMETRY_CAPTURE: mode,
        "num_layers": num_layers,
        **omega,
        "theta": lst(geo.theta),
        "phi_in": lst(geo.phi_in),
        "phi_out": lst(geo.phi_out),
        HIDDEN: hidden,
    }
