"""What the chat model's mixins (:mod:`.streaming`, :mod:`.batch`) use of
:class:`~.model.GeometryChatModel`, declared once for the type checker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessage, BaseMessage

from ..capture.types import ReferenceMeans
from ..engine.generation import Generated
from ..model.loading import LoadedModel
from ..tools.calls import ToolSetup


class ChatHost:
    """Base of the chat model's mixins: the members they call, provided by the model."""

    if TYPE_CHECKING:  # provided by GeometryChatModel

        @property
        def tokenizer(self) -> Any: ...

        @property
        def _s(self) -> LoadedModel: ...

        @property
        def _limits(self) -> dict[str, Any]: ...

        _reference: ReferenceMeans | None

        def _settings(
            self, stop: list[str] | None, kwargs: dict[str, Any]
        ) -> tuple[dict[str, Any], ToolSetup | None]: ...

        def _prompt(
            self, messages: Sequence[BaseMessage], setup: ToolSetup | None
        ) -> tuple[list[int], int | None]: ...

        def _messages(
            self,
            conversations: Sequence[Sequence[BaseMessage]],
            prompts: list[list[int]],
            gen: list[Generated],
            opts: dict[str, Any],
            setup: ToolSetup | None = None,
        ) -> list[AIMessage]: ...


__all__ = ["ChatHost"]
