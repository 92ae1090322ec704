"""The repository's layout survives the tools people put around it.

A folder named like build output (``build/``, ``dist/``, ...) is dropped by the standard
Python ``.gitignore`` (an unanchored ``build/`` pattern), by packaging tools and by code-map
tools; a package of ours under such a name would vanish from a fork without an error.

Layout by when code runs (DESIGN.md): the live scoring path — the guard, the middleware, the
scorers in ``abstain_guard/scorers/`` — imports nothing under ``calibration/`` (offline
building and measuring), every scorer lives in ``scorers/``, and importing the core loads
no torch, transformers or xgboost.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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


# --- the live scoring path (issue 35) ------------------------------------------------------

PACKAGE_FOLDERS = {
    "abstain_guard.adapters": ROOT / "adapters",
    "abstain_guard.calibration": ROOT / "calibration",
    "abstain_guard": ROOT / "abstain_guard",
}
SCORERS = ROOT / "abstain_guard" / "scorers"
LIVE_ENTRY_POINTS = ("abstain_guard.guard", "abstain_guard.middleware", "abstain_guard.policy")
"""Where a question enters the guard: the runnable, the agent middleware, their policy."""
HEAVY = ("torch", "transformers", "xgboost")


def _scorer_modules() -> list[str]:
    return [
        "abstain_guard.scorers" + ("" if p.stem == "__init__" else f".{p.stem}")
        for p in sorted(SCORERS.glob("*.py"))
    ]


def _module_file(module: str) -> Path | None:
    """The source file of an ``abstain_guard`` module (through the package-dir mapping)."""
    for package, folder in PACKAGE_FOLDERS.items():
        if module == package or module.startswith(package + "."):
            rel = module[len(package) + 1 :].split(".") if module != package else []
            base = folder.joinpath(*rel)
            for candidate in (base / "__init__.py", base.with_suffix(".py")):
                if candidate.is_file():
                    return candidate
            return None
    return None


def _all_imports(module: str, path: Path) -> set[str]:
    """Every ``abstain_guard`` module that ``path`` imports anywhere — at module level or
    inside a function (a lazy import runs on the live path too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in found if m.startswith("abstain_guard") and _module_file(m) is not None}


def test_the_live_path_imports_nothing_from_calibration_statically():
    """From the guard, the middleware and every scorer, following every import (lazy ones
    too) through ``abstain_guard``, no module under ``calibration/`` is reached."""
    reached: dict[str, str] = {}
    todo = [(m, "<entry>") for m in (*LIVE_ENTRY_POINTS, *_scorer_modules())]
    while todo:
        module, parent = todo.pop()
        if module in reached:
            continue
        reached[module] = parent
        path = _module_file(module)
        assert path is not None, f"{module} (imported by {parent}) has no source file"
        todo.extend((m, module) for m in _all_imports(module, path) if m not in reached)
    offending = {m: p for m, p in reached.items() if m.startswith("abstain_guard.calibration")}
    assert offending == {}, (
        f"the live scoring path reaches calibration/ (module: imported by): {offending}; "
        "code the guard runs on a live answer belongs in abstain_guard/ (scorers/)"
    )


_LOADED_BY_EACH = """
import json, sys
found = {}
for name in sys.argv[1:]:
    before = set(sys.modules)
    __import__(name)
    found[name] = sorted(m for m in set(sys.modules) - before
                         if m.startswith("abstain_guard.calibration"))
print(json.dumps(found))
"""


@pytest.mark.slow
def test_the_live_path_imports_nothing_from_calibration_at_run_time():
    """Importing the guard, the middleware and each scorer module (in a fresh interpreter)
    loads no ``abstain_guard.calibration`` module."""
    modules = [*LIVE_ENTRY_POINTS, *_scorer_modules()]
    out = subprocess.run(
        [sys.executable, "-c", _LOADED_BY_EACH, *modules],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    loaded = {k: v for k, v in json.loads(out.stdout).items() if v}
    assert loaded == {}, f"modules of calibration/ loaded by the live path: {loaded}"


def test_importing_the_core_and_the_scorers_loads_no_heavy_dependency():
    """``import abstain_guard`` and ``import abstain_guard.scorers`` load neither torch,
    transformers nor xgboost: a guard around an API model needs none of them."""
    code = (
        "import json, sys\n"
        "import abstain_guard, abstain_guard.scorers\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert json.loads(out.stdout) == [], f"import abstain_guard loaded {out.stdout.strip()}"


def _scorer_class_names() -> set[str]:
    """Names of the classes defined in ``scorers/`` that derive from ``Scorer``."""
    bases: dict[str, set[str]] = {}
    for path in SCORERS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {_base_name(b) for b in node.bases}
    names = {"Scorer"}
    changed = True
    while changed:
        grown = {n for n, b in bases.items() if b & names} | names
        changed, names = grown != names, grown
    return names


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def test_no_scorer_is_defined_outside_scorers():
    """Every class deriving from ``Scorer`` (directly or through another scorer) in the
    installed packages lives in ``abstain_guard/scorers/`` (tests may define their own)."""
    scorer_names = _scorer_class_names()
    assert {"GeometryScorer", "ModelScorer", "PerplexityScorer"} <= scorer_names
    offending = []
    for folder in PACKAGE_FOLDERS.values():
        for path in folder.rglob("*.py"):
            if SCORERS in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.ClassDef)
                    and {_base_name(b) for b in node.bases} & scorer_names
                ):
                    offending.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert offending == [], f"scorer classes outside abstain_guard/scorers/: {offending}"


PRIVATE_IMPORTS_PENDING: set[tuple[str, str]] = set()
"""Private names still imported across modules: none (keep it so)."""


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore is private to its module: a module that another one
    needs gets a public name that says what it holds."""
    found = set()
    for folder in PACKAGE_FOLDERS.values():
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                    found.update(
                        (path.relative_to(ROOT).as_posix(), a.name)
                        for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                    )
    assert found - PRIVATE_IMPORTS_PENDING == set(), "private names imported across modules"
    assert found >= PRIVATE_IMPORTS_PENDING, (
        f"fixed, remove from PRIVATE_IMPORTS_PENDING: {PRIVATE_IMPORTS_PENDING - found}"
    )
