"""Local Hugging Face models as LangChain chat models with exact per-token geometry.

Installed as ``abstain_guard.adapters``. Imports torch and transformers. Subpackages, from the
surface down:

* :mod:`.chat` - :class:`GeometryChatModel`, the LangChain surface, and its ``batch``,
  ``stream`` and ``replay`` parts;
* :mod:`.engine` - the scheduler and its engines (step-level batching, exact per row),
  generation with capture, the prefix path, replay, encoding messages into token ids, token
  streaming, the ``response_metadata`` written, the decode path and the CPU kernels;
* :mod:`.model` - offline loading, the default model, fingerprint, EOS / pad ids, the
  converted GGUF copy, the folder vLLM loads;
* :mod:`.tools` - tool calling: call formats (hermes, llama3, mistral, the prompted
  fallback), detection from the chat template, forced-call prefill, parsing of calls;
* :mod:`.capture` - :class:`~.capture.CaptureSession`, the per-token geometry in the forward
  pass, with the registered attention function, where the hooks go per family, the NumPy
  definitions of the signals and their torch versions, and the data containers.

May import: ``abstain_guard.adapters.capture``, ``abstain_guard.adapters.chat``,
``abstain_guard.adapters.engine``, ``abstain_guard.adapters.model``,
``abstain_guard.adapters.tools`` (each subpackage's own rule is in its docstring).
"""

from __future__ import annotations

# isort: off
from .engine import kernel_env  # noqa: F401  (first: asks for portable CPU kernels before torch computes)

# isort: on
from .capture.architectures import SUPPORTED_ARCHITECTURES
from .capture.types import ReferenceMeans, ReplayResult, TokenStates
from .chat.model import GeometryChatModel, load_default_model
from .model.loading import default_model_path

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GeometryChatModel",
    "ReferenceMeans",
    "ReplayResult",
    "TokenStates",
    "default_model_path",
    "load_default_model",
]
