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
``abstain_guard.errors``, ``abstain_guard.lazy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from abstain_guard.lazy import lazy_attributes

from .hypotheses import hypothesis_checks, validate_importance
from .metrics import (
    auprc,
    auroc,
    auroc_interval,
    bootstrap_draws,
    bootstrap_intervals,
    percentile_interval,
    prr,
)
from .ranking import scorer_table
from .report import write_report
from .results import (
    build_results,
    evaluate_dataset,
    evaluate_scores,
)
from .simulation import resplit_simulation

if TYPE_CHECKING:
    from .demo import run_demo
    from .deployment_check import live_check
    from .held_out import evaluate

__all__ = [
    "auprc",
    "auroc",
    "auroc_interval",
    "bootstrap_draws",
    "bootstrap_intervals",
    "build_results",
    "evaluate",
    "evaluate_dataset",
    "evaluate_scores",
    "hypothesis_checks",
    "live_check",
    "percentile_interval",
    "prr",
    "resplit_simulation",
    "run_demo",
    "scorer_table",
    "validate_importance",
    "write_report",
]

# Lazy: the commands load models (torch, transformers) through building/ and inference/; importing
# the metrics or writing a report from results.json must not pay for that.
_COMMANDS = {
    "evaluate": "abstain_guard.calibration.measure.held_out",
    "live_check": "abstain_guard.calibration.measure.deployment_check",
    "run_demo": "abstain_guard.calibration.measure.demo",
}


__getattr__ = lazy_attributes(__name__, _COMMANDS)
