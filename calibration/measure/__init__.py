"""Measuring an artifact: held-out evaluation against baselines, metrics with bootstrap
intervals, the resplit simulation of the guarantee, the report, the demo and the live
deployment check.

Modules, from the commands down to the arithmetic:

* :mod:`.held_out` — ``abstain-guard evaluate``: collect held-out answers, score them with
  the artifact's scorer and the baselines, and write the report (:func:`evaluate`);
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
