"""The capture a stock vLLM server returns with each response, and how the client reads it.

The connector (:mod:`.vllm_connector`) puts it in the response's ``kv_transfer_params``
under :data:`PAYLOAD_KEY`; :class:`~abstain_guard.backends.vllm_chat.VLLMChatModel` asks for
it with ``kv_transfer_params: {PAYLOAD_KEY: {}}`` and reads it with :func:`decode_capture`.
Rows travel as base64 of little-endian float32 (a JSON list of 4,096 floats would be four
times larger). Also here: the OpenAI logprobs of a response read per token
(:func:`logprob_content`). NumPy only: the client side imports neither torch nor vLLM.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from abstain_guard.errors import BackendError

__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "PAYLOAD_KEY",
    "PAYLOAD_VERSION",
    "connector_flag",
    "decode_capture",
    "encode_capture",
    "logprob_content",
    "weights_digest",
]

#: The connector's name and module (vLLM's ``--kv-transfer-config``).
CONNECTOR_NAME = "AbstainGuardConnector"
CONNECTOR_MODULE = "abstain_guard.backends.vllm_connector"

#: The key of the capture in ``kv_transfer_params`` (request and response).
PAYLOAD_KEY = "abstain_guard"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: Bumped when the payload's layout changes.
PAYLOAD_VERSION = 1


def connector_flag(layers: Sequence[int] | None = None) -> list[str]:
    """The ``vllm serve`` flag that turns the guard's capture on (``layers``: the decoder
    layers to tap; default the probe layers of
    :func:`abstain_guard.contract.metadata.probe_layers`)."""
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
    }
    if layers:
        config["kv_connector_extra_config"] = {"layers": [int(x) for x in layers]}
    return ["--kv-transfer-config", json.dumps(config)]


def _b64(rows: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<f4").tobytes()).decode("ascii")


def _rows(text: str, k: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(text), dtype="<f4")
    if k <= 0 or flat.size % k:
        raise ValueError(f"{flat.size} floats do not split into {k} layers")
    return flat.reshape(k, -1)


def encode_capture(
    layers: Sequence[int],
    last: np.ndarray,
    mean: np.ndarray,
    entropy: Sequence[float] | None,
    num_tokens: int,
) -> dict[str, Any]:
    """The payload of one response: the probe layers' last row and mean ``[K, D]``, the
    entropies of its ``num_tokens`` tokens (None when too long to keep)."""
    return {
        "version": PAYLOAD_VERSION,
        "layers": [int(x) for x in layers],
        "num_tokens": int(num_tokens),
        "last": _b64(np.asarray(last, dtype=np.float32)),
        "mean": _b64(np.asarray(np.asarray(mean, dtype=np.float64), dtype=np.float32)),
        "entropy": None if entropy is None else [float(x) for x in entropy],
    }


def decode_capture(
    params: Mapping[str, Any] | None, num_tokens: int
) -> tuple[list[float] | None, dict[str, Any] | None, Mapping[str, Any]]:
    """``(entropy, hidden, engine)`` of a response's ``kv_transfer_params``: the entropies,
    the ``geometry["hidden"]`` summary (the layout of
    :func:`abstain_guard.contract.metadata.hidden_summary`) and the server's engine record.

    Raises:
        BackendError: the server sent no capture (its ``vllm serve`` runs without the
            connector), an error instead of one, or one for another number of tokens.
    """
    got = (params or {}).get(PAYLOAD_KEY)
    if not isinstance(got, Mapping):
        raise BackendError(
            "The vLLM server returned no abstain_guard capture with the response: start "
            "`vllm serve` with the guard's connector (docs/vllm.md: --kv-transfer-config "
            "with kv_connector 'AbstainGuardConnector') in an environment where abstain-guard "
            "is installed."
        )
    engine = got.get("engine") or {}
    if got.get("error"):
        raise BackendError(f"The vLLM server could not capture this response: {got['error']}")
    if int(got.get("version", 0)) != PAYLOAD_VERSION:
        raise BackendError(
            f"The server's capture has layout version {got.get('version')}, this client reads "
            f"{PAYLOAD_VERSION}: install the same abstain-guard version on both sides."
        )
    n = int(got["num_tokens"])
    if n != num_tokens:
        raise BackendError(
            f"The server's capture covers {n} tokens but the response has {num_tokens}; was "
            "the answer cut by a stop string? The guard's capture needs the engine to stop "
            "on a token (EOS, stop_token_ids or max_tokens)."
        )
    layers = [int(x) for x in got["layers"]]
    last = _rows(got["last"], len(layers)).astype(np.float64)
    mean = _rows(got["mean"], len(layers)).astype(np.float64)
    hidden = {"layers": layers, "last": last.tolist(), "mean": mean.tolist()}
    entropy = got.get("entropy")
    return (None if entropy is None else [float(x) for x in entropy]), hidden, engine


def weights_digest(model: str | os.PathLike[str]) -> str | None:
    """sha256 over the weight files of a model folder (names, sizes and bytes, in name
    order); None for a name that is not a local folder. Cached beside the user's cache by
    path, size and modification time (a restart does not hash 100 GB again)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not files:
        return None
    stamp = json.dumps([[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files])
    key = hashlib.sha256((str(folder.resolve()) + stamp).encode()).hexdigest()[:32]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "abstain_guard"
    cached = cache / "weights" / f"{key}.sha256"
    try:
        return cached.read_text(encoding="ascii").strip()
    except OSError:
        pass
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    value = digest.hexdigest()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(value, encoding="ascii")
    except OSError:
        pass
    return value


def logprob_content(logprobs: Any, ids: Sequence[int]) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` (chat) or the completions layout, one entry per token
    with its id (the chat layout names no ids)."""
    if isinstance(logprobs, Mapping) and isinstance(logprobs.get("content"), list):
        entries = list(logprobs["content"])
    elif isinstance(logprobs, Mapping) and isinstance(logprobs.get("tokens"), list):
        tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
        entries = [
            {
                "token": t,
                "logprob": lp,
                "top_logprobs": [{"token": k, "logprob": v} for k, v in (top or {}).items()],
            }
            for t, lp, top in zip(
                logprobs["tokens"], logprobs["token_logprobs"], tops, strict=False
            )
        ]
    else:
        entries = []
    content = []
    for k, t in enumerate(ids):
        entry = entries[k] if k < len(entries) else {}
        token = str(entry.get("token", ""))
        logprob = entry.get("logprob")
        content.append(
            {
                "token": token,
                "token_id": int(t),
                "logprob": float("nan") if logprob is None else float(logprob),
                "bytes": entry.get("bytes") or list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": str(x.get("token", "")), "logprob": float(x["logprob"])}
                    for x in entry.get("top_logprobs") or []
                ],
            }
        )
    return content
