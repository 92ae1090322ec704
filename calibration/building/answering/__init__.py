"""The model answers the questions, as the deployed guard will have it answer them.

* :mod:`.answer_rows` — one answer as the run cache holds it, and what every generator
  shares (chunks, held-out splits, the reference means' digest);
* :mod:`.answers` — the local model's answers (batched, cached, with capture) and their
  replay as deployed; :mod:`.api_generation` — an API chat model's;
* :mod:`.online_geometry` — the geometry scorer's inputs captured while generating;
* :mod:`.agents` — a user's agent run on the questions, as deployed;
* :mod:`.stream_calibration` — each answer's scores at the chunk ends of a stream rule;
* :mod:`.models` — the chat model a run loads;
* :mod:`.executors` and :mod:`.ray_judges` — generation and judging on Ray actors.

May import: ``abstain_guard.calibration.building.judges``,
``abstain_guard.calibration.building.questions``, ``abstain_guard.calibration.building.run``,
``abstain_guard.guard``, ``abstain_guard.adapters``, ``abstain_guard.scorers``,
``abstain_guard.contract``, ``abstain_guard.errors``.
"""
