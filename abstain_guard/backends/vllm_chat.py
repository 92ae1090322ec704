"""The vLLM backend's LangChain chat model: :class:`VLLMChatModel`.

Generates on **stock vLLM**: its OpenAI endpoint, started the way the team runs it (``vllm
serve`` with its own flags: tensor parallelism, quantization, batching limits, compiled
graphs, CUDA graphs) plus the guard's connector flag (:mod:`.vllm_connector`), which returns
with each response what the probe and likelihood scorers read: the probe layers' residual
stream (last row and mean over the answer), full-vocabulary token entropies, and the
server's engine record (vLLM version, dtype, device, parallelism, compile mode, the served
model's verified identity, the LoRA adapter) that the guard checks against its calibration,
each payload signed under ``$ABSTAIN_GUARD_PAYLOAD_KEY`` and bound to the response's tokens.
Token ids and OpenAI logprobs come from vLLM itself. Geometry scorers are refused on its responses
(:class:`~abstain_guard.errors.BackendCapabilityError`): Ω, Θ and Φ need the project's exact
engine (:class:`~abstain_guard.adapters.GeometryChatModel`).

The server runs in vLLM's own Python environment (vLLM pins a transformers range of its
own): either started here (``engine_url`` unset: :mod:`.vllm_engine`; ``vllm_args`` are
vLLM's own CLI flags, parsed by vLLM), or already running anywhere
(``engine_url="http://host:8000"``, ``api_key`` for its ``--api-key``). Calls from many
threads or tasks at once are batched by vLLM (continuous batching).
"""

from __future__ import annotations

import atexit
import functools
import os
import ssl
import threading
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
from pydantic import ConfigDict, Field, PrivateAttr

from abstain_guard.contract.metadata import BACKEND, ENTROPY, GEOMETRY, HIDDEN, LOGPROBS
from abstain_guard.errors import BackendError, InvalidInputError

from .vllm_engine import (
    ServerProcess,
    engine_python,
    free_port,
    guarded_env,
    serve_command,
    started_server,
    stop_servers,
)
from .vllm_payload import (
    PAYLOAD_KEY,
    decode_capture,
    logprob_content,
    payload_key,
    request_token,
)

#: The API key of an attached server (its ``--api-key``) when ``api_key`` is not given.
VLLM_API_KEY_ENV = "VLLM_API_KEY"
#: What a response's ``backend`` record and the artifact's decode path hold of the engine
#: (a response whose values differ from calibration's is a mismatch): among them the served
#: model's verified identity (weights, config, tokenizer, chat template) and the response's
#: LoRA adapter, so a server with other weights of the same shape is refused.
ENGINE_RECORD_KEYS = (
    "name",
    "vllm_version",
    "model_sha256",
    "lora",
    "quantization",
    "dtype",
    "device",
    "layers",
    "capture_path",
    "enforce_eager",
    "compilation_mode",
    "tensor_parallel_size",
    "prefix_caching",
    "batch_invariant",
)

#: The largest |live − stored| score move stated for a guard served on a vLLM engine that is
#: not batch-invariant (vLLM's CPU backend) when nothing was measured: a response batched
#: with others gets other last bits in its residual stream than at calibration. Calibration
#: measures the move on its server and states that instead (:meth:`record_live_bound`).
LIVE_BOUND = 1e-4

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


#: The engine record of each server URL, read once from a one-token request, and the name
#: it serves its model under (asked once).
_RECORDS: dict[str, dict[str, Any]] = {}
_SERVED: dict[str, str] = {}


def stop_engines() -> None:
    """Stop every server this process started (also done at exit) and forget what each
    server URL answered."""
    stop_servers()
    _RECORDS.clear()
    _SERVED.clear()


