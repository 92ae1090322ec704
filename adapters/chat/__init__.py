"""The LangChain surface of a local model: :class:`~.model.GeometryChatModel` (:mod:`.model`:
``invoke``, ``batch``), its fields, prompts and messages (:mod:`.core`), its token streaming
(:mod:`.streaming`: ``stream`` / ``astream``) and its replay (:mod:`.replay`).

May import: ``abstain_guard.adapters.capture``, ``abstain_guard.adapters.engine``,
``abstain_guard.adapters.model``, ``abstain_guard.adapters.tools``,
``abstain_guard.contract``, ``abstain_guard.errors``.
"""
