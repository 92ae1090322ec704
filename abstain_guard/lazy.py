"""Lazy package attributes, for packages whose public names live in modules with heavy
optional dependencies (torch, transformers, xgboost): ``import`` stays cheap and a name is
imported on first use (PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from ``homes[name]`` on first access.

    Args:
        package: the package's ``__name__`` (for the error message).
        homes: public name → the module that defines it.
    """

    def __getattr__(name: str) -> Any:
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
