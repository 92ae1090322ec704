"""The guard as LangChain runs it: a runnable, an agent middleware, and the policy both apply.

* :mod:`.runnable` — :class:`~.runnable.AbstentionGuard`: ``invoke``, ``batch``, ``stream``
  around a chat model or a chain ending in one;
* :mod:`.middleware` — :class:`~.middleware.AbstentionMiddleware` for LangChain v1 agents
  (the ``agents`` extra);
* :mod:`.policy` — :class:`~.policy.AbstentionPolicy`: how one message becomes the guard's
  output (checks, score, decision), shared by both;
* :mod:`.stream_gate` — certified streaming: the gate that releases text chunk by chunk;
* :mod:`.abstain_actions` — where an agent run goes when the guard stops it;
* :mod:`.tracing` — each decision as callback event, run tags and OpenTelemetry attributes;
* :mod:`.chains` — :func:`~.chains.load_guard_chain`: an artifact's guard chain as deployed.

May import: ``abstain_guard.monitor``, ``abstain_guard.artifact``, ``abstain_guard.backends``,
``abstain_guard.adapters`` (inside :func:`~.chains.load_chat_model` only),
``abstain_guard.contract``, ``abstain_guard.guarantee``, ``abstain_guard.config``,
``abstain_guard.errors``.
"""
