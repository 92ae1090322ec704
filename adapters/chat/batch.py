"""``batch`` and ``generate_with_states`` of :class:`~.model.GeometryChatModel`: many
inputs go to the model's scheduler at once and share its decode steps; each answer is
bitwise the one ``invoke`` gives for that input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks import CallbackManager
from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import ensure_config, get_config_list

from ..capture.architectures import ArchitectureSpec
from ..capture.types import TokenStates
from ..engine.generation import generate_tokens, new_token_budget, unzip_prompts
from ..tools.calls import ToolSetup
from .host import ChatHost


class BatchMixin(ChatHost):
    """``batch`` and ``generate_with_states`` of the chat model."""

    if TYPE_CHECKING:  # provided by GeometryChatModel (besides ChatHost's)
        callbacks: Any
        verbose: bool
        tags: list[str] | None
        metadata: dict[str, Any] | None

        @property
        def _serialized(self) -> dict[str, Any]: ...

        @property
        def _identifying_params(self) -> dict[str, Any]: ...

        @property
        def _spec(self) -> ArchitectureSpec: ...

        def _to_messages(self, messages: Any) -> list[BaseMessage]: ...

        def _generate_messages(
            self,
            conversations: Sequence[Sequence[BaseMessage]],
            opts: dict[str, Any],
            setup: ToolSetup | None = None,
        ) -> list[AIMessage]: ...

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

    def generate_with_states(
        self, inputs: Sequence[LanguageModelInput], **kwargs: Any
    ) -> list[tuple[AIMessage, TokenStates | None]]:
        """Generate for ``inputs`` in one left-padded batch, as :meth:`batch` does (geometry
        always captured), and also return each answer's per-token states ``[N, L, D]``
        (e~^l, e^l): what calibration needs to fit reference means without a replay. Runs
        no callbacks; ``kwargs`` are generation options (``max_new_tokens``, ...)."""
        conversations = [self._to_messages(x) for x in inputs]
        stop = kwargs.pop("stop", None)
        opts, setup = self._settings(stop, {**kwargs, "capture_geometry": True})
        prompts, splits = unzip_prompts([self._prompt(c, setup) for c in conversations])
        max_new = new_token_budget(prompts, int(opts["max_new_tokens"]), self._spec.context_length)
        gen = generate_tokens(
            self._s,
            prompts,
            max_new,
            opts,
            self._reference,
            keep_states=True,
            limits=self._limits,
            prefixes=splits,
        )
        msgs = self._messages(conversations, prompts, gen, opts, setup)
        return [(msg, g.states) for msg, g in zip(msgs, gen, strict=True)]


__all__ = ["BatchMixin"]
