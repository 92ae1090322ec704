"""The vLLM backend's LangChain chat model: :class:`VLLMChatModel`.

Generates on a vLLM engine (:mod:`.vllm_engine`) and returns, per response, what the probe
and likelihood scorers read — token ids, OpenAI-style logprobs, full-vocabulary entropies and
the probe layers' residual stream (``geometry["hidden"]``) — computed in vLLM's own batches,
plus a ``backend`` record (vLLM version, dtype, device, layers, capture path) the guard checks
against the artifact. Geometry scorers are refused on its responses
(:class:`~abstain_guard.errors.BackendCapabilityError`): Ω, Θ and Φ need the project's exact
engine (:class:`~abstain_guard.adapters.GeometryChatModel`).

The engine runs in its own process, in vLLM's own Python environment (vLLM pins a
transformers range of its own): either started here (``engine_url`` unset: one engine per
process and settings, shared by every model object, stopped at exit) with the interpreter
``python`` names (else ``$ABSTAIN_GUARD_VLLM_PYTHON``, else this one when it imports vLLM),
or already running (``engine_url="http://host:8011"``, started with ``python -m
abstain_guard.backends.vllm_engine --model DIR``). Calls from many threads or tasks at once
are batched by vLLM (continuous batching).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field

from abstain_guard.contract.metadata import BACKEND, ENTROPY, GEOMETRY, HIDDEN, LOGPROBS
from abstain_guard.errors import BackendError, InvalidInputError

__all__ = [
    "ENGINE_RECORD_KEYS",
    "LIVE_BOUND",
    "VLLM_PYTHON_ENV",
    "VLLMChatModel",
    "engine_python",
    "stop_engines",
]

#: The interpreter of vLLM's environment (``make install`` builds ``.venv-vllm``).
VLLM_PYTHON_ENV = "ABSTAIN_GUARD_VLLM_PYTHON"
#: What a response's ``backend`` record and the artifact's decode path hold of the engine
#: (a response whose values differ from calibration's is a mismatch).
ENGINE_RECORD_KEYS = (
    "name",
    "vllm_version",
    "dtype",
    "device",
    "layers",
    "capture_path",
    "enforce_eager",
    "prefix_caching",
    "batch_invariant",
)

#: The largest |live − stored| score move the library states for a guard served on a vLLM
#: engine that is not batch-invariant (vLLM's CPU backend): a response batched with others
#: gets other last bits in its residual stream than at calibration. Measured: 1.4e-6 at most
#: (40 held-out questions, 8 in flight; bench/vllm_backend.json), tokens identical; recorded
#: in the artifact's ``decoding`` and held by tests/test_vllm_backend.py.
LIVE_BOUND = 1e-4

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


def engine_python(python: str | None = None) -> str:
    """The interpreter that runs the engine: ``python``, else ``$ABSTAIN_GUARD_VLLM_PYTHON``,
    else this interpreter when it can import vLLM.

    Raises:
        BackendError: none is set and vLLM is not importable here.
    """
    chosen = python or os.environ.get(VLLM_PYTHON_ENV)
    if chosen:
        if not Path(chosen).exists():
            raise BackendError(
                f"The vLLM interpreter {chosen!r} does not exist; point {VLLM_PYTHON_ENV} (or "
                "python=) at the python of an environment with `pip install "
                "'abstain-guard[vllm]'` (make install builds .venv-vllm)."
            )
        return chosen
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise BackendError(
        "vLLM is not installed in this environment and no vLLM interpreter is named. vLLM "
        "pins its own transformers range, so it runs in an environment of its own: create "
        "one with `pip install 'abstain-guard[vllm]'` (make install builds .venv-vllm) and "
        f"set {VLLM_PYTHON_ENV} to its python, or pass engine_url= of a running engine."
    )


class _Engine:
    """One engine process (``python -m abstain_guard.backends.vllm_engine``)."""

    def __init__(self, python: str, folder: Path, options: Mapping[str, Any]) -> None:
        self.log = Path(tempfile.mkstemp(prefix="abstain_guard_vllm_", suffix=".log")[1])
        port = _free_port()
        cmd = [python, "-m", "abstain_guard.backends.vllm_engine", "--model", str(folder)]
        cmd += ["--exit-with-parent"]
        cmd += ["--port", str(port), "--dtype", str(options["dtype"])]
        cmd += ["--memory-fraction", str(options["memory_fraction"])]
        cmd += ["--max-model-len", str(options["max_model_len"])]
        if options.get("layers"):
            cmd += ["--layers", ",".join(str(x) for x in options["layers"])]
        cmd += [str(a) for a in options.get("extra_args", ())]
        env = dict(os.environ)
        if env.get("ATEN_CPU_CAPABILITY") == "default":
            # ATen's scalar kernels (the foreign-kernel mode's pin, adapters/engine/kernel_env.py):
            # vLLM compiles its sampler with inductor, whose C++ code needs a vector
            # capability ("at::vec has not been declared"); the engine keeps the library's
            # portable one. Its bound to calibration is measured, not bitwise.
            env["ATEN_CPU_CAPABILITY"] = "avx2"
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.url = f"http://127.0.0.1:{port}"

    def wait(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendError(
                    f"The vLLM engine exited with code {self.process.returncode} while "
                    f"starting; its log ends:\n{self.tail()}"
                )
            try:
                response = httpx.get(self.url + "/info", timeout=2.0)
                if response.status_code == 200:
                    return dict(response.json())
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise BackendError(
            f"The vLLM engine did not answer within {timeout:.0f} s; its log ends:\n{self.tail()}"
        )

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 15)
                self.process.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, 9)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_ENGINES: dict[tuple[Any, ...], tuple[_Engine, dict[str, Any]]] = {}
_ENGINES_LOCK = threading.Lock()


def stop_engines() -> None:
    """Stop every engine this process started (also run at exit)."""
    with _ENGINES_LOCK:
        for engine, _ in _ENGINES.values():
            engine.close()
        _ENGINES.clear()


atexit.register(stop_engines)


class VLLMChatModel(BaseChatModel):
    """A chat model generating greedily on vLLM, recording what the probe and likelihood
    scorers read (see the module docstring).

    Args:
        model: ``"default"`` (the embedded SmolLM2) or a local Hugging Face folder.
        gguf_file: a GGUF file inside ``model`` (converted once for vLLM).
        max_tokens: the token budget (``bind(max_tokens=...)`` per call wins).
        top_logprobs: alternatives per token in ``logprobs`` (0: the chosen token's only).
        dtype: the weights' dtype on the engine.
        layers: decoder layers whose residual stream is recorded (default: the probe layers
            :func:`abstain_guard.contract.metadata.probe_layers`).
        engine_url: a running engine; unset: one is started (and shared in this process).
        python: the vLLM environment's interpreter (see :func:`engine_python`).
        memory_fraction: vLLM's ``gpu_memory_utilization`` (on the CPU backend, the share of
            host memory it reserves).
        max_model_len: the engine's context length.
        startup_timeout: seconds to wait for a started engine.
        request_timeout: seconds to wait for one response.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str = "default"
    gguf_file: str | None = None
    max_tokens: int | None = None
    top_logprobs: int = 5
    dtype: str = "float32"
    layers: list[int] | None = None
    engine_url: str | None = Field(default=None, exclude=True)
    python: str | None = Field(default=None, exclude=True)
    memory_fraction: float = Field(default=0.15, exclude=True)
    max_model_len: int = 2048
    startup_timeout: float = Field(default=600.0, exclude=True)
    request_timeout: float = Field(default=600.0, exclude=True)

    @property
    def _llm_type(self) -> str:
        return "abstain-guard-vllm"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "layers": self.layers}

    # ---- the engine --------------------------------------------------------------------

    def _url(self) -> str:
        """The engine's URL: an attached one as given (no request), else :meth:`engine`'s."""
        if self.engine_url is not None:
            return self.engine_url.rstrip("/")
        return self.engine()[0]

    def engine(self) -> tuple[str, dict[str, Any]]:
        """``(url, info)`` of the engine this model generates on (started on first use)."""
        if self.engine_url is not None:
            url = self.engine_url.rstrip("/")
            try:
                info = httpx.get(url + "/info", timeout=10.0).raise_for_status().json()
            except httpx.HTTPError as exc:
                raise BackendError(
                    f"The vLLM engine at {url} did not answer /info ({exc}); start it with "
                    "`python -m abstain_guard.backends.vllm_engine --model DIR --port N` in "
                    "the vLLM environment."
                ) from exc
            return url, dict(info)
        key: tuple[Any, ...] = (self.python, self.model, self.gguf_file, self.dtype)
        key += (tuple(self.layers or ()), self.memory_fraction, self.max_model_len)
        with _ENGINES_LOCK:
            found = _ENGINES.get(key)
            if found is None or found[0].process.poll() is not None:
                python = engine_python(self.python)
                folder = _model_folder(self.model, self.gguf_file)
                options = {
                    "dtype": self.dtype,
                    "memory_fraction": self.memory_fraction,
                    "max_model_len": self.max_model_len,
                    "layers": self.layers,
                }
                started = _Engine(python, folder, options)
                found = (started, started.wait(self.startup_timeout))
                _ENGINES[key] = found
        return found[0].url, found[1]

    def engine_record(self) -> dict[str, Any]:
        """What the artifact's decode path records of the engine (:data:`ENGINE_RECORD_KEYS`)."""
        _, info = self.engine()
        record = {"name": "vllm", **info}
        return {k: record.get(k) for k in ENGINE_RECORD_KEYS}

    def decoding_settings(self) -> dict[str, Any]:
        """The deployment record's ``decoding``: greedy, on the vLLM backend, this engine,
        and the live-vs-stored bound the library states for it (:data:`LIVE_BOUND`; 0 on a
        batch-invariant engine)."""
        path = self.engine_record()
        bound = 0.0 if path.get("batch_invariant") else LIVE_BOUND
        return {"temperature": 0.0, "backend": "vllm", "decode_path": path, "live_bound": bound}

    def bind_tools(
        self,
        tools: Sequence[Any],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` bound to every call (OpenAI-format schemas), rendered
        and read as the exact engine renders and reads them (:mod:`.vllm_tools`);
        ``tool_choice`` as :meth:`GeometryChatModel.bind_tools` takes it. ``strict`` and
        ``parallel_tool_calls`` are accepted and ignored."""
        kwargs.pop("strict", None)
        kwargs.pop("parallel_tool_calls", None)
        schemas = [convert_to_openai_tool(t) for t in tools]
        return self.bind(tools=schemas, tool_choice=tool_choice, **kwargs)

    def _prompter(self) -> Any:
        from .vllm_tools import prompter_for

        return prompter_for(str(_model_folder(self.model, self.gguf_file)))

    # ---- generation --------------------------------------------------------------------

    def _payload(
        self, messages: Sequence[BaseMessage], kwargs: Mapping[str, Any]
    ) -> tuple[dict, Any]:
        """The request body, and the call's tool setup (None without tools)."""
        budget = kwargs.get("max_tokens", self.max_tokens)
        if budget is None:
            from abstain_guard.contract.prompts import MAX_NEW_TOKENS

            budget = MAX_NEW_TOKENS["open"]
        chat = []
        for m in messages:
            role = _ROLES.get(m.type)
            if role is None:
                raise InvalidInputError(
                    f"The vLLM backend cannot send a {m.type!r} message; use system, human, "
                    "ai and tool messages."
                )
            if not isinstance(m.content, str):
                raise InvalidInputError("The vLLM backend sends text messages only.")
            chat.append({"role": role, "content": m.content})
        body: dict[str, Any] = {
            "messages": chat,
            "max_tokens": int(budget),
            "top_logprobs": self.top_logprobs,
        }
        tools, choice = kwargs.get("tools"), kwargs.get("tool_choice")
        tool_turns = any(
            m.type == "tool" or (isinstance(m, AIMessage) and m.tool_calls) for m in messages
        )
        if not tools and not tool_turns and choice in (None, "auto", "none"):
            return body, None  # the engine renders plain chat with vLLM's own template
        ids, setup = self._prompter().prompt(messages, tools, choice)
        body["prompt_token_ids"] = ids
        if setup is not None and setup.end_markers:
            body["stop"] = list(setup.end_markers)
        return body, setup

    def _with_calls(self, result: ChatResult, body: Mapping[str, Any], setup: Any) -> ChatResult:
        if setup is None:
            return result
        message = result.generations[0].message
        assert isinstance(message, AIMessage)
        meta = message.response_metadata
        read = self._prompter().read(message, body["prompt_token_ids"], meta["token_ids"], setup)
        return ChatResult(generations=[ChatGeneration(message=read)])

    def _result(self, body: Mapping[str, Any]) -> ChatResult:
        """The message of an engine response; its ``backend`` record is the one the engine
        sent with it (what computed this response, not what answered ``/info`` earlier)."""
        record = {"name": "vllm", **body["engine"]}
        meta = {
            "model_name": str(self.model),
            "finish_reason": body["finish_reason"],
            "prompt_token_ids": body["prompt_token_ids"],
            "token_ids": body["token_ids"],
            "tokens": body["tokens"],
            LOGPROBS: body["logprobs"],
            ENTROPY: body["entropy"],
            GEOMETRY: {HIDDEN: body["hidden"]},
            BACKEND: {k: record.get(k) for k in ENGINE_RECORD_KEYS},
        }
        message = AIMessage(content=str(body["text"]), response_metadata=meta)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _error(self, url: str, exc: Exception) -> BackendError:
        detail = ""
        if isinstance(exc, httpx.HTTPStatusError):
            detail = f": {exc.response.text[:300]}"
        return BackendError(f"The vLLM engine at {url} failed the request ({exc}){detail}.")

    def _request(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: Mapping[str, Any]
    ) -> tuple[str, dict, Any]:
        """``(engine URL, request body, tool setup)`` of one call (sync and async alike)."""
        if stop:
            raise InvalidInputError("The vLLM backend generates without stop strings.")
        payload, setup = self._payload(messages, kwargs)
        return self._url(), payload, setup

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        url, payload, setup = self._request(messages, stop, kwargs)
        try:
            response = httpx.post(url + "/generate", json=payload, timeout=self.request_timeout)
            body = response.raise_for_status().json()
        except httpx.HTTPError as exc:
            raise self._error(url, exc) from exc
        return self._with_calls(self._result(body), body, setup)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        url, payload, setup = self._request(messages, stop, kwargs)
        try:
            async with httpx.AsyncClient(timeout=self.request_timeout) as client:
                response = await client.post(url + "/generate", json=payload)
                body = response.raise_for_status().json()
        except httpx.HTTPError as exc:
            raise self._error(url, exc) from exc
        return self._with_calls(self._result(body), body, setup)


def _model_folder(model: str, gguf_file: str | None) -> Path:
    """The folder the engine loads (prepared by :mod:`abstain_guard.adapters.model.vllm_folder`)."""
    try:
        from abstain_guard.adapters.model.vllm_folder import vllm_model_folder
    except ImportError as exc:  # no torch/transformers here: a ready folder is needed
        folder = Path(model)
        if model != "default" and (folder / "config.json").is_file():
            return folder
        raise BackendError(
            f"Preparing {model!r} for vLLM needs the 'local' extra (torch, transformers); "
            "install it, or pass a Hugging Face folder whose config names its architecture."
        ) from exc
    return vllm_model_folder(model, gguf_file)
