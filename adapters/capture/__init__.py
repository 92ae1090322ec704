"""Exact per-token geometry captured inside a transformers forward pass.

* :mod:`.session` — :class:`~.session.CaptureSession`: the hooks of one generation or replay
  and the signals they give per token (Ω, Θ, Φ, ω);
* :mod:`.decode_step` — a decode step's capture, all layers at once at the end of the step;
* :mod:`.features` — per-block assembly of Θ, Φ, ω_dir and the ``StepFeatures`` container;
* :mod:`.attention` — the capturing attention function registered with transformers;
* :mod:`.hook_routes` — hooks that stay registered and are routed per calling context;
* :mod:`.architectures` — where the hooks go in each supported family;
* :mod:`.source_parts` — exact attention proximities without a per-source cache;
* :mod:`.parts_rule` — the rule by which "auto" picks their strategy (part of the decode path);
* :mod:`.geometry` (NumPy: the definitions) and :mod:`.geometry_torch` (their torch
  versions);
* :mod:`.types` — the data containers (``TokenStates``, ``ReplayResult``,
  ``ReferenceMeans``).

May import: ``abstain_guard.contract``, ``abstain_guard.errors``.
"""
