"""Building and measuring a guard artifact (installed as ``abstain_guard.calibration``).

Three parts, named for when their code runs:

* :mod:`.inference` — scorers the guard runs on every answer (geometry scorer, its XGBoost
  calibrator, the model-based baselines), loaded from an artifact by the scorer registry;
* :mod:`.building` — building an artifact once, offline: data sets, the built-in probe set,
  judges, the calibration pipeline and its run cache (``abstain-guard calibrate``);
* :mod:`.measure` — measuring an artifact: held-out evaluation against baselines, metrics
  with bootstrap intervals, the resplit simulation, the report, the demo and the live
  deployment check (``abstain-guard evaluate``, ``report``, ``demo``).

``measure`` imports ``building`` and ``inference``; ``building`` imports ``inference`` only to fit
a scorer; ``inference`` imports neither. See ``docs/architecture.md``.

Typical use::

    from . import CalibrationConfig, calibrate
    summary = calibrate("builtin", "guard/", config=CalibrationConfig(limit=600))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from abstain_guard.lazy import lazy_attributes

from .building.calibration_config import CalibrationConfig
from .building.dataset_files import load_dataset
from .building.datasets import QAItem, split_items
from .building.judges import Judge, Judgment, make_judge
from .building.named_datasets import load_named_dataset
from .building.pipeline import CalibrationSummary, calibrate
from .building.probe import builtin_probe_set

if TYPE_CHECKING:
    from abstain_guard.calibration.inference.calibrated import CalibratedScorer
    from abstain_guard.calibration.inference.geometry import GeometryScorer

    from .measure.deployment_check import live_check
    from .measure.held_out import evaluate

__all__ = [
    "CalibratedScorer",
    "CalibrationConfig",
    "CalibrationSummary",
    "GeometryScorer",
    "Judge",
    "Judgment",
    "QAItem",
    "builtin_probe_set",
    "calibrate",
    "evaluate",
    "live_check",
    "load_dataset",
    "load_named_dataset",
    "make_judge",
    "split_items",
]

# Lazy: these import torch, transformers and xgboost; building configs, reading data sets
# or judging answers must not pay for that.
_HOME = {
    "CalibratedScorer": "abstain_guard.calibration.inference.calibrated",
    "GeometryScorer": "abstain_guard.calibration.inference.geometry",
    "evaluate": "abstain_guard.calibration.measure.held_out",
    "live_check": "abstain_guard.calibration.measure.deployment_check",
}


__getattr__ = lazy_attributes(__name__, _HOME)
