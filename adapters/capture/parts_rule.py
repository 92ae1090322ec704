"""The rule by which full capture's "auto" strategy picks how a generation computes its
attention parts (:class:`~.session.CaptureSession`), as decode paths record it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PartsRule:
    """How "auto" picks a generation's attention-parts strategy: keep ``u`` when the
    session's ``L·B·positions·H·D`` float32 fit ``cache_budget_bytes``; else, per decode
    step, dense over at most ``dense_max_sources`` sources and sparse beyond. The strategies
    are exact in real arithmetic but differ in float32's last bits (up to ~1e-4 in ω on
    long prompts), so the rule is part of the decode path a guard is calibrated on."""

    cache_budget_bytes: int
    dense_max_sources: int

    def record(self) -> dict[str, int]:
        return {
            "cache_budget_bytes": int(self.cache_budget_bytes),
            "dense_max_sources": int(self.dense_max_sources),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None) -> PartsRule:
        """The rule of a decode-path record's ``parts`` (None: :data:`UNRECORDED_PARTS`)."""
        if record is None:
            return UNRECORDED_PARTS
        return cls(int(record["cache_budget_bytes"]), int(record["dense_max_sources"]))


#: The rule a decode path recorded without ``parts`` means (the shipped guard's): 256 MiB
#: kept, dense up to 512 sources.
UNRECORDED_PARTS = PartsRule(256 << 20, 512)
