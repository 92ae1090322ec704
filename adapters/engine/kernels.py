"""The kernel facts of this process, read back from the libraries that run it (never the
settings asked for, :mod:`.kernel_env`): what decides the last bits of a forward. They go
into every generation record and the calibration's deployment record; the guard compares the
parts that decide the bits (:func:`abstain_guard.contract.kernels.bit_deciding`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from .kernel_env import KERNEL_ENV_KEYS

#: MKL's named CNR branches (``mkl_cbwr_get(MKL_CBWR_BRANCH)``; ``OFF``: reproducibility
#: off, kernels chosen per call by CPU and alignment).
MKL_BRANCHES = {
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    11: "AVX512_MIC",
    12: "AVX512",
    13: "AVX512_MIC_E1",
    14: "AVX512_E1",
}

#: CPU flags recorded (the vector extensions kernels dispatch on).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "asimd", "sve")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none)."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    if not path.exists():
        return fields
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def cpu_facts() -> dict[str, Any]:
    """``{"vendor", "model", "isa"}`` of this machine's CPU (``isa``: the flags of
    :data:`ISA_FLAGS` it has)."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {
        "vendor": info.get("vendor_id") or platform.processor() or platform.machine(),
        "model": info.get("model name") or platform.machine(),
        "isa": [f for f in ISA_FLAGS if f in flags],
    }


@functools.cache
def _mkl() -> Any:
    """The MKL service functions inside torch's CPU library (None when torch has no MKL)."""
    if not torch.backends.mkl.is_available():
        return None
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        try:
            lib = ctypes.CDLL(str(lib_dir / name))
            getter = lib.mkl_serv_cbwr_get
        except (OSError, AttributeError):
            continue
        getter.restype = ctypes.c_int
        getter.argtypes = [ctypes.c_int]
        return getter
    return None


def mkl_branch() -> str:
    """MKL's reproducibility branch in this process (``"OFF"``, ``"AUTO"``, ``"AVX2"``, ...;
    ``"unknown"`` when torch's MKL does not expose it, ``"no mkl"`` without MKL)."""
    if not torch.backends.mkl.is_available():
        return "no mkl"
    getter = _mkl()
    if getter is None:
        return "unknown"
    code = int(getter(1))  # MKL_CBWR_BRANCH
    return MKL_BRANCHES.get(code, f"branch {code}")


@functools.cache
def blas_facts() -> dict[str, str]:
    """``{"blas", "onednn"}``: the BLAS torch was built with and its version, oneDNN's."""
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=([^,\s]+)", config)
    mkl = re.search(r"Math Kernel Library Version ([^\n]+?) for", config)
    onednn = re.search(r"MKL-DNN v([0-9.]+)", config)
    name = blas.group(1) if blas else "unknown"
    return {
        "blas": f"{name} {mkl.group(1).strip()}" if name == "mkl" and mkl else name,
        "onednn": onednn.group(1) if onednn else "none",
    }


def kernel_facts(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What decides the last bits of a forward on ``device`` in this process.

    Returns a JSON-ready dict: ``torch`` (version), ``device_type``, ``device_name`` (the
    GPU's name on an accelerator), ``cpu`` (:func:`cpu_facts`), ``aten_capability`` (the
    vectorised kernels ATen dispatches to), ``blas``, ``mkl_branch`` (:func:`mkl_branch`),
    ``onednn`` (version, and whether torch may use it), and ``env`` (the kernel-choosing
    variables of :data:`.kernel_env.KERNEL_ENV_KEYS` as set in this process)."""
    device = torch.device(device)
    name = None
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    facts = blas_facts()
    return {
        "torch": torch.__version__,
        "device_type": device.type,
        "device_name": name,
        "cpu": cpu_facts(),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": facts["blas"],
        "mkl_branch": mkl_branch(),
        "onednn": {"version": facts["onednn"], "enabled": bool(torch.backends.mkldnn.enabled)},
        "env": {k: os.environ[k] for k in KERNEL_ENV_KEYS if k in os.environ},
    }
