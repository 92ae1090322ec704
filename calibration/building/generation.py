"""Deprecated: renamed :mod:`.answers` (``adapters/generation.py`` is the model's own
generation loop). Import from ``abstain_guard.calibration.building.answers``."""

from __future__ import annotations

import warnings
from typing import Any

from . import answers as _renamed

warnings.warn(
    "abstain_guard.calibration.building.generation is deprecated and will be removed in the next "
    "release; import from abstain_guard.calibration.building.answers",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_renamed, name)
