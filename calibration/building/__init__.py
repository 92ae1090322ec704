"""Building an artifact, once, offline: data sets (:mod:`.datasets`, :mod:`.dataset_files`,
:mod:`.named_datasets`), the built-in probe set (:mod:`.probe`), judges (:mod:`.judges`),
the generation step (:mod:`.generation`), the pipeline (:mod:`.pipeline`, ``abstain-guard
calibrate``) and its resumable run cache (:mod:`.store`)."""

from __future__ import annotations

from abstain_guard.calibration.building.config import CalibrationConfig
from abstain_guard.calibration.building.dataset_files import DatasetReport, load_dataset
from abstain_guard.calibration.building.datasets import QAItem, split_items
from abstain_guard.calibration.building.judges import make_judge
from abstain_guard.calibration.building.named_datasets import NAMED_DATASETS, load_named_dataset
from abstain_guard.calibration.building.pipeline import CalibrationSummary, calibrate
from abstain_guard.calibration.building.probe import builtin_probe_set
from abstain_guard.calibration.building.store import RunStore

__all__ = [
    "NAMED_DATASETS",
    "CalibrationConfig",
    "CalibrationSummary",
    "DatasetReport",
    "QAItem",
    "RunStore",
    "builtin_probe_set",
    "calibrate",
    "load_dataset",
    "load_named_dataset",
    "make_judge",
    "split_items",
]
