"""The capture a stock vLLM server returns with each response, and how the client reads it.

The connector (:mod:`.vllm_connector`) puts it in the response's ``kv_transfer_params``
under :data:`PAYLOAD_KEY`; :class:`~abstain_guard.backends.vllm_chat.VLLMChatModel` asks for
it with ``kv_transfer_params: {PAYLOAD_KEY: {"token": request_token(key)}}`` and reads it with
:func:`decode_capture`. Rows and entropies travel as base64 of little-endian float32.

Both sides read one secret from :data:`PAYLOAD_KEY_ENV`: the server answers with activations
only a request that carries the token derived from it (the key itself never travels), and
signs every payload with HMAC-SHA256 under it; the client refuses a payload that is unsigned,
altered, or bound to other tokens than the response's (the signature covers the sha256 of
the prompt and answer token ids, so a capture cannot be moved to another response). Also
here: the OpenAI logprobs of a response read per token (:func:`logprob_content`). NumPy and
the standard library only: the client side imports neither torch nor vLLM.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from abstain_guard.errors import BackendError

#: The connector's name, module and role (vLLM's ``--kv-transfer-config``). ``kv_producer``:
#: of vLLM's roles the one with the fewest side effects (docs/vllm.md, "The connector's role").
CONNECTOR_NAME = "AbstainGuardConnector"
CONNECTOR_MODULE = "abstain_guard.backends.vllm_connector"
CONNECTOR_ROLE = "kv_producer"

#: The key of the capture in ``kv_transfer_params`` (request and response).
PAYLOAD_KEY = "abstain_guard"
#: The secret both the server's connector and the guard read (any string; 32+ random bytes).
PAYLOAD_KEY_ENV = "ABSTAIN_GUARD_PAYLOAD_KEY"
#: Bumped when the payload's layout changes.
PAYLOAD_VERSION = 2
_GENERATED: dict[str, str] = {}


def payload_key(*, generate: bool = False) -> bytes:
    """The payload secret of :data:`PAYLOAD_KEY_ENV` (``generate``: one random secret per
    process when it is unset, for a server this process starts itself).

    Raises:
        BackendError: unset and not ``generate``.
    """
    value = os.environ.get(PAYLOAD_KEY_ENV)
    if not value and generate:
        value = _GENERATED.setdefault("key", secrets.token_hex(32))
    if not value:
        raise BackendError(
            f"{PAYLOAD_KEY_ENV} is not set: the guard and the vLLM server's connector sign and "
            "check each capture with one shared secret; set the same value in both "
            "environments (e.g. `export "
            f"{PAYLOAD_KEY_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))')`)."
        )
    return value.encode("utf-8")


def request_token(key: bytes) -> str:
    """What a request carries to be answered with activations (derived from ``key``)."""
    return hmac.new(key, b"abstain_guard request", hashlib.sha256).hexdigest()


def tokens_digest(prompt_ids: Sequence[int] | None, output_ids: Sequence[int]) -> str:
    """sha256 of a response's prompt and answer token ids (what a payload is bound to)."""
    ids = [None if prompt_ids is None else [int(t) for t in prompt_ids]]
    text = json.dumps([*ids, [int(t) for t in output_ids]], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(payload: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in payload.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def sign_payload(payload: dict[str, Any], key: bytes) -> dict[str, Any]:
    """Set ``payload["signature"]``: HMAC-SHA256 under ``key`` of everything else in it."""
    payload["signature"] = hmac.new(key, _canonical(payload), hashlib.sha256).hexdigest()
    return payload


def _verify(payload: Mapping[str, Any], key: bytes) -> None:
    got = payload.get("signature")
    if not isinstance(got, str):
        raise BackendError(
            "The vLLM server's capture is unsigned: its connector is another version or the "
            "response passed through something that rewrote it; refused."
        )
    want = hmac.new(key, _canonical(payload), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(got, want):
        raise BackendError(
            "The vLLM server's capture does not carry a valid signature: it was altered, or "
            f"the server's {PAYLOAD_KEY_ENV} differs from this process's; refused."
        )


def connector_flag(layers: Sequence[int] | None = None) -> list[str]:
    """The ``vllm serve`` flag that turns the guard's capture on (``layers``: the decoder
    layers to tap; default the probe layers of
    :func:`abstain_guard.contract.metadata.probe_layers`)."""
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": CONNECTOR_ROLE,
    }
    if layers:
        config["kv_connector_extra_config"] = {"layers": [int(x) for x in layers]}
    return ["--kv-transfer-config", json.dumps(config)]


def _b64(values: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")


def _floats(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def _rows(text: str, k: int) -> np.ndarray:
    flat = _floats(text)
    if k <= 0 or flat.size % k:
        raise ValueError(f"{flat.size} floats do not split into {k} layers")
    return flat.reshape(k, -1)


def encode_capture(
    layers: Sequence[int],
    last: np.ndarray,
    mean: np.ndarray,
    entropy: Sequence[float] | np.ndarray | None,
    tokens: str,
    num_tokens: int,
) -> dict[str, Any]:
    """The payload of one response: the probe layers' last row and mean ``[K, D]``, the
    entropies of its ``num_tokens`` tokens (None when too long to keep), and ``tokens``
    (:func:`tokens_digest` of its prompt and answer)."""
    return {
        "version": PAYLOAD_VERSION,
        "layers": [int(x) for x in layers],
        "num_tokens": int(num_tokens),
        "tokens_sha256": str(tokens),
        "last": _b64(np.asarray(last, dtype=np.float32)),
        "mean": _b64(np.asarray(np.asarray(mean, dtype=np.float64), dtype=np.float32)),
        "entropy": None if entropy is None else _b64(np.asarray(entropy, dtype=np.float32)),
    }


def _payload(params: Mapping[str, Any] | None, key: bytes) -> Mapping[str, Any]:
    got = (params or {}).get(PAYLOAD_KEY)
    if not isinstance(got, Mapping):
        raise BackendError(
            "The vLLM server returned no abstain_guard capture with the response: start "
            "`vllm serve` with the guard's connector (docs/vllm.md: --kv-transfer-config "
            "with kv_connector 'AbstainGuardConnector') in an environment where abstain-guard "
            "is installed."
        )
    _verify(got, key)
    if got.get("error"):
        raise BackendError(f"The vLLM server could not capture this response: {got['error']}")
    if int(got.get("version", 0)) != PAYLOAD_VERSION:
        raise BackendError(
            f"The server's capture has layout version {got.get('version')}, this client reads "
            f"{PAYLOAD_VERSION}: install the same abstain-guard version on both sides."
        )
    return got


def decode_capture(
    params: Mapping[str, Any] | None,
    prompt_ids: Sequence[int] | None,
    output_ids: Sequence[int],
    key: bytes,
) -> tuple[list[float] | None, dict[str, Any] | None, Mapping[str, Any]]:
    """``(entropy, hidden, engine)`` of a response's ``kv_transfer_params``, checked against
    the response's prompt and answer token ids and signed under ``key``: the entropies, the
    ``geometry["hidden"]`` summary (the layout of
    :func:`abstain_guard.contract.metadata.hidden_summary`) and the server's engine record
    (with the response's LoRA adapter under ``lora``).

    Raises:
        BackendError: the server sent no capture (its ``vllm serve`` runs without the
            connector), an unsigned or altered one, an error instead of one, one for
            other tokens than the response's, or one from a LoRA adapter whose identity the
            server could not verify.
    """
    got = _payload(params, key)
    n = int(got["num_tokens"])
    if n != len(output_ids):
        raise BackendError(
            f"The server's capture covers {n} tokens but the response has {len(output_ids)}; was "
            "the answer cut by a stop string? The guard's capture needs the engine to stop "
            "on a token (EOS, stop_token_ids or max_tokens)."
        )
    if got.get("tokens_sha256") != tokens_digest(prompt_ids, output_ids):
        raise BackendError(
            "The server's capture belongs to other tokens than this response's (a response "
            "with several choices — n > 1, beam search — or a capture moved from another "
            "response); refused."
        )
    lora = got.get("lora")
    if isinstance(lora, Mapping) and not lora.get("sha256"):
        raise BackendError(
            f"The server answered with the LoRA adapter {lora.get('name')!r}, whose identity "
            "its connector could not verify (no adapter weights at its path); refused."
        )
    layers = [int(x) for x in got["layers"]]
    last = _rows(got["last"], len(layers)).astype(np.float64)
    mean = _rows(got["mean"], len(layers)).astype(np.float64)
    hidden = {"layers": layers, "last": last.tolist(), "mean": mean.tolist()}
    entropy = got.get("entropy")
    engine = {**(got.get("engine") or {}), "lora": lora}
    return (None if entropy is None else _floats(entropy).astype(float).tolist()), hidden, engine


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
