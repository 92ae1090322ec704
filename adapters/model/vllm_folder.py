"""A model folder vLLM can load, written once from the checkpoint the project's engine loads.

vLLM reads ordinary Hugging Face folders but not every checkpoint the project's engine
reads: the embedded model is a GGUF file (its converted copy, :mod:`.gguf_cache`, has no
``architectures`` in its config and stores the tied embedding only under ``lm_head``, which
vLLM skips for a tied model, leaving the embedding at zero). :func:`vllm_model_folder`
loads the checkpoint with transformers and writes it back with ``save_pretrained``
(safetensors, the config with its architecture, the tokenizer and chat template): the same
weights, named as vLLM expects. Written to a temporary folder and renamed into place, beside
the converted copies (``<cache>/<key>-vllm``); a folder that already names its architecture
and is not a GGUF file is used as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from abstain_guard.errors import ModelNotFoundError

from .gguf_cache import cache_root
from .loading import DEFAULT_GGUF, default_model_path, load_pretrained, model_fingerprint

#: Written last into a prepared folder: the source and the weights' fingerprint.
VLLM_MARKER = "abstain_guard_vllm.json"


def _ready(folder: Path) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("architectures"))


def vllm_model_folder(model: str = "default", gguf_file: str | None = None) -> Path:
    """A folder vLLM loads with the same weights as ``model`` (``"default"``: the embedded
    GGUF; else a local Hugging Face folder, with ``gguf_file`` inside it if given).

    Raises:
        ModelNotFoundError: the model is not installed or not a folder.
    """
    gguf: str | None
    if model == "default":
        source, gguf = default_model_path(), DEFAULT_GGUF
    else:
        source, gguf = Path(model), gguf_file
        if not source.is_dir():
            raise ModelNotFoundError(
                f"model {model!r} is not a local folder; vLLM serves a Hugging Face folder "
                "(config.json, safetensors, tokenizer) or 'default'."
            )
        if gguf is None and _ready(source):
            return source
    root = cache_root() or Path(tempfile.gettempdir()) / "abstain_guard_vllm"
    hf_model, tokenizer = load_pretrained(source, gguf_file=gguf)
    if gguf is not None and getattr(hf_model.config, "quantization_config", None) is not None:
        # A first load reads the GGUF itself (and writes its converted copy): transformers
        # flags that model quantized and will not save it. The converted copy saves.
        hf_model, tokenizer = load_pretrained(source, gguf_file=gguf)
    fingerprint = model_fingerprint(hf_model)
    folder = root / f"{fingerprint[:32]}-vllm"
    marker = folder / VLLM_MARKER
    if marker.is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".vllm-", dir=root))
    try:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / VLLM_MARKER).write_text(
            json.dumps({"source": str(source), "gguf_file": gguf, "fingerprint": fingerprint}),
            encoding="utf-8",
        )
        try:
            os.replace(tmp, folder)
        except OSError:  # another process put it there first
            if not marker.is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
