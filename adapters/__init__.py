"""Local Hugging Face models as LangChain chat models with exact per-token geometry.

Installed as ``abstain_guard.adapters``. Imports torch and transformers.

Modules, in the order a call goes through them:

* :mod:`.chat_model` - :class:`GeometryChatModel`, the LangChain surface;
* :mod:`.loading` - offline loading, the default model, fingerprint, EOS / pad ids;
* :mod:`.encoding` - LangChain messages to chat-template token ids, left-padded batches;
* :mod:`.tools` - tool calling: call formats (hermes, llama3, mistral, the prompted
  fallback), detection from the chat template, forced-call prefill, parsing of calls;
* :mod:`.generation` - ``generate`` with capture, answers cut at EOS, ``AIMessage``;
* :mod:`.replay` - teacher-forced replay of existing answers;
* :mod:`.response_metadata` - the ``response_metadata`` both write;
* :mod:`.capture` - :class:`~.capture.CaptureSession`, the per-token geometry in the
  forward pass, with :mod:`.attention` (the registered attention function),
  :mod:`.geometry_torch` (its torch math) and :mod:`.architectures` (where the hooks go);
* :mod:`.geometry` - the NumPy definitions of the signals; :mod:`.types` - data containers.
"""

from __future__ import annotations

# isort: off
from . import kernel_env  # noqa: F401  (first: asks for portable CPU kernels before torch computes)

# isort: on
from .architectures import SUPPORTED_ARCHITECTURES
from .chat_model import GeometryChatModel, load_default_model
from .loading import default_model_path, eos_token_ids
from .tools import FORMATS as TOOL_CALL_FORMATS
from .tools import detect_tool_call_format, parse_tool_calls, prompted_tool_block
from .types import ReferenceMeans, ReplayResult, TokenStates

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TOOL_CALL_FORMATS",
    "GeometryChatModel",
    "ReferenceMeans",
    "ReplayResult",
    "TokenStates",
    "default_model_path",
    "detect_tool_call_format",
    "eos_token_ids",
    "load_default_model",
    "parse_tool_calls",
    "prompted_tool_block",
]
