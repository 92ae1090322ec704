"""Measuring an artifact: held-out evaluation against baselines, metrics with bootstrap
intervals, the resplit simulation of the guarantee, the report, the demo and the live
deployment check.

Modules, from the commands down to the arithmetic:

* :mod:`.evaluate` — ``abstain-guard evaluate`` (:func:`~.evaluate.evaluate`): the held-out
  answers (:mod:`.held_out`) scored with the artifact's scorer and the baselines
  (:mod:`.baselines`), written as one report;
* :mod:`.deployment_check` — ``abstain-guard evaluate --live``: the guard as deployed;
* :mod:`.demo` — ``abstain-guard demo``;
* :mod:`.permutation_importance` — permutation ablation of the geometry scorer;
* :mod:`.results` — the results document (one entry per data set) that the report renders;
* :mod:`.ranking` — ranking metrics per scorer, within-type AUROC;
* :mod:`.simulation` — the conformal resplit simulation;
* :mod:`.hypotheses` — the paper's hypothesis checks, the permutation-importance layout;
* :mod:`.metrics` — AUROC, AUPRC, PRR and their bootstrap intervals;
* :mod:`.report`, :mod:`.tables`, :mod:`.plots` — ``report.md``, its tables and figures.

``measure`` sits on top: it imports ``building``, which never imports it.

May import: ``abstain_guard.calibration.building``, ``abstain_guard.guard``,
``abstain_guard.monitor``, ``abstain_guard.artifact``, ``abstain_guard.backends``,
``abstain_guard.scorers``,
``abstain_guard.contract``, ``abstain_guard.guarantee``, ``abstain_guard.config``,
``abstain_guard.errors``.
"""
