"""Deprecated: renamed :mod:`.calibration_config` (``abstain_guard/config.py`` holds the
guard's own config). Import :class:`CalibrationConfig` from ``abstain_guard.calibration``."""

from __future__ import annotations

import warnings
from typing import Any

from . import calibration_config as _renamed

warnings.warn(
    "abstain_guard.calibration.building.config is deprecated and will be removed in the next "
    "release; import CalibrationConfig from abstain_guard.calibration (the module is now "
    "abstain_guard.calibration.building.calibration_config)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_renamed, name)
