"""The LangChain surface of a local model: :class:`~.model.GeometryChatModel` (:mod:`.model`)
and its parts — ``batch`` (:mod:`.batch`), ``stream`` / ``astream`` (:mod:`.streaming`),
``replay`` / ``replay_batch`` (:mod:`.replay`) — with :mod:`.host`, what those parts use of
the model, declared once for the type checker.

May import: ``abstain_guard.adapters.capture``, ``abstain_guard.adapters.engine``,
``abstain_guard.adapters.model``, ``abstain_guard.adapters.tools``,
``abstain_guard.contract``, ``abstain_guard.errors``.
"""
