"""The state every part of :class:`~.model.GeometryChatModel` shares: its fields, the loaded
model, how a call's messages and tools become prompt ids and how its answers become
``AIMessage`` objects with their generation record."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Self

import torch
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.prompt_values import PromptValue
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr

from abstain_guard.contract.deployment import sha256_text
from abstain_guard.contract.metadata import GENERATION
from abstain_guard.errors import InvalidInputError, ModelError

from ..capture.architectures import ArchitectureSpec
from ..capture.parts_rule import PartsRule
from ..capture.session import default_parts
from ..capture.types import ReferenceMeans
from ..engine.batching import GenerationRequest
from ..engine.encoding import (
    PLAIN_TEMPLATE,
    ToolRendering,
    chat_dicts,
    prompt_head,
    prompt_ids,
)
from ..engine.generation import (
    GENERATION_OPTIONS,
    Generated,
    GenerationCall,
    call_options,
    cut_markers,
    generation_record,
    to_message,
    validate_options,
)
from ..engine.prefix import PREFIX_RULE, split_point
from ..engine.response_metadata import numerics_record
from ..engine.streaming import cut_at_stop
from ..engine.threads import choose_decode_path, engine_workers
from ..model.loading import (
    DEFAULT_MODEL_NAME,
    LoadedModel,
    load_pretrained,
    model_fingerprint,
    wrap_model,
)
from ..tools.calls import (
    ToolSetup,
    decode_keeping,
    normalize_tool_choice,
    run_seed,
    tool_setup,
    with_tool_calls,
)
from ..tools.formats import detect_tool_call_format, template_has_tool_role
from ..tools.schema import schema_name


class ChatCore(BaseChatModel):
    """The fields, loaded model and encoding of a local chat model (the public class and its
    documentation: :class:`~.model.GeometryChatModel`)."""

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
    capture: Literal["full", "fast"] = Field(
        default="full",
        description=(
            "geometry capture mode: 'full' (Ω, Θ, Φ; exact per-source attention parts) or "
            "'fast' (Θ, Φ, ω_dir only; the attention kernel runs untouched; no ω_prop)"
        ),
    )
    top_logprobs: int = 5
    max_batch_size: int = Field(
        default=8, ge=1, description="answers decoded together in one step (shared model)"
    )
    max_queue: int = Field(
        default=64, ge=1, description="calls that may wait for the model before it refuses more"
    )
    batch_decode: bool = Field(
        default=True,
        description=(
            "share decode steps between concurrent callers where the model's weights keep "
            "rows independent (False: decode each answer alone); part of decode_path "
            "(docs/architecture.md, 'Concurrent callers')"
        ),
    )
    prefix_cache: bool = Field(
        default=True,
        description=(
            "the prefix path: split every prompt pass after the shared prefix, computed once "
            "per prefix and reused; part of decode_path (docs/architecture.md)"
        ),
    )
    capture_parts: PartsRule | None = Field(
        default=None,
        description=(
            "full capture's attention-parts rule (None: the library's default; the guard "
            "sets its artifact's, with_capture_parts); part of decode_path"
        ),
    )

    _shared: LoadedModel | None = PrivateAttr(default=None)
    _reference: ReferenceMeans | None = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        """Validate the generation options (typed errors), then build the pydantic model."""
        fields = type(self).model_fields
        validate_options(
            **{
                k: data.get(k, fields[k].default)
                for k in ("max_new_tokens", "temperature", "top_p", "top_k", "top_logprobs")
            }
        )
        super().__init__(**data)

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf_model: Any, tokenizer: Any, **options: Any) -> Self:
        """Wrap an already loaded causal LM and its tokenizer (weights are not copied)."""
        loaded = wrap_model(hf_model, tokenizer)
        options.setdefault(
            "model_name", str(getattr(hf_model.config, "_name_or_path", "") or "local-model")
        )
        model = cls(**options)
        model._shared = loaded
        return model

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        gguf_file: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        device_map: str | dict[str, Any] | None = None,
        **options: Any,
    ) -> Self:
        """Load a local Hugging Face folder (or a folder holding ``gguf_file``), offline;
        ``dtype``, ``device`` and ``device_map`` as in :func:`..model.loading.load_pretrained`.

        Raises ModelNotFoundError when ``path`` is not a local folder (hub ids would need the
        network) and UnsupportedArchitectureError for families capture does not support.
        """
        hf_model, tokenizer = load_pretrained(path, gguf_file, dtype, device, device_map)
        options.setdefault(
            "model_name", gguf_file.removesuffix(".gguf") if gguf_file else Path(path).name
        )
        return cls.from_hf(hf_model, tokenizer, **options)

    def with_reference(self, means: ReferenceMeans | None) -> Self:
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
    def _s(self) -> LoadedModel:
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
            shared.fingerprint = model_fingerprint(shared.hf_model)
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

    def _chat_dicts(self, messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
        """The plain dicts (no tool rendering): what the generation record reads."""
        return chat_dicts(messages, self.system_prompt)

    @property
    def _template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def _rendering(self, setup: ToolSetup | None) -> ToolRendering:
        """How this template shows tool calls, results and (prompted) the tool block."""
        return ToolRendering(
            format=setup.format if setup is not None else self.tool_call_format,
            tool_role=template_has_tool_role(self._template),
            block=setup.prompt_block if setup is not None else None,
        )

    def _prompt(
        self, messages: Sequence[BaseMessage], setup: ToolSetup | None
    ) -> tuple[list[int], int | None]:
        """Prompt ids: the rendered conversation with the generation prompt, then the
        forced call's opening (:func:`..tools.calls.tool_prefill`) when ``setup`` forces one; and
        where they split on the prefix path (:func:`..engine.prefix.split_point`; None when
        :attr:`prefix_cache` is off)."""
        dicts = chat_dicts(messages, self.system_prompt, self._rendering(setup))
        tools = setup.template_tools if setup else None
        ids = prompt_ids(self.tokenizer, dicts, tools)
        if setup is not None and setup.prefill:
            prefill = self.tokenizer(setup.prefill, add_special_tokens=False)["input_ids"]
            ids.extend(int(t) for t in prefill)
        if not self.prefix_cache:
            return ids, None
        return ids, split_point(ids, prompt_head(self.tokenizer, dicts, tools))

    # -- tools -------------------------------------------------------------------------------

    @property
    def tool_call_format(self) -> str:
        """The tool-call format of the chat template
        (:func:`..tools.formats.detect_tool_call_format`: "hermes", "llama3", "mistral", or
        "prompted" for templates that take no tools)."""
        return detect_tool_call_format(self._template)

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` (OpenAI-format schemas via ``convert_to_openai_tool``)
        bound to every call. ``tool_choice``: None/"auto" (the model decides), "none" (no
        call: the reply is text), "any" or "required" (some tool), a tool name or
        ``{"type": "function", "function": {"name": ...}}`` (that tool); a forced call is
        begun in the prompt. Calls whose arguments do not validate against their tool's
        schema come back in ``invalid_tool_calls`` (:func:`..tools.schema.tool_args_error`).
        ``strict`` and ``parallel_tool_calls`` are accepted and ignored; other ``kwargs``
        are generation options bound with them."""
        kwargs.pop("strict", None)
        kwargs.pop("parallel_tool_calls", None)
        schemas = [convert_to_openai_tool(t) for t in tools]
        choice = normalize_tool_choice(tool_choice, [schema_name(s) for s in schemas])
        return self.bind(tools=schemas, tool_choice=choice, **kwargs)

    def _settings(
        self, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], ToolSetup | None]:
        """The call's generation options and its tools (``tools`` / ``tool_choice`` are
        taken out of ``kwargs`` first: they are not generation options)."""
        rest = dict(kwargs)
        tools, choice = rest.pop("tools", None), rest.pop("tool_choice", None)
        rest.pop("ls_structured_output_format", None)  # tracing hint of with_structured_output
        opts = self._options(stop, rest)
        setup = tool_setup(tools, choice, self.tool_call_format)
        opts["end_markers"] = list(setup.end_markers) if setup is not None else []
        opts["turn_markers"] = [] if self._template else list(PLAIN_TEMPLATE.turn_markers)
        return opts, setup

    def _with_calls(
        self,
        msg: AIMessage,
        prompt: list[int],
        gen: Generated,
        opts: dict[str, Any],
        setup: ToolSetup | None,
    ) -> AIMessage:
        """``msg`` with the tool calls of its answer (as it is without tools)."""
        if setup is None:
            return msg
        decoded = decode_keeping(self.tokenizer, gen.token_ids, setup.spec.markers)
        text = setup.prefill + cut_at_stop(decoded, cut_markers(opts))[0]
        seed = run_seed(prompt, gen.token_ids)
        return with_tool_calls(msg, setup.read(text, seed))

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        defaults = {k: getattr(self, k) for k in GENERATION_OPTIONS}
        opts = call_options(defaults, self.stop, stop, kwargs)
        opts["capture"] = self.capture  # geometry capture mode (a model field, not per call)
        opts["parts"] = self.capture_parts  # and its attention-parts rule
        return opts

    def with_capture_parts(self, record: Mapping[str, Any] | None) -> Self:
        """This model (a shallow copy sharing the weights, lock and scheduler when the rule
        differs) capturing with the attention-parts rule of a decode path's ``parts`` record
        (None: the rule of paths recorded without it,
        :data:`~..capture.parts_rule.UNRECORDED_PARTS`)."""
        rule = PartsRule.from_record(record)
        if (self.capture_parts or default_parts()) == rule:
            return self
        return self.model_copy(update={"capture_parts": rule})

    def _call(self, opts: dict[str, Any], keep_states: bool = False) -> GenerationCall:
        """The call's generation on the model's shared scheduler (:mod:`..engine.scheduler`,
        bounded by this model's fields)."""
        limits = {
            "max_batch": self.max_batch_size,
            "max_queue": self.max_queue,
            "batch_decode": self.batch_decode,
        }
        return GenerationCall(self._s, opts, self._reference, limits, keep_states)

    def _requests(
        self,
        conversations: Sequence[Sequence[BaseMessage]],
        opts: dict[str, Any],
        setup: ToolSetup | None,
        keep_states: bool = False,
    ) -> tuple[GenerationCall, list[GenerationRequest], list[list[int]]]:
        """The call's generation, its requests (one per conversation, split where
        :meth:`_prompt` splits it, its token budget capped per prompt as if alone) and the
        prompt ids."""
        encoded = [self._prompt(self._to_messages(list(c)), setup) for c in conversations]
        prompts = [p for p, _ in encoded]
        call = self._call(opts, keep_states)
        requests = call.requests(prompts, int(opts["max_new_tokens"]), [s for _, s in encoded])
        return call, requests, prompts

    def _messages(
        self,
        conversations: Sequence[Sequence[BaseMessage]],
        prompts: list[list[int]],
        gen: list[Generated],
        opts: dict[str, Any],
        setup: ToolSetup | None = None,
    ) -> list[AIMessage]:
        msgs = []
        for conv, p, g in zip(conversations, prompts, gen, strict=True):
            msg = to_message(self.tokenizer, self.model_name, self.num_layers, p, g, opts)
            msg = self._with_calls(msg, p, g, opts, setup)
            msg.response_metadata[GENERATION] = self._generation_record(
                conv, opts, setup, g.decode_path
            )
            msgs.append(msg)
        return msgs

    @property
    def chat_template_sha256(self) -> str | None:
        """Hash of the tokenizer's chat template, or of :data:`PLAIN_TEMPLATE` (the prompt of
        a tokenizer without one)."""
        return sha256_text(self._template or PLAIN_TEMPLATE.text)

    def _generation_record(
        self,
        conversation: Sequence[BaseMessage],
        opts: dict[str, Any],
        setup: ToolSetup | None = None,
        decode_path: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The settings of one call, for the guard's exchangeability check
        (:func:`abstain_guard.contract.deployment.generation_mismatches`); the system prompt hash is
        that of the user's system prompt (without the prompted tool block)."""
        dicts = self._chat_dicts(self._to_messages(list(conversation)))
        record = generation_record(
            dicts, opts, self.chat_template_sha256, self.batch_decode, setup, decode_path
        )
        return {**record, **numerics_record(self.hf_model)}

    def decoding_settings(self) -> dict[str, Any]:
        """Decoding settings as the generation record states them (for calibration)."""
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": self.top_k,
            "stop": list(self.stop or []),
            "batch_decode": bool(self.batch_decode),
            "decode_path": self.decode_path(),
            **numerics_record(self.hf_model),
        }

    def decode_path(self) -> dict[str, Any]:
        """The decode path this model's engine takes (:func:`..engine.threads.choose_decode_path`,
        the function the engine itself calls; the prefix path with :attr:`prefix_cache`), as
        its responses record it."""
        path = choose_decode_path(self.hf_model, self.batch_decode, self.max_batch_size)
        prefix = PREFIX_RULE if self.prefix_cache else None
        return replace(path, prefix=prefix, parts=self.capture_parts or default_parts()).record()

    def engine_workers(self) -> int:
        """Engines this model's scheduler runs side by side
        (:func:`..engine.threads.engine_workers`: one per CPU of the process on a CPU model); each
        decodes up to ``max_batch_size`` rows per step."""
        sched = self._s.scheduler
        return int(sched.workers) if sched is not None else engine_workers(self.hf_model)
