"""The repository's layout survives the tools people put around it.

A folder named like build output (``build/``, ``dist/``, ...) is dropped by the standard
Python ``.gitignore`` (an unanchored ``build/`` pattern), by packaging tools and by code-map
tools; a package of ours under such a name would vanish from a fork without an error.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_OUTPUT_NAMES = {"build", "dist", "out", "target", "_build", "site-packages"}
SOURCE_ROOTS = ("abstain_guard", "adapters", "calibration", "tests", "bench", "examples")


def _package_dirs() -> list[Path]:
    """Every folder under the source roots that holds Python code."""
    found: list[Path] = []
    for name in SOURCE_ROOTS:
        root = ROOT / name
        found.append(root)
        found.extend(p for p in root.rglob("*") if p.is_dir() and "__pycache__" not in p.parts)
    return [p for p in found if any(p.glob("*.py"))]


def test_no_package_directory_is_named_like_build_output():
    offending = [
        str(p.relative_to(ROOT)) for p in _package_dirs() if p.name.lower() in BUILD_OUTPUT_NAMES
    ]
    assert offending == [], (
        f"package directories named like build output: {offending}; the standard Python "
        ".gitignore and packaging tools drop folders with these names — rename them"
    )


def test_every_code_folder_is_an_installed_package():
    """Each folder with ``__init__.py`` under the three package roots is listed in
    pyproject.toml (otherwise ``pip install`` silently leaves it out)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    mapping = {
        "abstain_guard": "abstain_guard",
        "adapters": "abstain_guard.adapters",
        "calibration": "abstain_guard.calibration",
    }
    expected = set()
    for folder, dotted in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            expected.add(".".join([dotted, *rel.parts]) if rel.parts else dotted)
    assert expected == listed, (
        f"pyproject.toml [tool.setuptools].packages is out of date: missing "
        f"{sorted(expected - listed)}, stale {sorted(listed - expected)}"
    )


def _top_level_imports(body: list[ast.stmt]) -> list[ast.stmt]:
    """Import statements at module level, including those under ``if`` (``TYPE_CHECKING``
    imports count: a type-only circle is still a circle for readers and type checkers)."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            found.extend(_top_level_imports(node.body) + _top_level_imports(node.orelse))
    return found


def _imports_of(path: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``path`` imports at module level (lazy imports inside
    functions are not counted)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in _top_level_imports(tree.body):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                names.add(node.module.split(".")[0])
            elif node.level == 1:
                names.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith(package + "."):
                names.add(node.module[len(package) + 1 :].split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(package + "."):
                    names.add(alias.name[len(package) + 1 :].split(".")[0])
    return names


def test_adapters_have_no_import_cycle():
    """Imports inside ``adapters/`` run one way: no module imports one that imports it back
    (directly or through others) at module level."""
    folder = ROOT / "adapters"
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {
        m: _imports_of(folder / f"{m}.py", "abstain_guard.adapters") & modules for m in modules
    }
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            cycles.append([*stack[stack.index(node) :], node])
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*stack, node], done)
        done.add(node)

    done: set[str] = set()
    for m in sorted(modules):
        visit(m, [], done)
    assert cycles == [], f"import cycles in adapters/: {cycles}"
