"""A converted copy of a GGUF checkpoint: the de-quantized model written once as an ordinary
Hugging Face checkpoint (safetensors and JSON only: loading it executes no code) and read by
later loads, where its fingerprint agrees. Where: ``$ABSTAIN_GUARD_MODEL_CACHE`` (``off``:
none), else ``$XDG_CACHE_HOME/abstain_guard/converted``. docs/architecture.md, "Loading a GGUF
checkpoint".
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import transformers
from safetensors.torch import save_model

logger = logging.getLogger(__name__)

#: Where converted checkpoints live; ``off`` turns the cache off.
MODEL_CACHE_ENV = "ABSTAIN_GUARD_MODEL_CACHE"

#: Written last into a converted folder: what it was made from and its fingerprint.
MARKER = "abstain_guard_converted.json"


def cache_root() -> Path | None:
    """The cache's folder, or None when :data:`MODEL_CACHE_ENV` is ``off``."""
    value = os.environ.get(MODEL_CACHE_ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "abstain_guard" / "converted"


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _key(gguf: Path) -> str:
    """The cache folder's name: the GGUF file's content and the converting library."""
    return f"{_file_sha256(gguf)[:32]}-transformers-{transformers.__version__}"


def converted_folder(gguf: Path) -> tuple[Path | None, dict[str, Any] | None]:
    """``(folder, marker)`` of the converted copy of ``gguf`` where one is complete, else
    ``(folder it would be written to, None)``; ``(None, None)`` with the cache off."""
    root = cache_root()
    if root is None:
        return None, None
    folder = root / _key(gguf)
    marker = folder / MARKER
    if not marker.is_file():
        return folder, None
    try:
        return folder, json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return folder, None


def write_converted(
    folder: Path,
    gguf: Path,
    hf_model: Any,
    tokenizer: Any,
    fingerprint: Callable[[Any], str],
) -> bool:
    """Write ``hf_model`` (as de-quantized from ``gguf``) and ``tokenizer`` into ``folder``
    as a Hugging Face checkpoint; False (and nothing changed) where it cannot be written.

    The copy is built in a temporary folder beside ``folder`` and renamed into place; a
    process that lost the race keeps the copy already there."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    except OSError as exc:
        logger.debug("no converted copy of %s: %s", gguf, exc)
        return False
    try:
        save_model(hf_model, str(tmp / "model.safetensors"))
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        hf_model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {  # the GGUF file's digest is the folder's name (its 32 first digits)
            "gguf_file": gguf.name,
            "transformers": transformers.__version__,
            "fingerprint": fingerprint(hf_model),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))
        os.rename(tmp, folder)
        return True
    except OSError as exc:  # another process renamed its copy first, or the disk is full
        logger.debug("converted copy of %s not written: %s", gguf, exc)
        shutil.rmtree(tmp, ignore_errors=True)
        return folder.joinpath(MARKER).is_file()


_NAME_MAPS_LOCK = threading.Lock()


@contextmanager
def shared_tensor_name_maps() -> Iterator[None]:
    """Within the block, ``gguf.get_tensor_name_map(arch, n_blocks)`` builds each map once.

    transformers builds gguf-py's ``TensorNameMap`` anew at each module of the model it maps
    a GGUF file's tensor names onto (a large part of a load). The map is only read, so one
    map per ``(arch, n_blocks)`` gives the same names. Blocks are serialised (the function
    is swapped on gguf-py's module for the block, then restored)."""
    try:
        import gguf
    except ImportError:  # transformers raises its own error for a GGUF load without gguf-py
        yield
        return
    with _NAME_MAPS_LOCK:
        original = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.cache(original)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = original
