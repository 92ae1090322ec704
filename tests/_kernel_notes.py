"""What the guard promises about CPU kernels, for tests that run a calibrated guard on this
machine: no warning where the bit-deciding kernel facts equal calibration's, otherwise
exactly the kernel note and nothing else (``abstain_guard.contract.kernels``).

A test that asserted "no warning" assumed the calibration machine: it failed on a processor
whose native kernels are not the pinned ones (issue 45), and in the foreign-kernel mode
(``ABSTAIN_GUARD_FOREIGN_KERNELS=1``, ``make test-foreign``) on any machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from abstain_guard import GuardArtifact
from abstain_guard.adapters.engine.kernels import kernel_facts
from abstain_guard.contract.deployment import DeploymentRecord
from abstain_guard.contract.kernels import kernel_differences, kernel_note


def calibration_kernel_differences(
    artifact: GuardArtifact, live: Mapping[str, Any] | None = None
) -> list[str]:
    """How ``live`` (default: this process's kernel facts) differs from the artifact's
    calibration in the facts that decide the bits (empty: the same)."""
    record = DeploymentRecord.from_metadata(artifact.metadata)
    assert record is not None and "kernels" in record.decoding, "no kernel facts recorded"
    live = kernel_facts("cpu") if live is None else live
    return kernel_differences(live, record.decoding["kernels"])


def expected_kernel_notes(
    artifact: GuardArtifact, threshold: float, live: Mapping[str, Any] | None = None
) -> list[str]:
    """``[]`` when ``live`` (default: this process's kernel facts) decides the bits as the
    artifact's calibration did, else ``[the kernel note]`` for ``threshold``."""
    differences = calibration_kernel_differences(artifact, live)
    return [kernel_note(differences, artifact.scores, threshold)] if differences else []


def assert_only_kernel_notes(
    warnings: Sequence[str] | None, artifact: GuardArtifact, threshold: float
) -> None:
    """The decision's guarantee warnings are exactly what the kernels call for: none on the
    calibration's kernels, the kernel note alone on others."""
    assert list(warnings or []) == expected_kernel_notes(artifact, threshold), warnings
