"""Building an artifact, once, offline (``abstain-guard calibrate``).

Its own modules are the steps that use everything below: the pipeline (:mod:`.pipeline`), the
checks before a model loads (:mod:`.preflight`), agent calibration (:mod:`.agent_calibration`,
with the labels of agent runs, :mod:`.run_labels`) and recalibration from a monitor log
(:mod:`.recalibrate`). Below them, by concept:

* :mod:`.answering` — the model answers the questions (local, API, agents, Ray);
* :mod:`.judges` — judges and judging a run's answers (the labels);
* :mod:`.questions` — data sets, the built-in probe set, the lookup agent's questions;
* :mod:`.run` — the run's settings (:class:`CalibrationConfig`), its resumable cache and lock.

May import: ``abstain_guard.calibration.building.answering``,
``abstain_guard.calibration.building.judges``, ``abstain_guard.calibration.building.questions``,
``abstain_guard.calibration.building.run``, ``abstain_guard.monitor``,
``abstain_guard.artifact``, ``abstain_guard.backends``, ``abstain_guard.scorers``,
``abstain_guard.adapters``, ``abstain_guard.contract``, ``abstain_guard.guarantee``,
``abstain_guard.errors``.
"""
