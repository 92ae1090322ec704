"""The questions a calibration run asks, and their gold answers.

* :mod:`.datasets` — :class:`~.datasets.QAItem` and the seeded split;
* :mod:`.items` — which questions a run uses, checked before any model loads;
* :mod:`.dataset_files` — JSON Lines / CSV files; :mod:`.named_datasets` — public sets by name;
* :mod:`.probe` and :mod:`.probe_relations` — the built-in probe set;
* :mod:`.agent_questions` and :mod:`.lookup_facts` — the lookup agent's questions and facts;
* :mod:`.conversations` — earlier turns of a multi-turn row; :mod:`.tool_labels` — a row's
  expected tool calls;
* :mod:`.answer_text` — answer text analysis (normalisation, gold aliases, refusals, hedges):
  the data sets normalise their golds with it, the rule-based judges match with it.

May import: ``abstain_guard.calibration.building.run``, ``abstain_guard.contract``,
``abstain_guard.guarantee``, ``abstain_guard.errors``.
"""
