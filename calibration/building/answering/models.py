"""The chat model a calibration or an evaluation runs: :func:`load_model`.

Shared by the pipeline (:mod:`..pipeline`), the Ray replicas (:mod:`.executors`) and the
measuring commands (:mod:`...measure.held_out`, :mod:`...measure.deployment_check`), so none of
them imports the orchestrator to reach it.
"""

from __future__ import annotations

from typing import Any

from abstain_guard.guard.chains import load_chat_model

from ..run.calibration_config import CalibrationConfig
from .answers import CALIBRATION_ROWS_PER_STEP


def load_model(config: CalibrationConfig) -> Any:
    """The chat model named by the config (``"default"`` = embedded SmolLM2), generating at
    most as many tokens as open questions got at calibration (the guarantee assumes the same
    generation settings)."""
    model = load_chat_model(
        config.model,
        gguf_file=config.gguf_file,
        max_new_tokens=config.max_new_tokens,
        batch_decode=config.batch_decode,
        prefix_cache=config.prefix_cache,
        device=config.device,
        dtype=config.dtype,
    )
    if isinstance(getattr(model, "max_batch_size", None), int):
        # more rows per decode step than deployed: same numbers per row, cheaper per row
        model.max_batch_size = max(model.max_batch_size, CALIBRATION_ROWS_PER_STEP)
    return model
