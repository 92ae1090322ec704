"""The request options a served model cannot take (abstain_guard/serve/admission.py)."""

from __future__ import annotations

import json

import pytest

from abstain_guard.backends.vllm_chat import VLLMChatModel
from abstain_guard.serve.admission import Admission
from abstain_guard.serve.schemas import RequestLimits, RequestRefused, parse_request


def _admission(chat_model: VLLMChatModel) -> Admission:
    admission = Admission.__new__(Admission)
    admission.chat_model = chat_model
    return admission


def _request(**fields: object) -> object:
    body = {"messages": [{"role": "user", "content": "q"}], **fields}
    return parse_request(json.dumps(body).encode(), RequestLimits())


def test_logprobs_are_refused_by_name_when_the_model_asks_its_server_for_none() -> None:
    """A guard whose scorer reads no logprobs asks vLLM for none, so a client asking for
    them is told why and what to do; a model asking for every field serves them."""
    probe = _admission(VLLMChatModel(reads=frozenset({"hidden"})))
    with pytest.raises(RequestRefused, match="reads=None") as info:
        probe.unsupported_option(_request(logprobs=True))
    assert info.value.param == "logprobs"
    assert probe.unsupported_option(_request()) is None
    full = _admission(VLLMChatModel())
    assert full.unsupported_option(_request(logprobs=True, top_logprobs=5)) is None
    with pytest.raises(RequestRefused, match="top_logprobs=6"):
        full.unsupported_option(_request(logprobs=True, top_logprobs=6))
