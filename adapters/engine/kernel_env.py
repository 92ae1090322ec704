"""The CPU kernel settings the library asks for, set before torch computes anything.

When ``abstain_guard.adapters`` is imported, :func:`ask_for_portable_kernels` sets
:data:`PORTABLE_KERNEL_ENV` (ATen's AVX2 kernels, which every x86-64 CPU runs) where unset,
:data:`FOREIGN_KERNEL_ENV` instead with :data:`FOREIGN_KERNELS_ENV` ``=1`` (to compute as a
machine with another processor would: ``make test-foreign``), nothing with
:data:`NATIVE_KERNELS_ENV` ``=1``; a value the user exported wins. Every process the library
starts gets :func:`pinned_kernel_env` before it imports torch. The kernels that ran are read
back by :mod:`.kernels`. Why, and what each setting costs: docs/guarantees.md, "On another
machine: CPU kernels". This module imports nothing heavy so that it can run first.
"""

from __future__ import annotations

import os
import platform

#: What the library asks for on x86-64 CPUs (a value already in the environment wins).
PORTABLE_KERNEL_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2"}

#: What the library pins instead with :data:`FOREIGN_KERNELS_ENV` ``=1``: ATen's scalar
#: kernels and MKL's AVX2 branch (which runs MKL's ``AUTO`` branch on non-Intel CPUs); both
#: change the last bits of a forward on every x86-64 machine.
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
