"""Judges: decide whether a generated answer is correct (the calibration labels).

Offline judges (:mod:`.text`, :mod:`.lexical`, :mod:`.similarity`) need no model call;
LLM judges (:mod:`.llm`, :mod:`.paper`) ask a chat model. :func:`make_judge` builds any of
them by name; :mod:`.cache` stores verdicts in the run cache.
"""

from __future__ import annotations

from abstain_guard.calibration.build.judges.registry import *  # noqa: F403
from abstain_guard.calibration.build.judges.registry import __all__ as __all__
