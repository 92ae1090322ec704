"""The converted copy of a GGUF checkpoint (adapters/model/gguf_cache.py) is the same model: the
same weights bit for bit, config, tokenizer, chat template, generation config and
fingerprint, named as the original folder; a copy that disagrees is not used; ``off``
turns the cache off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from abstain_guard.adapters.model import gguf_cache
from abstain_guard.adapters.model.loading import (
    DEFAULT_GGUF,
    _load_converted,
    default_model_path,
    load_pretrained,
    model_fingerprint,
)
from abstain_guard.config import GuardConfig

TEXTS = [
    "What is the capital of France?",
    "Ünïcode ✓ 東京, tabs\tand  spaces\n\n",
    " leading space",
    "<|im_start|>user\nhi<|im_end|>",
]
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the currency of Peru?"},
]


def _config(model: object) -> dict[str, object]:
    cfg = dict(model.config.to_dict())  # type: ignore[attr-defined]
    cfg.pop("quantization_config", None)
    return cfg


@pytest.mark.model
@pytest.mark.slow
def test_the_converted_copy_is_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gguf_cache.MODEL_CACHE_ENV, str(tmp_path / "cache"))
    folder = default_model_path()
    gguf = folder / DEFAULT_GGUF
    assert gguf_cache.converted_folder(gguf)[1] is None  # nothing converted yet
    original, tok = load_pretrained(folder, gguf_file=DEFAULT_GGUF)  # reads the GGUF, writes
    converted, marker = gguf_cache.converted_folder(gguf)
    assert converted is not None and marker is not None
    assert marker["fingerprint"] == model_fingerprint(original)
    copy, tok2 = load_pretrained(folder, gguf_file=DEFAULT_GGUF)  # reads the copy
    assert copy.config._name_or_path == str(folder)  # named as the original
    a, b = original.state_dict(), copy.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _config(original) == _config(copy)
    assert original.generation_config.to_dict() == copy.generation_config.to_dict()
    assert model_fingerprint(original) == model_fingerprint(copy)
    # the same numbers out: the copy's tensors live in torch's own aligned storage, as the
    # GGUF path's do (MKL computes other last bits on 8-byte-aligned data)
    assert all(p.data_ptr() % 64 == 0 for p in copy.parameters())
    ids = torch.tensor([tok(TEXTS[0] + " " + TEXTS[1])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, copy(ids).logits)
    assert [tok(t)["input_ids"] for t in TEXTS] == [tok2(t)["input_ids"] for t in TEXTS]
    assert tok.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    ) == tok2.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert (tok.eos_token_id, tok.bos_token_id, tok.get_vocab()) == (
        tok2.eos_token_id,
        tok2.bos_token_id,
        tok2.get_vocab(),
    )
    # a copy whose fingerprint is not the recorded one is not used (the GGUF is read again)
    (converted / gguf_cache.MARKER).write_text(json.dumps({**marker, "fingerprint": "0" * 32}))
    tampered = json.loads((converted / gguf_cache.MARKER).read_text())
    assert _load_converted(converted, tampered, folder, "cpu") is None


def test_the_cache_can_be_turned_off_and_is_not_a_config_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gguf_cache.MODEL_CACHE_ENV, "off")
    assert gguf_cache.cache_root() is None
    assert gguf_cache.converted_folder(tmp_path / "x.gguf") == (None, None)
    monkeypatch.setenv(gguf_cache.MODEL_CACHE_ENV, str(tmp_path))
    assert gguf_cache.cache_root() == tmp_path
    env = {gguf_cache.MODEL_CACHE_ENV: "off", "ABSTAIN_GUARD_PARTICIPATION": "0.9"}
    assert GuardConfig.from_env(env).participation == 0.9


def test_tensor_name_maps_are_shared_only_inside_the_block() -> None:
    """transformers builds gguf-py's tensor-name map at every module of the model; inside
    ``shared_tensor_name_maps`` each ``(arch, n_blocks)`` map is built once and is the map a
    fresh build gives; outside, gguf-py's own function is back."""
    gguf = pytest.importorskip("gguf")
    original = gguf.get_tensor_name_map
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
    with gguf_cache.shared_tensor_name_maps():
        first = gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30) is first
        assert gguf.get_tensor_name_map(arch, 2) is not first
    assert gguf.get_tensor_name_map is original
    assert first.mapping == original(arch, 30).mapping
    with pytest.raises(RuntimeError), gguf_cache.shared_tensor_name_maps():
        raise RuntimeError("a load that fails")
    assert gguf.get_tensor_name_map is original
