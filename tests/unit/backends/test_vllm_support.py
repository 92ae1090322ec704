"""What the vLLM connector serves and what it refuses by name (vllm_support.py), and the
served model's verified identity (vllm_identity.py), without vLLM."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from abstain_guard.backends.vllm_identity import (
    DIGEST_CACHE_ENV,
    IdentityUnverifiable,
    file_sha256,
    model_identity,
    resolve_model_folder,
)
from abstain_guard.backends.vllm_support import (
    SUPPORTED_VLLM,
    UnsupportedServing,
    check_modes,
    check_version,
    lora_record,
    stop_view,
)


def _config(**parallel: Any) -> Any:
    values = {
        "pipeline_parallel_size": 1,
        "prefill_context_parallel_size": 1,
        "enable_dbo": False,
        "ubatch_size": 0,
    }
    values.update(parallel)
    return SimpleNamespace(
        speculative_config=None,
        parallel_config=SimpleNamespace(**values),
        model_config=SimpleNamespace(runner_type="generate"),
    )


def test_the_supported_range_is_checked_and_named() -> None:
    check_version(SUPPORTED_VLLM[0])
    check_version(SUPPORTED_VLLM[0] + "+cpu")
    for version in ("0.31.2", "0.33.0", "1.0.0", "dev"):
        with pytest.raises(UnsupportedServing, match=version) as err:
            check_version(version)
        if version != "dev":
            assert f">= {SUPPORTED_VLLM[0]}, < {SUPPORTED_VLLM[1]}" in str(err.value)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"enable_dbo": True}, "--enable-dbo"),
        ({"ubatch_size": 2}, "micro-batching"),
        ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
        ({"prefill_context_parallel_size": 2}, "--prefill-context-parallel-size"),
    ],
)
def test_each_mode_the_capture_cannot_serve_is_refused_by_name(change: dict, named: str) -> None:
    check_modes(_config())
    with pytest.raises(UnsupportedServing, match=named):
        check_modes(_config(**change))


def test_speculative_decoding_and_pooling_are_refused_all_named_at_once() -> None:
    config = _config(enable_dbo=True)
    config.speculative_config = object()
    config.model_config.runner_type = "pooling"
    with pytest.raises(UnsupportedServing) as err:
        check_modes(config)
    for named in ("--speculative-config", "--enable-dbo", "pooling"):
        assert named in str(err.value)


def test_the_stop_view_is_what_vllms_check_stop_reads() -> None:
    params = SimpleNamespace(max_tokens=4, eos_token_id=2)
    view = stop_view(params, 10, [5, 6])
    assert (view.num_tokens, view.num_output_tokens, view.max_tokens) == (12, 2, 4)
    assert view.output_token_ids == [5, 6] and view.pooling_params is None


def test_a_lora_adapter_is_recorded_and_an_unverified_one_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    from abstain_guard.backends.vllm_payload import (
        PAYLOAD_KEY,
        decode_capture,
        encode_capture,
        sign_payload,
        tokens_digest,
    )
    from abstain_guard.errors import BackendError

    monkeypatch.setenv(DIGEST_CACHE_ENV, str(tmp_path / "cache"))
    assert lora_record(None, {}) is None
    lora = SimpleNamespace(lora_name="sql", lora_int_id=3, lora_path="/a")
    assert lora_record(lora, {"/a": "f" * 64}) == {"name": "sql", "id": 3, "sha256": "f" * 64}
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"lora")
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    first = model_identity(adapter)
    (adapter / "adapter_config.json").write_text('{"r": 16}')  # another rank: another adapter
    assert model_identity(adapter) != first
    rows = np.zeros((1, 2), dtype=np.float32)
    for sha, refused in (("f" * 64, False), (None, True)):
        payload = encode_capture([0], rows, rows, [0.5], tokens_digest([1], [2]), 1)
        payload["lora"] = lora_record(lora, {"/a": sha})
        params = {PAYLOAD_KEY: sign_payload(payload, b"k")}
        if refused:
            with pytest.raises(BackendError, match="could not verify"):
                decode_capture(params, [1], [2], b"k")
        else:
            assert decode_capture(params, [1], [2], b"k")[2]["lora"]["sha256"] == sha


def test_a_weights_file_and_its_tokenizer_folder_are_one_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vllm serve model.gguf --tokenizer DIR``: the file's bytes and the tokenizer's files."""
    monkeypatch.setenv(DIGEST_CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf weights")
    tokenizer = _folder(tmp_path / "tok")
    (tokenizer / "model.safetensors").unlink()
    first = model_identity(gguf, tokenizer=tokenizer)
    (tokenizer / "tokenizer_config.json").write_text("{}")
    second = model_identity(gguf, tokenizer=tokenizer)
    gguf.write_bytes(b"other weights")
    assert len({first, second, model_identity(gguf, tokenizer=tokenizer)}) == 3


def _folder(root: Path, weights: bytes = b"w" * 100) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model.safetensors").write_bytes(weights)
    (root / "config.json").write_text('{"a": 1}')
    (root / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}"}')
    return root


def test_the_identity_covers_weights_config_tokenizer_and_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DIGEST_CACHE_ENV, str(tmp_path / "cache"))
    folder = _folder(tmp_path / "m")
    first = model_identity(folder)
    assert len(first) == 64 and model_identity(folder) == first
    for name, text in (("config.json", '{"a": 2}'), ("tokenizer_config.json", "{}")):
        original = (folder / name).read_text()
        (folder / name).write_text(text)
        assert model_identity(folder) != first, name
        (folder / name).write_text(original)
    (folder / "chat_template.jinja").write_text("{{ y }}")
    assert model_identity(folder) != first
    (folder / "chat_template.jinja").unlink()
    assert model_identity(folder) == first
    assert model_identity(folder, dummy_weights=True) != first


def test_a_rewritten_file_is_hashed_again_even_with_its_old_size_and_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest cache is not trusted on path, size and mtime: a file rewritten in place and
    its mtime set back gets another change time (or inode), so its digest is recomputed."""
    monkeypatch.setenv(DIGEST_CACHE_ENV, str(tmp_path / "cache"))
    path = _folder(tmp_path / "m") / "model.safetensors"
    before = file_sha256(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a ctime later than the first
    path.write_bytes(b"x" * 100)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert file_sha256(path) == hashlib.sha256(b"x" * 100).hexdigest() != before


def test_a_hub_snapshot_is_read_offline_and_its_blobs_named_by_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DIGEST_CACHE_ENV, str(tmp_path / "cache"))
    repo = tmp_path / "hub" / "models--org--tiny"
    blob = repo / "blobs" / hashlib.sha256(b"weights").hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"weights")
    snapshot = repo / "snapshots" / ("a" * 40)
    _folder(snapshot).joinpath("model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    hub = str(tmp_path / "hub")
    assert resolve_model_folder("org/tiny", cache_dir=hub) == snapshot
    assert file_sha256(snapshot / "model.safetensors") == blob.name
    assert model_identity("org/tiny", cache_dir=hub) == model_identity(snapshot)


def test_an_identity_that_cannot_be_verified_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(IdentityUnverifiable, match="cannot be verified"):
        model_identity("org/not-downloaded", cache_dir=str(tmp_path / "empty-hub"))
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(IdentityUnverifiable, match="no weight files"):
        model_identity(empty)
