"""The CPU kernel settings the library asks for, set before torch computes anything.

The last bits of a CPU forward depend on the kernels that compute it, and both libraries
that compute our ops choose their kernels by the processor unless told otherwise:

* ATen's vectorised kernels (norms, softmax, elementwise ops, reductions) run with the widest
  vector width the CPU has (AVX-512 on recent servers, AVX2 elsewhere); the width changes
  the order of reductions. The library asks for ``ATEN_CPU_CAPABILITY=avx2``, which every
  x86-64 CPU of the last decade runs, so an AVX-512 server computes these ops as an AVX2
  laptop does. ATen reads it once, at the first kernel it dispatches. Cost: none measured
  (``bench/kernel_settings.py``).
* MKL's matrix products (every linear layer) pick a code branch per CPU; with conditional
  numerical reproducibility off (its default) the CPU decides. ``MKL_CBWR=AVX2`` would make
  every Intel CPU with AVX2 compute them alike (MKL's documented guarantee; on other
  vendors' CPUs MKL runs its ``AUTO`` branch instead), at no measured cost, but it moves
  every score of a guard calibrated without it (2.8e-6 on the shipped guard), so it is not
  asked for until the shipped guard is calibrated under it; export it to use it.
  ``COMPATIBLE``, the only branch MKL keeps equal across vendors, was measured 2.5x slower
  on a prompt pass and breaks the row independence that shared decode steps need.

Because MKL lets the CPU decide, the kernel facts name the CPU (vendor, model, vector
extensions), and a guard used on another CPU model than its calibration's warns with the
stated tolerance (:mod:`abstain_guard.kernels`) instead of claiming bitwise equality.

oneDNN runs none of the embedded model's ops on the CPU (float32 and bfloat16 linear layers,
attention: checked with ``ONEDNN_VERBOSE=1``), so it is recorded, not forced.

The variable is set where unset (a value the user exported wins, and is recorded)
when ``abstain_guard.adapters`` is imported, before the library runs any op; if the process
computed with torch before that, the kernels already chosen stay, and the generation record
(:func:`abstain_guard.adapters.kernels.kernel_facts`) says so, because it states the kernels
that ran, read back from ATen and MKL, never the settings asked for. This module imports
nothing heavy so that it can run first.
"""

from __future__ import annotations

import os
import platform

#: What the library asks for on x86-64 CPUs (a value already in the environment wins).
PORTABLE_KERNEL_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2"}

#: Set to ``1`` to keep the kernels torch would choose on this CPU (fastest, e.g. AVX-512;
#: a guard calibrated so holds bit for bit only on CPUs of the same model).
NATIVE_KERNELS_ENV = "ABSTAIN_GUARD_NATIVE_KERNELS"

#: Environment variables that choose CPU kernels, as recorded in the kernel facts.
KERNEL_ENV_KEYS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def is_x86_64() -> bool:
    """Whether this is an x86-64 machine (the settings above mean nothing elsewhere)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def ask_for_portable_kernels() -> dict[str, str]:
    """Set :data:`PORTABLE_KERNEL_ENV` in ``os.environ`` where unset (x86-64 only); returns
    the variables this call set. Nothing with :data:`NATIVE_KERNELS_ENV` ``=1``."""
    if not is_x86_64() or os.environ.get(NATIVE_KERNELS_ENV, "").strip() == "1":
        return {}
    set_now = {}
    for key, value in PORTABLE_KERNEL_ENV.items():
        if key not in os.environ:
            os.environ[key] = value
            set_now[key] = value
    return set_now


ask_for_portable_kernels()

__all__ = [
    "KERNEL_ENV_KEYS",
    "NATIVE_KERNELS_ENV",
    "PORTABLE_KERNEL_ENV",
    "ask_for_portable_kernels",
    "is_x86_64",
]