class VLLMChatModel(BaseChatModel):
    """A chat model generating greedily on stock vLLM, recording what the probe and
    likelihood scorers read (see the module docstring).

    Args:
        model: ``"default"`` (the embedded SmolLM2) or a local Hugging Face folder.
        gguf_file: a GGUF file inside ``model`` (converted once for vLLM).
        max_tokens: the token budget (``bind(max_tokens=...)`` per call wins).
        top_logprobs: alternatives per token in ``logprobs`` (0: the chosen token's only).
        reads: the response fields to ask the server for, of ``"logprobs"``, ``"entropy"``
            and ``"hidden"`` (what a scorer's :attr:`~abstain_guard.scorers.Scorer.reads`
            names; the hidden rows and the engine record always come): ``logprobs`` and the
            full-vocabulary ``entropy`` cost the server work on every step, so a guard's chain
            asks only for what its scorer reads (:func:`~abstain_guard.guard.chains.
            load_guard_chain`). None: every field (calibration records them all).
        dtype: the weights' dtype on a server started here.
        layers: decoder layers the server taps (default: the probe layers
            :func:`abstain_guard.contract.metadata.probe_layers`).
        engine_url: a running vLLM server (``http://host:port``) started with the guard's
            connector; unset: one is started (and shared in this process).
        api_key: the attached server's ``--api-key`` (default ``$VLLM_API_KEY``).
        served_model: the name the server serves the model under (default: its first).
        vllm_args: more ``vllm serve`` flags for a server started here, parsed by vLLM
            (``["--tensor-parallel-size", "2", "--quantization", "fp8"]``).
        python: the vLLM environment's interpreter (see :func:`engine_python`).
        memory_fraction: vLLM's ``gpu_memory_utilization`` (on the CPU backend, the share of
            host memory it reserves).
        max_model_len: the server's context length.
        startup_timeout: seconds to wait for a started server.
        request_timeout: seconds to wait for one response.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str = "default"
    gguf_file: str | None = None
    max_tokens: int | None = None
    top_logprobs: int = 5
    reads: frozenset[str] | None = Field(default=None, exclude=True)
    dtype: str = "float32"
    layers: list[int] | None = None
    engine_url: str | None = Field(default=None, exclude=True)
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    served_model: str | None = Field(default=None, exclude=True)
    vllm_args: list[str] = Field(default_factory=list, exclude=True)
    python: str | None = Field(default=None, exclude=True)
    memory_fraction: float = Field(default=0.15, exclude=True)
    max_model_len: int = 2048
    startup_timeout: float = Field(default=600.0, exclude=True)
    request_timeout: float = Field(default=600.0, exclude=True)
    _measured_bound: dict[str, Any] | None = PrivateAttr(default=None)

    @property
    def _llm_type(self) -> str:
        return "abstain-guard-vllm"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "layers": self.layers}

    # ---- the server --------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        key = self.api_key or os.environ.get(VLLM_API_KEY_ENV)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _url(self) -> str:
        """The server's URL: an attached one as given (no request), else a started one."""
        if self.engine_url is not None:
            return self.engine_url.rstrip("/").removesuffix("/v1")
        key: tuple[Any, ...] = (self.python, self.model, self.gguf_file, self.dtype)
        key += (tuple(self.layers or ()), self.memory_fraction, self.max_model_len)
        key += (tuple(self.vllm_args),)
        return started_server(key, self._start_server, self.startup_timeout)

    def _start_server(self) -> ServerProcess:
        """Stock ``vllm serve`` with the guard's connector, this model's settings and
        ``vllm_args``, stopped when this process exits."""
        port = free_port()
        cmd = serve_command(
            engine_python(self.python),
            _model_folder(self.model, self.gguf_file),
            port,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            memory_fraction=self.memory_fraction,
            layers=self.layers,
            vllm_args=self.vllm_args,
        )
        return ServerProcess(cmd, port, guarded_env())

    def _served_name(self, url: str) -> str:
        if self.served_model:
            return self.served_model
        known = _SERVED.get(url)
        if known is not None:
            return known
        try:
            response = _http().get(url + "/v1/models", headers=self._headers(), timeout=30.0)
            names = [m["id"] for m in response.raise_for_status().json()["data"]]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise BackendError(
                f"The vLLM server at {url} did not list its models ({exc}); is it a vLLM "
                "OpenAI server (vllm serve), and is api_key its --api-key?"
            ) from exc
        if not names:
            raise BackendError(f"The vLLM server at {url} serves no model.")
        _SERVED[url] = str(names[0])
        return _SERVED[url]

    def engine(self) -> tuple[str, dict[str, Any]]:
        """``(url, record)`` of the server this model generates on (started on first use):
        the record its connector sends with a one-token answer, read once per server."""
        url = self._url()
        found = _RECORDS.get(url)
        if found is None:
            hello = self._body([{"role": "user", "content": "Hi"}], 1, 0)
            hello["model"] = self._served_name(url)
            body = self._post(url + "/v1/chat/completions", hello)
            found = _RECORDS[url] = dict(self._capture(url, body)[2])
        return url, found

    def engine_record(self) -> dict[str, Any]:
        """What the artifact's decode path records of the engine (:data:`ENGINE_RECORD_KEYS`)."""
        _, info = self.engine()
        return {k: info.get(k) for k in ENGINE_RECORD_KEYS}

    def record_live_bound(self, measured: Mapping[str, Any]) -> None:
        """Keep the live-vs-stored move measured on this server (calibration measures it:
        :func:`abstain_guard.calibration.building.answering.api_generation.measure_live_bound`);
        :meth:`decoding_settings` then states its ``bound``."""
        self._measured_bound = dict(measured)

    def decoding_settings(self) -> dict[str, Any]:
        """The deployment record's ``decoding``: greedy, on the vLLM backend, this engine,
        and the live-vs-stored bound it states: 0 on a batch-invariant engine, else the
        bound measured on this server (:meth:`record_live_bound`, with the measurement under
        ``live_bound_measured``), else :data:`LIVE_BOUND`."""
        path = self.engine_record()
        measured = self._measured_bound
        settings: dict[str, Any] = {"temperature": 0.0, "backend": "vllm", "decode_path": path}
        if path.get("batch_invariant"):
            settings["live_bound"] = 0.0
        elif measured is not None:
            settings["live_bound"] = float(measured["bound"])
            settings["live_bound_measured"] = measured
        else:
            settings["live_bound"] = LIVE_BOUND
        return settings

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

    def _body(self, chat: list[dict[str, Any]] | None, budget: int, top: int) -> dict[str, Any]:
        """An OpenAI request body asking for the capture (greedy, token ids returned)."""
        asked: dict[str, Any] = {"token": request_token(self._key())}
        if not self._asks("entropy"):
            asked["entropy"] = False
        body: dict[str, Any] = {
            "max_tokens": int(budget),
            "temperature": 0.0,
            "return_token_ids": True,
            "kv_transfer_params": {PAYLOAD_KEY: asked},
        }
        if self._asks("logprobs"):
            body.update(logprobs=True, top_logprobs=int(top))
        if chat is not None:
            body["messages"] = chat
        return body

    def _asks(self, field_name: str) -> bool:
        """Whether requests ask the server for ``field_name`` (see ``reads``)."""
        return self.reads is None or field_name in self.reads

    def _payload(
        self, messages: Sequence[BaseMessage], kwargs: Mapping[str, Any]
    ) -> tuple[dict, Any]:
        """The request body (chat, or token ids with tools), and the call's tool setup."""
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
        tools, choice = kwargs.get("tools"), kwargs.get("tool_choice")
        tool_turns = any(
            m.type == "tool" or (isinstance(m, AIMessage) and m.tool_calls) for m in messages
        )
        if not tools and not tool_turns and choice in (None, "auto", "none"):
            return self._body(chat, int(budget), self.top_logprobs), None
        prompter = self._prompter()
        ids, setup = prompter.prompt(messages, tools, choice)
        body = self._body(None, int(budget), self.top_logprobs)
        body["prompt"] = ids  # the completions endpoint: the exact engine's rendering
        stops = prompter.stop_token_ids(setup)
        if stops:
            body["stop_token_ids"] = stops
        body["skip_special_tokens"] = False
        return body, setup

    def _with_calls(self, result: ChatResult, setup: Any) -> ChatResult:
        if setup is None:
            return result
        message = result.generations[0].message
        assert isinstance(message, AIMessage)
        meta = message.response_metadata
        read = self._prompter().read(message, meta["prompt_token_ids"], meta["token_ids"], setup)
        return ChatResult(generations=[ChatGeneration(message=read)])

    def _key(self) -> bytes:
        """The payload secret (``$ABSTAIN_GUARD_PAYLOAD_KEY``; for a server started here and
        no variable set, the one generated for this process)."""
        return payload_key(generate=self.engine_url is None)

    def _capture(self, url: str, body: Mapping[str, Any]) -> tuple[Any, Any, Mapping[str, Any]]:
        choices = body["choices"]
        try:
            if len(choices) != 1:
                raise BackendError(
                    f"The vLLM server answered with {len(choices)} choices (n > 1 or beam "
                    "search); a capture covers one answer, so the response is refused."
                )
            choice = choices[0]
            prompt = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
            return decode_capture(
                body.get("kv_transfer_params"), prompt, choice["token_ids"], self._key()
            )
        except BackendError as exc:
            raise BackendError(f"{exc} (server {url})") from exc

    def _result(self, url: str, body: Mapping[str, Any]) -> ChatResult:
        """The message of a server response; its ``backend`` record is the one the server
        sent with it (what computed this response, not what answered earlier)."""
        choice = body["choices"][0]
        entropy, hidden, engine = self._capture(url, body)
        ids = [int(t) for t in choice["token_ids"]]
        content = logprob_content(choice.get("logprobs"), ids)
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        meta = {
            "model_name": str(self.model),
            "finish_reason": choice.get("finish_reason"),
            "prompt_token_ids": [
                int(t) for t in body.get("prompt_token_ids") or choice.get("prompt_token_ids") or []
            ],
            "token_ids": ids,
            "tokens": [c["token"] for c in content],
            LOGPROBS: {"content": content},
            ENTROPY: entropy,
            GEOMETRY: {HIDDEN: hidden},
            BACKEND: {k: engine.get(k) for k in ENGINE_RECORD_KEYS},
        }
        message = AIMessage(content=str(text or ""), response_metadata=meta)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _error(self, url: str, exc: Exception) -> BackendError:
        detail = ""
        if isinstance(exc, httpx.HTTPStatusError):
            detail = f": {exc.response.text[:300]}"
        return BackendError(f"The vLLM server at {url} failed the request ({exc}){detail}.")

    def _request(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: Mapping[str, Any]
    ) -> tuple[str, dict, Any]:
        """``(endpoint URL, request body, tool setup)`` of one call (sync and async alike)."""
        if stop:
            raise InvalidInputError(
                "The vLLM backend generates without stop strings (the capture needs the "
                "engine to stop on a token)."
            )
        payload, setup = self._payload(messages, kwargs)
        url = self._url()
        payload["model"] = self._served_name(url)
        path = "/v1/completions" if "prompt" in payload else "/v1/chat/completions"
        return url + path, payload, setup

    def _post(self, endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The server's JSON answer to ``payload`` (this process's pooled client)."""
        try:
            response = _http().post(
                endpoint, json=payload, headers=self._headers(), timeout=self.request_timeout
            )
            return dict(response.raise_for_status().json())
        except httpx.HTTPError as exc:
            raise self._error(endpoint, exc) from exc

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        endpoint, payload, setup = self._request(messages, stop, kwargs)
        return self._with_calls(self._result(endpoint, self._post(endpoint, payload)), setup)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        endpoint, payload, setup = self._request(messages, stop, kwargs)
        try:
            async with httpx.AsyncClient(
                timeout=self.request_timeout, verify=_tls_context()
            ) as client:
                response = await client.post(endpoint, json=payload, headers=self._headers())
                body = response.raise_for_status().json()
        except httpx.HTTPError as exc:
            raise self._error(endpoint, exc) from exc
        return self._with_calls(self._result(endpoint, body), setup)


_HTTP: dict[int, httpx.Client] = {}
_HTTP_LOCK = threading.Lock()


def _http() -> httpx.Client:
    """This process's client for the servers: one connection pool (keep-alive) and one TLS
    context for every request (``httpx.post`` builds both per request, and the TLS context is
    the costly part)."""
    with _HTTP_LOCK:
        client = _HTTP.get(os.getpid())  # per process: a forked child opens its own sockets
        if client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            client = _HTTP[os.getpid()] = httpx.Client(limits=limits)
        return client


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once (an async client is bound to its event loop,
    so each call makes one, but not its TLS context)."""
    return httpx.create_ssl_context()


@atexit.register
def _close_http() -> None:
    """Close this process's client (a forked child's copy of its parent's is the parent's)."""
    client = _HTTP.pop(os.getpid(), None)
    if client is not None:
        client.close()


@functools.lru_cache(maxsize=16)
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
