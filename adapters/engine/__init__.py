"""The engine a local model generates on: concurrent callers, exact per row.

* :mod:`.scheduler` — one scheduler per model: callers submit requests, engines (one per CPU)
  run them;
* :mod:`.batching` — step-level batching that gives every row exactly its solo numbers;
* :mod:`.shared_step` — one decode forward over several rows, each on its own cache and hooks;
* :mod:`.generation` — requests, stacked capture steps, the ``AIMessage``;
* :mod:`.prefix` — the prefix path: the shared prompt prefix computed once;
* :mod:`.replay` — teacher-forced features of existing answers;
* :mod:`.encoding` — LangChain messages to chat-template token ids;
* :mod:`.streaming` — token ids to text pieces later tokens cannot change;
* :mod:`.response_metadata` — the ``response_metadata`` it writes;
* :mod:`.threads` — the decode path (BLAS threads, shared or lone decode steps);
* :mod:`.kernel_env` — the CPU kernels asked for, set before torch computes (imported first by
  ``abstain_guard.adapters``); :mod:`.kernels` — the kernel facts read back.

May import: ``abstain_guard.adapters.capture``, ``abstain_guard.adapters.model``,
``abstain_guard.adapters.tools``, ``abstain_guard.contract``, ``abstain_guard.errors``.
"""
