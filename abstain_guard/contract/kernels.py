"""Kernel facts: when a guard's live scores equal its stored ones bit for bit, and by how
much they may move when they cannot.

Where the facts that decide the last bits (:func:`bit_deciding`) of a generation
(``generation["kernels"]``) equal calibration's (``decoding["kernels"]``), live = stored bit
for bit; where they differ the guard warns once with :data:`STATED_TOLERANCE` and the
calibration scores that close to the threshold, and notes it in every decision
(docs/guarantees.md, "On another machine: CPU kernels"). Pure functions, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: MKL branches whose results do not depend on the CPU model (MKL's CNR guarantee: every
#: Intel CPU with the branch's instructions for a named ISA branch; every x86-64 CPU for
#: ``COMPATIBLE``). Under ``AUTO`` or ``OFF`` the CPU itself decides, so it is compared.
FIXED_MKL_BRANCHES = frozenset(
    {"COMPATIBLE", "SSE2", "SSSE3", "SSE4_1", "SSE4_2", "AVX", "AVX2", "AVX512"}
)

#: Largest |live - stored| of a score between two kernel settings that the library states:
#: ten times the largest move measured (docs/guarantees.md, "On another machine: CPU kernels").
STATED_TOLERANCE = 1e-4


def bit_deciding(facts: Mapping[str, Any] | None) -> dict[str, Any]:
    """The kernel facts that decide the last bits of a forward (empty for None).

    Always: torch version, device type, ATen capability, BLAS and MKL branch. On the CPU
    under an MKL branch that is not fixed (:data:`FIXED_MKL_BRANCHES`): the CPU vendor,
    model and vector extensions too (MKL dispatches on them). On an accelerator: its name."""
    if not facts:
        return {}
    out: dict[str, Any] = {
        key: facts.get(key)
        for key in ("torch", "device_type", "aten_capability", "blas", "mkl_branch")
    }
    if facts.get("device_type") == "cpu":
        if facts.get("mkl_branch") not in FIXED_MKL_BRANCHES:
            cpu = facts.get("cpu") or {}
            out["cpu"] = {
                "vendor": cpu.get("vendor"),
                "model": cpu.get("model"),
                "isa": cpu.get("isa"),
            }
    else:
        out["device_name"] = facts.get("device_name")
    return out


def kernel_differences(
    live: Mapping[str, Any] | None, calibrated: Mapping[str, Any] | None
) -> list[str]:
    """How the bit-deciding facts of a live generation differ from calibration's (empty:
    the same, or calibration recorded none). ``live`` None with a calibrated record is a
    difference: the response does not say which kernels computed it."""
    if not calibrated:
        return []
    if not live:
        return ["the response records no kernel facts (generation['kernels'])"]
    here, there = bit_deciding(live), bit_deciding(calibrated)
    keys = sorted(set(here) | set(there))
    return [
        f"{k}: {here.get(k)!r} here vs {there.get(k)!r} at calibration"
        for k in keys
        if here.get(k) != there.get(k)
    ]


def near_threshold(scores: Sequence[float] | np.ndarray, threshold: float, distance: float) -> int:
    """How many of ``scores`` ``[n]`` lie within ``distance`` of ``threshold`` (the decisions
    a move of at most ``distance`` could flip); 0 for an infinite threshold."""
    if not np.isfinite(threshold):
        return 0
    s = np.asarray(scores, dtype=np.float64)
    return int(np.count_nonzero(np.abs(s - threshold) <= distance))


def kernel_note(
    differences: Sequence[str], scores: Sequence[float] | np.ndarray, threshold: float
) -> str:
    """The warning a guard gives once (and records in every decision) when the response's
    kernels differ from calibration's."""
    near = near_threshold(scores, threshold, STATED_TOLERANCE)
    return (
        "kernels: the response was computed on other CPU kernels than calibration ("
        + "; ".join(differences)
        + f"). Scores may differ from calibration's in their last bits: the library states "
        f"|live - stored| <= {STATED_TOLERANCE:g} (ten times the largest move measured between "
        f"kernel settings; this pair is not measured). {near} of {len(scores)} "
        f"calibration scores lie within {STATED_TOLERANCE:g} of the threshold "
        f"{threshold:.6g}: only such decisions could flip. Run `abstain-guard evaluate "
        "--live` on this machine to measure the move, or calibrate here."
    )
