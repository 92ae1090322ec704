"""Models without a chat template (base models) get the named plain template: its text is
hashed into the generation record (a guard refuses another template), and an answer stops
where the model opens a next turn."""

from __future__ import annotations

import torch
from tiny_models import CHAT_TEMPLATE, VOCAB_SIZE, char_tokenizer, tiny_hf_model

from abstain_guard.adapters import GeometryChatModel
from abstain_guard.adapters.engine.encoding import PLAIN_TEMPLATE, PlainTemplate
from abstain_guard.adapters.engine.generation import Generated, to_message
from abstain_guard.contract.deployment import (
    DeploymentRecord,
    PromptRecord,
    generation_mismatches,
    sha256_text,
)
from abstain_guard.contract.metadata import GENERATION


def _base_model() -> GeometryChatModel:
    tok = char_tokenizer()
    tok.chat_template = None
    return GeometryChatModel.from_hf(tiny_hf_model("gpt2"), tok, max_new_tokens=3)


def test_the_plain_template_renders_the_transcript() -> None:
    dicts = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert PLAIN_TEMPLATE.render(dicts) == "system: Be brief.\nuser: Hi\nassistant:"
    assert PLAIN_TEMPLATE.turn_markers == ("\nsystem:", "\nuser:", "\nassistant:", "\ntool:")
    assert PlainTemplate(generation_prompt="A:").text != PLAIN_TEMPLATE.text


def test_its_hash_is_recorded_and_another_template_refused() -> None:
    base = _base_model()
    record = base.invoke("Hi").response_metadata[GENERATION]
    assert record["chat_template_sha256"] == sha256_text(PLAIN_TEMPLATE.text)
    assert record["stop"] == []  # the markers belong to the template, not to the call's stop
    templated = GeometryChatModel.from_hf(tiny_hf_model("gpt2"), char_tokenizer())
    assert templated.chat_template_sha256 == sha256_text(CHAT_TEMPLATE)  # as before
    calibrated = DeploymentRecord(
        chat_template_sha256=templated.chat_template_sha256,
        prompts={"open": PromptRecord(system_prompt=None, max_new_tokens=3)},
    )
    assert "the tokenizer's chat template differs from the calibrated one" in (
        generation_mismatches(calibrated, record)
    )


def test_generation_stops_at_the_next_turn() -> None:
    base = _base_model()
    opts, _ = base._settings(None, {})
    assert opts["turn_markers"] == list(PLAIN_TEMPLATE.turn_markers)
    (request,) = base._call(opts).requests([[5, 6]], 3)
    assert set(PLAIN_TEMPLATE.turn_markers) <= set(request.stop)
    templated = GeometryChatModel.from_hf(tiny_hf_model("gpt2"), char_tokenizer())
    assert templated._settings(None, {})[0]["turn_markers"] == []
    tok = base.tokenizer
    ids = tok("Paris\nuser: and Rome?", add_special_tokens=False)["input_ids"]
    gen = Generated(
        token_ids=ids,
        logits=torch.zeros(len(ids), VOCAB_SIZE),
        finish_reason="length",
        geometry=None,
    )
    msg = to_message(tok, "tiny", 3, [5, 6], gen, {**opts, "top_logprobs": 0})
    assert msg.content == "Paris"
    assert msg.response_metadata["finish_reason"] == "stop"
    assert msg.response_metadata["token_ids"] == ids  # every generated token kept
