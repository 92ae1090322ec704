"""Building an artifact, once, offline: data sets (:mod:`.datasets`, :mod:`.dataset_files`,
:mod:`.named_datasets`), the built-in probe set (:mod:`.probe`), judges (:mod:`.judges`),
the generation step (:mod:`.answers`), judging and labels (:mod:`.judging`), the model
(:mod:`.models`), the pipeline (:mod:`.pipeline`, ``abstain-guard calibrate``; its settings in
:mod:`.calibration_config`) and its resumable run cache (:mod:`.store`)."""

from __future__ import annotations

from .calibration_config import CalibrationConfig
from .dataset_files import DatasetReport, load_dataset
from .datasets import QAItem, split_items
from .judges import make_judge
from .named_datasets import NAMED_DATASETS, load_named_dataset
from .pipeline import CalibrationSummary, calibrate
from .probe import builtin_probe_set
from .store import RunStore

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
