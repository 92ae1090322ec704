"""The CPU kernel settings the library asks for, set before torch computes anything.

The last bits of a CPU forward depend on the kernels that compute it, and both libraries
that compute our ops choose their kernels by the processor unless told otherwise:

* ATen's vectorised kernels (norms, softmax, elementwise ops, reductions) run with the widest
  vector width the CPU has (AVX-512 on recent servers, AVX2 elsewhere); the width changes
  the order of reductions. The library asks for ``ATEN_CPU_CAPABILITY=avx2``, which every
  x86-64 CPU of the last decade runs, so an AVX-512 server computes these ops as an AVX2
  laptop does. ATen reads it once, at the first kernel it dispatches. Cost: none measured
  (``bench/speed/kernel_settings.py``).
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
stated tolerance (:mod:`abstain_guard.contract.kernels`) instead of claiming bitwise equality.

oneDNN runs none of the embedded model's ops on the CPU (float32 and bfloat16 linear layers,
attention: checked with ``ONEDNN_VERBOSE=1``), so it is recorded, not forced.

**A foreign machine on your own** (``ABSTAIN_GUARD_FOREIGN_KERNELS=1``): the library pins
:data:`FOREIGN_KERNEL_ENV` instead -- ATen's scalar kernels (``default``) and MKL's ``AVX2``
reproducibility branch -- so that this process computes as a machine with another processor
would, while anything that escapes the pin (a worker process started without the
environment of :func:`pinned_kernel_env`, a test that assumes the calibration machine's
kernels) still computes on this machine's native ones and shows its defect here.
``make test-foreign`` runs the suite so.

Every process the library starts (Ray calibration replicas, Ray Serve replicas, the monitor
actor) gets :func:`pinned_kernel_env` in its environment before it imports torch, so it
computes on the kernels its parent records.

The variable is set where unset (a value the user exported wins, and is recorded)
when ``abstain_guard.adapters`` is imported, before the library runs any op; if the process
computed with torch before that, the kernels already chosen stay, and the generation record
(:func:`abstain_guard.adapters.engine.kernels.kernel_facts`) says so, because it states the kernels
that ran, read back from ATen and MKL, never the settings asked for. This module imports
nothing heavy so that it can run first.
"""

from __future__ import annotations

import os
import platform

#: What the library asks for on x86-64 CPUs (a value already in the environment wins).
PORTABLE_KERNEL_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2"}

#: What the library pins instead with :data:`FOREIGN_KERNELS_ENV` ``=1``: ATen's scalar
#: kernels and MKL's AVX2 branch (which runs MKL's ``AUTO`` branch on non-Intel CPUs); both
#: change the last bits of a forward on every x86-64 machine (``bench/speed/kernel_settings.py``).
FOREIGN_KERNEL_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AVX2"}

#: Set to ``1`` to compute as another machine would (:data:`FOREIGN_KERNEL_ENV`): the mode in
#: which the suite shows what a processor unlike the calibration machine's would.
FOREIGN_KERNELS_ENV = "ABSTAIN_GUARD_FOREIGN_KERNELS"

#: Set to ``1`` to keep the kernels torch would choose on this CPU (fastest, e.g. AVX-512;
#: a guard calibrated so holds bit for bit only on CPUs of the same model).
NATIVE_KERNELS_ENV = "ABSTAIN_GUARD_NATIVE_KERNELS"

#: Environment variables that choose CPU kernels, as recorded in the kernel facts.
KERNEL_ENV_KEYS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")

#: The library's own variables that decide which kernels it asks for.
MODE_ENV_KEYS = (NATIVE_KERNELS_ENV, FOREIGN_KERNELS_ENV)


def is_x86_64() -> bool:
    """Whether this is an x86-64 machine (the settings above mean nothing elsewhere)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip() == "1"


def requested_kernel_env() -> dict[str, str]:
    """The kernel variables the library asks for in this process: :data:`FOREIGN_KERNEL_ENV`
    with :data:`FOREIGN_KERNELS_ENV` ``=1``, nothing with :data:`NATIVE_KERNELS_ENV` ``=1``
    or off x86-64, else :data:`PORTABLE_KERNEL_ENV`."""
    if not is_x86_64():
        return {}
    if _flag(FOREIGN_KERNELS_ENV):
        return dict(FOREIGN_KERNEL_ENV)
    if _flag(NATIVE_KERNELS_ENV):
        return {}
    return dict(PORTABLE_KERNEL_ENV)


def ask_for_portable_kernels() -> dict[str, str]:
    """Set :func:`requested_kernel_env` in ``os.environ`` where unset; returns the variables
    this call set."""
    set_now = {}
    for key, value in requested_kernel_env().items():
        if key not in os.environ:
            os.environ[key] = value
            set_now[key] = value
    return set_now


def pinned_kernel_env() -> dict[str, str]:
    """The environment a process started by the library needs to compute on the kernels this
    one records: the kernel variables as set here (:data:`KERNEL_ENV_KEYS`, after
    :func:`ask_for_portable_kernels`) and the library's mode variables
    (:data:`MODE_ENV_KEYS`). Give it to the child before it imports torch (Ray's
    ``runtime_env={"env_vars": ...}``, a subprocess's ``env``): ATen and MKL read it once."""
    ask_for_portable_kernels()
    keys = (*KERNEL_ENV_KEYS, *MODE_ENV_KEYS)
    return {k: os.environ[k] for k in keys if k in os.environ}


ask_for_portable_kernels()

__all__ = [
    "FOREIGN_KERNELS_ENV",
    "FOREIGN_KERNEL_ENV",
    "KERNEL_ENV_KEYS",
    "MODE_ENV_KEYS",
    "NATIVE_KERNELS_ENV",
    "PORTABLE_KERNEL_ENV",
    "ask_for_portable_kernels",
    "is_x86_64",
    "pinned_kernel_env",
    "requested_kernel_env",
]
