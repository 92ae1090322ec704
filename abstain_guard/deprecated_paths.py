"""Import paths that moved, kept working for one release with a ``DeprecationWarning``.

Issue 35 gave the scorers one home, :mod:`abstain_guard.scorers`: the registry and the
``Scorer`` base left ``abstain_guard.scoring``, the likelihood scorers left
``abstain_guard.likelihood``, and the scorers the guard runs on live answers left
``abstain_guard.calibration.inference`` (a folder named for offline work), and
``abstain_guard.chat_models`` (specs and identities of chat models, next to
``adapters/chat_model.py``, the local chat model) became ``abstain_guard.chat_model_specs``.
Code that still
imports an old path gets the same objects, and a ``DeprecationWarning`` naming the new path
when it reads a name from the old module.

There are no files at the old paths: :func:`install` (called by ``abstain_guard/__init__``,
which runs before any ``abstain_guard.*`` import) puts a finder on ``sys.meta_path`` that
answers for exactly the module names in :data:`MOVED_MODULES`. Delete this module and that
call in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["MOVED_MODULES", "MovedModule", "install", "moved_attribute_getter"]

_NEW = "abstain_guard.scorers"


@dataclass(frozen=True)
class MovedModule:
    """Where the names of one old module live now.

    Attributes:
        home: the module that holds the old module's names.
        names: the names that moved elsewhere, each to its module.
    """

    home: str
    names: Mapping[str, str] = field(default_factory=dict)

    def module_of(self, name: str) -> str:
        return self.names.get(name, self.home)


_FORMULAS = {
    "attention_score": f"{_NEW}.attention_score",
    "token_sar": f"{_NEW}.sar",
    "sar": f"{_NEW}.sar",
    "greedy_semantic_classes": f"{_NEW}.semantic_entropy",
    "semantic_entropy": f"{_NEW}.semantic_entropy",
    "eigenscore": f"{_NEW}.eigenscore",
}
_OLD = "abstain_guard.calibration.inference"

MOVED_MODULES: dict[str, MovedModule] = {
    # renamed: it holds specs and identities of chat models, not chat models
    "abstain_guard.chat_models": MovedModule("abstain_guard.chat_model_specs"),
    "abstain_guard.scoring": MovedModule(_NEW),
    "abstain_guard.likelihood": MovedModule(_NEW),
    _OLD: MovedModule(_NEW, _FORMULAS),
    f"{_OLD}.attention": MovedModule(f"{_NEW}.attention_score"),
    f"{_OLD}.aux_models": MovedModule(f"{_NEW}._aux_models"),
    f"{_OLD}.calibrated": MovedModule(f"{_NEW}.calibrated"),
    f"{_OLD}.calibrator": MovedModule(f"{_NEW}._calibrator"),
    f"{_OLD}.features": MovedModule(f"{_NEW}._features"),
    f"{_OLD}.geometry": MovedModule(f"{_NEW}.geometry"),
    f"{_OLD}.geometry_fast": MovedModule(f"{_NEW}.geometry_fast"),
    f"{_OLD}.geometry_plus": MovedModule(f"{_NEW}.geometry_plus"),
    f"{_OLD}.model_access": MovedModule(f"{_NEW}._model_access"),
    f"{_OLD}.p_true": MovedModule(f"{_NEW}.p_true"),
    f"{_OLD}.sampling": MovedModule(
        f"{_NEW}._sampling",
        {
            **{k: v for k, v in _FORMULAS.items() if k != "attention_score"},
            "SARScorer": f"{_NEW}.sar",
            "SemanticEntropyScorer": f"{_NEW}.semantic_entropy",
            "SIMILARITY_THRESHOLD": f"{_NEW}.semantic_entropy",
            "EigenScoreScorer": f"{_NEW}.eigenscore",
        },
    ),
}
"""Old module name → where its names live now."""


def _public_home(module: str) -> str:
    """The path to recommend: a private helper module's names are exported by the package."""
    return _NEW if module.startswith(f"{_NEW}._") else module


def moved_attribute_getter(old: str, home_of: Callable[[str], str | None]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names of ``old`` that moved: each access warns and
    returns the object from its new module, ``home_of(name)`` (``None``: not a moved name)."""

    def __getattr__(name: str) -> Any:
        home = home_of(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {_public_home(home)}.{name}; the old path works "
            "until the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers for the old module names only; every other import passes through."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        # A package (empty __path__), so that `import old.package.module` still resolves.
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        moved = MOVED_MODULES[module.__name__]

        def home_of(name: str) -> str | None:
            return None if name.startswith("__") else moved.module_of(name)

        module.__doc__ = f"Moved to {_public_home(moved.home)} (deprecated path)."
        module.__getattr__ = moved_attribute_getter(module.__name__, home_of)  # type: ignore[method-assign]


_FINDER = _MovedModuleFinder()


def install() -> None:
    """Put the finder of old module names first on ``sys.meta_path`` (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
