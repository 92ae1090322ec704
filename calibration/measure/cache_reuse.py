"""``evaluate`` reads the calibration run's cache (read-only) before generating anything:
:func:`evaluate_cache` layers it below the evaluation's own cache, so a held-out or train
answer and its verdict are reused, never written there. When it is used and when skipped:
docs/configuration.md, '`evaluate` reuses the calibration cache (read-only)'.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from abstain_guard.errors import CacheError

from ..building.run.lock import lock_holder, lock_path
from ..building.run.store import LayeredStore, RunStore

logger = logging.getLogger("abstain_guard.calibration")

RUN_DB = "run.sqlite"
JUDGMENTS_DB = "judgments.sqlite"


@dataclass
class EvaluateCache:
    """Where an evaluation keeps its answers and verdicts, and what it reads below them.

    Attributes:
        directory: the evaluation's own cache (read and written).
        reused_from: the calibration cache read below it (read-only), or None.
        runs: the read-only answer stores below ``directory/run.sqlite``.
        judgments: the read-only verdict stores below ``directory/judgments.sqlite``.
    """

    directory: Path
    reused_from: Path | None = None
    runs: list[RunStore] = field(default_factory=list)
    judgments: list[RunStore] = field(default_factory=list)

    def run_store(self) -> RunStore:
        """The answer store: ``directory/run.sqlite``, layered over ``runs``."""
        path = self.directory / RUN_DB
        return LayeredStore(path, read_from=self.runs) if self.runs else RunStore(path)

    def log_reuse(self, store: RunStore, judges: dict[str, Any] | None = None) -> None:
        """Log what was read from the calibration cache (answers, verdicts)."""
        if self.reused_from is None:
            return
        answers = getattr(store, "reused", {}).get("generation", 0)
        caches = {id(c): c for c in (getattr(j, "cache", None) for j in (judges or {}).values())}
        verdicts = sum(getattr(c, "reused", 0) for c in caches.values())
        logger.info(
            "Reused %d answers and %d verdicts from the calibration cache %s (read-only); new "
            "ones went to %s.",
            answers,
            verdicts,
            self.reused_from,
            self.directory,
        )


def _candidates(artifact: Any, artifact_path: str | Path) -> list[Path]:
    """Where the calibration cache may be: the ``cache_dir`` the artifact records (relative
    paths as calibrate was given them), then ``<artifact>.cache`` beside the artifact (the
    default location, moved along with the artifact)."""
    found: list[Path] = []
    recorded = artifact.metadata.get("cache_dir")
    if recorded:
        found.append(Path(str(recorded)))
    beside = Path(artifact_path)
    found.append(beside.with_name(beside.name + ".cache"))
    return found


def calibration_cache_dir(artifact: Any, artifact_path: str | Path) -> Path | None:
    """The calibration run's cache directory of ``artifact`` (one holding a ``run.sqlite``),
    or None when none of :func:`_candidates` holds one (logged)."""
    candidates = _candidates(artifact, artifact_path)
    for path in candidates:
        if (path / RUN_DB).is_file():
            return path
    logger.warning(
        "The calibration cache of %s is not at %s (moved or deleted?): its answers are "
        "generated again. Pass --cache-dir with the calibration cache to read and extend it.",
        artifact_path,
        " nor ".join(str(p) for p in dict.fromkeys(candidates)),
    )
    return None


def _open_read_only(paths: Sequence[Path]) -> list[RunStore]:
    """Each existing file of ``paths`` opened read-only (one that cannot be is logged)."""
    stores = []
    for path in paths:
        if not path.is_file():
            continue
        try:
            stores.append(RunStore(path, read_only=True))
        except CacheError as exc:
            logger.warning("The calibration cache file %s is not read: %s", path, exc)
    return stores


def evaluate_cache(
    directory: str | Path,
    artifact: Any,
    artifact_path: str | Path,
    *,
    reuse: bool = True,
) -> EvaluateCache:
    """The evaluation cache at ``directory``, over the artifact's calibration cache
    (read-only) when ``reuse`` and it can be read (else alone, the reason logged)."""
    directory = Path(directory)
    cache = EvaluateCache(directory)
    if not reuse:
        return cache
    found = calibration_cache_dir(artifact, artifact_path)
    if found is None:
        return cache
    if found.resolve() == directory.resolve():
        return cache  # it is the evaluation's own cache: read and written as such
    holder = lock_holder(lock_path(found))
    if holder is not None:
        who = "PID not yet recorded" if holder < 0 else f"PID {holder}"
        logger.warning(
            "The calibration cache %s is being written by a running calibration (%s): it is "
            "not read, answers are generated again.",
            found,
            who,
        )
        return cache
    cache.runs = _open_read_only([found / RUN_DB])
    cache.judgments = _open_read_only([found / JUDGMENTS_DB])
    if cache.runs or cache.judgments:
        cache.reused_from = found
        logger.info("Reading the calibration cache %s (read-only).", found)
    return cache
