"""Building and measuring a guard artifact (installed as ``abstain_guard.calibration``).

Two parts, named for when their code runs (both offline; the scorers the guard runs on every
answer live in :mod:`abstain_guard.scorers`):

* :mod:`.building` — building an artifact once, offline: data sets, the built-in probe set,
  judges, the calibration pipeline and its run cache (``abstain-guard calibrate``);
* :mod:`.measure` — measuring an artifact: held-out evaluation against baselines, metrics
  with bootstrap intervals, the resplit simulation, the report, the demo and the live
  deployment check (``abstain-guard evaluate``, ``report``, ``demo``).

``measure`` imports ``building``; both import :mod:`abstain_guard.scorers` to fit and score;
nothing on the live path (the guard, the scorers) imports ``calibration``. See
``docs/architecture.md``.

May import: ``abstain_guard.calibration.building``, ``abstain_guard.calibration.measure``,
``abstain_guard.lazy``.

Typical use::

    from abstain_guard.calibration import CalibrationConfig, calibrate
    summary = calibrate("builtin", "guard/", config=CalibrationConfig(limit=600))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from abstain_guard.lazy import lazy_attributes

from .building.judges.base import Judge, Judgment
from .building.judges.registry import make_judge
from .building.pipeline import CalibrationSummary, calibrate
from .building.questions.dataset_files import load_dataset
from .building.questions.datasets import QAItem
from .building.questions.named_datasets import load_named_dataset
from .building.questions.probe import builtin_probe_set
from .building.run.calibration_config import CalibrationConfig

if TYPE_CHECKING:
    from .measure.deployment_check import live_check
    from .measure.evaluate import evaluate

__all__ = [
    "CalibrationConfig",
    "CalibrationSummary",
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
]

# Lazy: these import torch, transformers and xgboost; building configs, reading data sets
# or judging answers must not pay for that.
_HOME = {
    "evaluate": "abstain_guard.calibration.measure.evaluate",
    "live_check": "abstain_guard.calibration.measure.deployment_check",
}
__getattr__ = lazy_attributes(__name__, _HOME)
