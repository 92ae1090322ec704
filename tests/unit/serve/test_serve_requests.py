"""The server's request parsing and OpenAI formatting without a model, and that the core
package and the CLI stay free of FastAPI until ``serve`` runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
from abstain_guard.cli import main
from abstain_guard.guarantee.certificate import Certificate
from abstain_guard.guarantee.decision import Decision
from abstain_guard.serve.openai_format import (
    completion_body,
    decision_headers,
    sse_chunks,
)
from abstain_guard.serve.schemas import RequestLimits, RequestRefused, parse_request
from abstain_guard.serve.service import GuardedAnswer

LIMITS = RequestLimits(max_body_bytes=2000, max_messages=3, max_chars=100)


def _body(**fields: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "Q?"}], **fields}).encode()


def test_a_well_formed_request_parses() -> None:
    req = parse_request(_body(max_completion_tokens=24, stream=True, logprobs=True), LIMITS)
    assert req.token_budget == 24 and req.stream and req.logprobs
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "gold?"}]
    req = parse_request(
        json.dumps({"messages": [{"role": "user", "content": parts}]}).encode(), LIMITS
    )
    assert req.messages[0].text() == "What is gold?"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{", 400, "not JSON"),
        (b"[1, 2]", 400, "not an object"),
        (json.dumps({"messages": []}).encode(), 400, "messages"),
        (_body(max_tokens=0), 400, "max_tokens"),
        (_body(top_logprobs=50), 400, "top_logprobs"),
        (json.dumps({"messages": [{"content": "no role"}]}).encode(), 400, "role"),
        (b" " * 2001, 413, "over 2000 bytes"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 101}]}).encode(), 400, "101"),
        (json.dumps({"messages": [{"role": "user", "content": "q"}] * 4}).encode(), 400, "4 mes"),
    ],
)
def test_a_malformed_request_is_refused_with_its_reason(
    body: bytes, status: int, says: str
) -> None:
    with pytest.raises(RequestRefused) as info:
        parse_request(body, LIMITS)
    assert info.value.status == status
    assert says in info.value.message
    assert info.value.body()["error"]["message"] == info.value.message


def test_image_parts_cannot_be_guarded() -> None:
    parts = [{"type": "image_url", "image_url": {"url": "data:"}}]
    with pytest.raises(RequestRefused, match="image_url"):
        parse_request(
            json.dumps({"messages": [{"role": "user", "content": parts}]}).encode(), LIMITS
        )


ANSWER = GuardedAnswer(
    content="Paris",
    decision=Decision(
        abstained=False,
        score=0.25,
        threshold=float("inf"),
        mode="participation",
        target=0.8,
        guarantee=Certificate(
            kind="participation", statement="", participation_interval=(0.8, 0.81)
        ),
        scorer="geometry_plus",
    ),
    logprobs=[
        {
            "token": "Paris",
            "token_id": 7,
            "logprob": -0.1,
            "top_logprobs": [{"token": "Paris", "logprob": -0.1}, {"token": "Lyon", "logprob": -3}],
        }
    ],
    finish_reason="stop",
    prompt_tokens=30,
    completion_tokens=2,
)


def test_the_completion_body_is_openai_shaped_and_strict_json() -> None:
    body = completion_body(ANSWER, completion_id="chatcmpl-1", model="m", logprobs=1)
    text = json.dumps(body, allow_nan=False)  # an infinite threshold must not break JSON
    choice = json.loads(text)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Paris", "refusal": None}
    assert choice["abstention"]["threshold"] == "inf"
    (token,) = choice["logprobs"]["content"]
    assert token["bytes"] == list(b"Paris") and len(token["top_logprobs"]) == 1
    assert "token_id" not in token
    assert body["usage"] == {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32}


def test_the_decision_headers_are_ascii() -> None:
    headers = decision_headers(ANSWER)
    assert headers["X-Abstain-Guard-Abstained"] == "false"
    assert float(headers["X-Abstain-Guard-Score"]) == 0.25
    assert json.loads(headers["X-Abstain-Guard-Guarantee"])["kind"] == "participation"
    for value in headers.values():
        value.encode("ascii")


def test_the_stream_ends_with_the_decision_usage_and_done() -> None:
    events = list(
        sse_chunks(ANSWER, completion_id="c", model="m", logprobs=None, include_usage=True)
    )
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Paris"
    assert chunks[-2]["choices"][0]["abstention"]["score"] == 0.25
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 32


def test_core_and_cli_import_no_fastapi() -> None:
    code = (
        "import sys, abstain_guard, abstain_guard.cli\n"
        "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_serve_without_an_artifact_is_one_error(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["serve", "--artifact", str(tmp_path / "missing"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "No artifact" in err and "--port must be a positive integer" in err
