"""The public surface: what each package exports, that every exported name resolves, the
scorer registry, and each name README, docs and examples import or cite."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from abstain_guard.scorers import scorer_class, scorer_names, scorer_spec

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = (
    "abstain_guard",
    "abstain_guard.adapters",
    "abstain_guard.backends",
    "abstain_guard.calibration",
    "abstain_guard.calibration.building.judges",
    "abstain_guard.cli",
    "abstain_guard.scorers",
)
"""The packages with a public ``__init__`` (``__all__``); every other package's ``__init__`` is
its docstring only, and its names are imported from the module that defines them."""
FOLDERS = {
    "abstain_guard": "abstain_guard",
    "adapters": "abstain_guard.adapters",
    "calibration": "abstain_guard.calibration",
}
"""Each installed folder → its package name (``package-dir`` in pyproject.toml)."""
DOCUMENTS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")]
)
_FROM_IMPORT = re.compile(r"from (abstain_guard[\w.]*) import \(?([\w\s,]+?)\)?(?:\n\n|$|\n[^\s])")
_DOTTED = re.compile(r"`(abstain_guard(?:\.\w+)+)`")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    exported = getattr(module, "__all__", None)
    assert exported, f"{package} exports nothing (__all__ is empty or missing)"
    missing = [name for name in exported if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names that do not resolve: {missing}"


def test_the_top_level_exports_what_a_user_needs() -> None:
    import abstain_guard

    assert set(abstain_guard.__all__) == {
        "AbstentionGuard",
        "CalibrationSet",
        "GuardArtifact",
        "GuardConfig",
        "GuardMonitor",
        "__version__",
        "default_artifact_path",
        "question_prompt",
    }
    # lazy, outside __all__: it needs the optional `agents` extra
    from abstain_guard import AbstentionMiddleware

    assert AbstentionMiddleware.__name__ == "AbstentionMiddleware"
    with pytest.raises(AttributeError):
        abstain_guard.conformal  # noqa: B018  (no alias: abstain_guard.guarantee.conformal)


def _package_names() -> list[str]:
    names = []
    for folder, package in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            names.append(".".join((package, *parts)))
    return names


def test_only_the_public_packages_export_names() -> None:
    """No re-exports for old paths: a package that is not public holds only its docstring."""
    exporting = {p for p in _package_names() if hasattr(importlib.import_module(p), "__all__")}
    assert exporting == set(PACKAGES)


def test_calibration_package_exports_its_entry_points() -> None:
    from abstain_guard.calibration import CalibrationConfig, calibrate, evaluate

    assert callable(calibrate) and callable(evaluate)
    assert CalibrationConfig().scorer == "geometry"


BUILT_IN = ("likelihood", "geometry", "model", "sampling", "calibrated", "blackbox")
"""Families of the scorers the library ships (tests register custom ones as ``custom``)."""


@pytest.mark.parametrize("kind", scorer_names(family=BUILT_IN))
def test_every_registered_scorer_resolves_to_its_class(kind: str) -> None:
    cls = scorer_class(kind)
    assert kind == cls.kind or kind in cls.presets  # a class of several kinds: its presets
    assert scorer_spec(kind).family in BUILT_IN


def test_the_scorer_page_names_every_registered_scorer() -> None:
    page = (ROOT / "docs" / "baselines.md").read_text(encoding="utf-8")
    missing = [kind for kind in scorer_names(family=BUILT_IN) if f"`{kind}`" not in page]
    assert not missing, f"docs/baselines.md does not describe registered scorers {missing}"


def _cited_names(text: str) -> list[tuple[str, str | None]]:
    """``(module, name)`` for each ``from module import name`` and each dotted
    ``abstain_guard.x.y`` reference in backticks (``name`` None: resolve the dotted path)."""
    cited: list[tuple[str, str | None]] = []
    for match in _FROM_IMPORT.finditer(text):
        for name in match.group(2).replace("\n", " ").split(","):
            name = name.split(" as ")[0].strip()
            if name and name != "*":
                cited.append((match.group(1), name))
    cited.extend((dotted, None) for dotted in _DOTTED.findall(text))
    return cited


def _resolves(module: str, name: str | None) -> bool:
    if name is not None:
        return hasattr(importlib.import_module(module), name)
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):  # longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_names_cited_in_docs_and_examples_resolve(document: Path) -> None:
    cited = _cited_names(document.read_text(encoding="utf-8"))
    broken = sorted({f"{m}:{n}" if n else m for m, n in cited if not _resolves(m, n)})
    assert not broken, f"{document.name} cites names that do not exist: {broken}"


def test_the_citation_scanner_finds_both_forms() -> None:
    text = (
        "```python\nfrom abstain_guard import (\n    AbstentionGuard,\n    Nope,\n)\n\n```\n"
        "See `abstain_guard.guarantee.conformal.risk_threshold` and `abstain_guard.nothing_here`.\n"
    )
    cited = _cited_names(text)
    assert ("abstain_guard", "AbstentionGuard") in cited
    assert not _resolves("abstain_guard", "Nope")
    assert _resolves("abstain_guard.guarantee.conformal.risk_threshold", None)
    assert not _resolves("abstain_guard.nothing_here", None)
