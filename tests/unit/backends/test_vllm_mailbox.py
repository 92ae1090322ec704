"""The vLLM connector's scheduler-side bookkeeping (:class:`CaptureMailbox`), driven in the
order vLLM calls it, without an engine: each response carries its own request's capture or
an error the client refuses (the guard then fails closed), never another request's capture;
what waits is bounded; every payload is signed, and one unsigned, altered, bound to other
tokens or asked for without the server's token gives no activations."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from abstain_guard.backends.vllm_mailbox import NO_CAPTURE, NOT_AUTHORIZED, CaptureMailbox
from abstain_guard.backends.vllm_payload import (
    PAYLOAD_KEY,
    PAYLOAD_KEY_ENV,
    connector_flag,
    decode_capture,
    encode_capture,
    payload_key,
    request_token,
    sign_payload,
    tokens_digest,
)
from abstain_guard.errors import BackendError

ENGINE = {"vllm": "test", "capture_path": "compiled_tap_kv_connector"}
KEY = b"server and guard secret"
PROMPT, ANSWER = [1, 2, 3], [7, 8, 9]
SIGN = functools.partial(sign_payload, key=KEY)


def _capture(seed: int, num_tokens: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    last, mean = rng.normal(size=(1, 8)), rng.normal(size=(1, 8))
    digest = tokens_digest(PROMPT, ANSWER[:num_tokens])
    return encode_capture([5], last, mean, [0.1 * seed] * num_tokens, digest, num_tokens)


def _read(payload: dict | None, num_tokens: int = 3, key: bytes = KEY) -> tuple:
    return decode_capture({PAYLOAD_KEY: payload}, PROMPT, ANSWER[:num_tokens], key)


def test_a_capture_arriving_after_its_request_finished_fills_that_response() -> None:
    box = CaptureMailbox(ENGINE, SIGN)
    box.want("a")
    box.want("b", entropy=False)
    assert box.take_new() == {"a": True, "b": False} and box.take_new() == {}
    payload = box.finished("a")  # vLLM hands finished requests over before the step's output
    assert payload is not None and payload["error"] == NO_CAPTURE
    box.arrive({"a": _capture(1)})
    entropy, hidden, engine = _read(payload)
    assert entropy == pytest.approx([0.1] * 3) and engine == {**ENGINE, "lora": None}
    assert hidden is not None and hidden["layers"] == [5]
    assert box.waiting == (0, 0)


def test_a_capture_arriving_first_waits_for_its_request() -> None:
    box = CaptureMailbox(ENGINE, SIGN)
    box.want("a")
    box.arrive({"a": _capture(2)})
    assert box.waiting == (0, 1)
    entropy, _, _ = _read(box.finished("a"))
    assert entropy == pytest.approx([0.2] * 3)
    assert box.waiting == (0, 0)


def test_a_request_that_asked_for_no_capture_gets_none() -> None:
    box = CaptureMailbox(ENGINE, SIGN)
    assert box.finished("other") is None
    box.want("a")
    box.finished("a")
    assert box.finished("a") is None  # handed over once


def test_an_aborted_request_is_refused_by_the_client() -> None:
    """vLLM finishes an aborted request (client gone, or cut by a stop string) without its
    worker sampling a last token: no capture ever arrives, and the response says so."""
    box = CaptureMailbox(ENGINE, SIGN)
    box.want("aborted")
    payload = box.finished("aborted")
    box.arrive({})  # the step's worker output has nothing for it
    with pytest.raises(BackendError, match="aborted"):
        _read(payload)


def test_an_evicted_response_keeps_its_error_and_no_capture_goes_astray() -> None:
    """More responses waiting than the bound (4,096 finishing in one step on a real engine):
    the oldest keeps its error, the others get their own captures, and the evicted one's late
    capture lands in no response."""
    box = CaptureMailbox(ENGINE, SIGN, max_waiting=2)
    for r in ("a", "b", "c"):
        box.want(r)
    payloads = {r: box.finished(r) for r in ("a", "b", "c")}
    assert box.waiting == (2, 0)
    box.arrive({r: _capture(i + 1) for i, r in enumerate(("a", "b", "c"))})
    with pytest.raises(BackendError, match="without its capture"):
        _read(payloads["a"])
    assert _read(payloads["b"])[0] == pytest.approx([0.2] * 3)
    assert _read(payloads["c"])[0] == pytest.approx([0.3] * 3)
    # "a"'s capture waits as an orphan, bounded, and is never handed to a later request
    assert box.waiting == (0, 1)
    box.want("d")
    for i in range(5):
        box.arrive({f"orphan{i}": _capture(10 + i)})
    assert box.waiting == (0, 2)
    with pytest.raises(BackendError, match="without its capture"):
        _read(box.finished("d"))


def test_a_payload_unsigned_altered_or_moved_is_refused() -> None:
    box = CaptureMailbox(ENGINE, SIGN)
    box.want("a")
    box.arrive({"a": _capture(4)})
    payload = box.finished("a", {"lora": None})
    assert payload is not None and _read(payload)[2] == {**ENGINE, "lora": None}
    unsigned = {k: v for k, v in payload.items() if k != "signature"}
    with pytest.raises(BackendError, match="unsigned"):
        _read(unsigned)
    for field, value in (("num_tokens", 2), ("engine", {**ENGINE, "vllm": "other"})):
        with pytest.raises(BackendError, match="valid signature"):
            _read({**payload, field: value})
    with pytest.raises(BackendError, match="valid signature"):
        _read(payload, key=b"another secret")
    # a capture re-signed by someone holding the key but moved to another response
    with pytest.raises(BackendError, match="other tokens"):
        decode_capture({PAYLOAD_KEY: payload}, PROMPT, [7, 8, 4], KEY)
    # the payload survives the JSON round trip an OpenAI response makes
    assert _read(json.loads(json.dumps(payload)))[0] == pytest.approx([0.4] * 3)


def test_a_request_without_the_servers_token_gets_no_activations() -> None:
    box = CaptureMailbox(ENGINE, SIGN)
    box.deny("stranger")
    payload = box.finished("stranger")
    assert payload is not None and set(payload) == {"error", "signature"}
    assert payload["error"] == NOT_AUTHORIZED
    with pytest.raises(BackendError, match="token of the server"):
        _read(payload)
    assert request_token(KEY) != request_token(b"another secret")
    assert KEY.decode() not in request_token(KEY)  # the secret itself never travels


def test_the_payload_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PAYLOAD_KEY_ENV, raising=False)
    with pytest.raises(BackendError, match=PAYLOAD_KEY_ENV):
        payload_key()
    generated = payload_key(generate=True)
    assert len(generated) == 64 and payload_key(generate=True) == generated
    monkeypatch.setenv(PAYLOAD_KEY_ENV, "shared")
    assert payload_key() == b"shared"
    flag = connector_flag([4])
    assert '"kv_role": "kv_producer"' in flag[1] and '"layers": [4]' in flag[1]
