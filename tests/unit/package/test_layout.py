"""The repository's layout survives the tools people put around it, and the package reads
by concept from its folder names.

A folder named like build output (``build/``, ``dist/``, ...) is dropped by the standard
Python ``.gitignore`` (an unanchored ``build/`` pattern), by packaging tools and by code-map
tools; a package of ours under such a name would vanish from a fork without an error.

Layout by concept (``docs/architecture.md``): :data:`MAY_IMPORT` says which subpackage may
import which; every import follows it (module level and inside functions), no module imports
one that imports it back (directly or through others), no package but ``scorers/`` (one file
a method) holds more than :data:`MAX_MODULES` modules (more is a sign of a concept wanting its
own package) and no function is longer than :data:`MAX_FUNCTION_LINES` lines (modules are
split by concept, never by length, so their length is not capped). Each package's docstring
states its row of the table. Library code, the Makefile, README and docs carry no history:
no issue numbers and no dates (they go to commit messages).

Layout by when code runs (DESIGN.md): the live scoring path — the guard, the middleware, the
scorers in ``abstain_guard/scorers/`` — imports nothing under ``calibration/`` (offline
building and measuring), every scorer lives in ``scorers/``, and importing the core loads
no torch, transformers or xgboost.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BUILD_OUTPUT_NAMES = {"build", "dist", "out", "target", "_build", "site-packages"}
SOURCE_ROOTS = (
    "abstain_guard",
    "adapters",
    "calibration",
    "tests",
    "bench",
    "examples",
    "experiments",
)


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


# --- the live scoring path (issue 35) ------------------------------------------------------

PACKAGE_FOLDERS = {
    "abstain_guard.adapters": ROOT / "adapters",
    "abstain_guard.calibration": ROOT / "calibration",
    "abstain_guard": ROOT / "abstain_guard",
}
SCORERS = ROOT / "abstain_guard" / "scorers"
LIVE_ENTRY_POINTS = (
    "abstain_guard.guard.runnable",
    "abstain_guard.guard.middleware",
    "abstain_guard.guard.policy",
)
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


def _import_statements(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """Each import in ``path`` (module level, inside functions, under ``TYPE_CHECKING``) as
    ``(source, names)``: the module it imports from, a relative import resolved against
    ``module``'s package, and the names a ``from`` import takes (none for ``import x``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            found.append((source, [alias.name for alias in node.names]))
    return found


def _all_imports(module: str, path: Path) -> set[str]:
    """Every ``abstain_guard`` module that ``path`` imports anywhere — at module level or
    inside a function (a lazy import runs on the live path too)."""
    found: set[str] = set()
    for source, names in _import_statements(module, path):
        found.add(source)
        found.update(f"{source}.{name}" for name in names)  # `from pkg import module`
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


# --- which subpackage may import which ----------------------------------------------------

_G = "abstain_guard"
_A = "abstain_guard.adapters"
_B = "abstain_guard.calibration.building"
MAY_IMPORT: dict[str, set[str]] = {
    # the top level's own modules, at the bottom (``abstain_guard`` itself is the top)
    f"{_G}.errors": set(),
    f"{_G}._version": set(),
    f"{_G}.lazy": set(),
    f"{_G}.config": {f"{_G}.errors"},
    f"{_G}.default": {f"{_G}.errors"},
    # the guarantee: scores and labels in, rules and certificates out
    f"{_G}.guarantee": {f"{_G}.config", f"{_G}.errors"},
    # what calibration and deployment agree on; what a chat model and the guard exchange
    f"{_G}.contract": {f"{_G}.guarantee", f"{_G}.errors"},
    # the local engine (abstain_guard.adapters), from capture up to the chat model
    f"{_A}.capture": {f"{_G}.contract", f"{_G}.errors"},
    f"{_A}.tools": {f"{_G}.contract", f"{_G}.errors"},
    f"{_A}.model": {f"{_A}.capture", f"{_G}.errors"},
    f"{_A}.engine": {
        f"{_A}.capture",
        f"{_A}.model",
        f"{_A}.tools",
        f"{_G}.contract",
        f"{_G}.errors",
    },
    f"{_A}.chat": {
        *(f"{_A}.{sub}" for sub in ("capture", "engine", "model", "tools")),
        f"{_G}.contract",
        f"{_G}.errors",
    },
    _A: {f"{_A}.{sub}" for sub in ("capture", "chat", "engine", "model", "tools")},
    f"{_G}.scorers": {_A, f"{_G}.contract", f"{_G}.errors"},
    f"{_G}.backends": {f"{_G}.scorers", _A, f"{_G}.contract", f"{_G}.errors"},
    f"{_G}.artifact": {
        f"{_G}.scorers",
        f"{_G}.guarantee",
        f"{_G}.config",
        f"{_G}.errors",
        f"{_G}._version",
    },
    f"{_G}.monitor": {f"{_G}.artifact", f"{_G}.guarantee", f"{_G}.config", f"{_G}.errors"},
    # the LangChain face
    f"{_G}.guard": {
        f"{_G}.monitor",
        f"{_G}.artifact",
        f"{_G}.backends",
        _A,
        f"{_G}.contract",
        f"{_G}.guarantee",
        f"{_G}.config",
        f"{_G}.errors",
    },
    f"{_G}.serve": {
        f"{_G}.guard",
        f"{_G}.monitor",
        f"{_G}.artifact",
        f"{_G}.backends",
        _A,
        f"{_G}.contract",
        f"{_G}.guarantee",
        f"{_G}.config",
        f"{_G}.errors",
        f"{_G}._version",
    },
    # offline: building (run < questions < judges < answering < the pipeline), then measuring
    f"{_B}.run": {
        f"{_G}.backends",
        f"{_G}.scorers",
        f"{_G}.contract",
        f"{_G}.config",
        f"{_G}.errors",
    },
    f"{_B}.questions": {f"{_B}.run", f"{_G}.contract", f"{_G}.guarantee", f"{_G}.errors"},
    f"{_B}.judges": {
        f"{_B}.questions",
        f"{_B}.run",
        f"{_A}.tools",
        f"{_G}.scorers",
        f"{_G}.contract",
        f"{_G}.errors",
    },
    f"{_B}.answering": {
        f"{_B}.judges",
        f"{_B}.questions",
        f"{_B}.run",
        f"{_G}.guard",
        _A,
        f"{_G}.scorers",
        f"{_G}.contract",
        f"{_G}.errors",
    },
    _B: {
        *(f"{_B}.{sub}" for sub in ("answering", "judges", "questions", "run")),
        f"{_G}.monitor",
        f"{_G}.artifact",
        f"{_G}.backends",
        f"{_G}.scorers",
        _A,
        f"{_G}.contract",
        f"{_G}.guarantee",
        f"{_G}.errors",
    },
    f"{_G}.calibration.measure": {
        _B,
        f"{_G}.guard",
        f"{_G}.monitor",
        f"{_G}.artifact",
        f"{_G}.backends",
        f"{_G}.scorers",
        f"{_G}.contract",
        f"{_G}.guarantee",
        f"{_G}.config",
        f"{_G}.errors",
    },
    f"{_G}.calibration": {
        _B,
        f"{_G}.calibration.measure",
        f"{_G}.lazy",
    },
    # the entry points on top
    f"{_G}.cli": {
        f"{_G}.serve",
        f"{_G}.calibration",
        f"{_G}.guard",
        f"{_G}.monitor",
        f"{_G}.artifact",
        f"{_G}.backends",
        f"{_G}.scorers",
        f"{_G}.contract",
        f"{_G}.guarantee",
        f"{_G}.config",
        f"{_G}.default",
        f"{_G}.errors",
    },
    _G: {
        f"{_G}.guard",
        f"{_G}.monitor",
        f"{_G}.artifact",
        f"{_G}.contract",
        f"{_G}.config",
        f"{_G}.default",
        f"{_G}._version",
    },
}
"""Unit → the units it may import. A unit is a package (with everything under it that is not
a unit of its own) or one of the top level's modules; an allowed unit covers the units under
it (``abstain_guard.adapters`` covers ``abstain_guard.adapters.engine``). Nothing may import
``abstain_guard`` itself (the top). Every import counts as an arrow: at module level, inside a
function (a lazy import is a dependency too), and under ``if TYPE_CHECKING:`` (a type-only
arrow still ties the two packages together for readers and type checkers)."""

MAX_MODULES = 18
"""Modules a package may hold (``__init__`` aside); ``scorers/`` is exempt (one file a method)."""
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, Path]:
    """Every module of the installed package: dotted name → source file."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_FOLDERS.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """The modules of the package that ``module`` imports anywhere in its file (module level,
    functions, ``TYPE_CHECKING``). ``from pkg import name`` is an arrow to ``pkg.name`` when
    that is a module, else to ``pkg`` (its ``__init__``)."""
    found: set[str] = set()
    for source, names in _import_statements(module, path):
        submodules = {f"{source}.{name}" for name in names} & MODULES.keys()
        found |= submodules
        if not names or len(submodules) < len(names):  # `import x`, or a name of x itself
            found.add(source)
    return {m for m in found if m in MODULES and m != module}


IMPORTS = {module: _imported(module, path) for module, path in MODULES.items()}


def _unit(module: str) -> str | None:
    """The row of :data:`MAY_IMPORT` that ``module`` belongs to (None: no row)."""
    if module in MAY_IMPORT:
        return module
    rows = [u for u in MAY_IMPORT if u != _G and module.startswith(u + ".")]
    return max(rows, key=len) if rows else None


def _covers(allowed: str, unit: str) -> bool:
    return unit == allowed or unit.startswith(allowed + ".")


def _may_import(source: str, target: str) -> bool:
    return source == target or any(_covers(a, target) for a in MAY_IMPORT[source])


def test_every_module_has_a_row_in_the_table():
    """A new module lands in a package that has a row, or the table gets one."""
    homeless = sorted(m for m in MODULES if _unit(m) is None)
    assert homeless == [], f"modules without a row in MAY_IMPORT: {homeless}"
    stale = sorted(u for u in MAY_IMPORT if u not in MODULES)
    assert stale == [], f"rows of MAY_IMPORT that name no module or package: {stale}"
    unknown = sorted({a for allowed in MAY_IMPORT.values() for a in allowed} - MAY_IMPORT.keys())
    assert unknown == [], f"MAY_IMPORT allows units that have no row: {unknown}"


def test_the_table_points_down():
    """The rule itself has no circle: following the allowed arrows never comes back, so every
    arrow the package may have points down a layer."""
    assert all(_G not in allowed for allowed in MAY_IMPORT.values()), "nothing imports the top"
    edges = {
        unit: {other for other in MAY_IMPORT if other != unit and _may_import(unit, other)}
        for unit in MAY_IMPORT
    }
    cycles = _cycles(edges)
    assert cycles == [], f"MAY_IMPORT allows circles: {cycles}"


def test_every_import_follows_the_table():
    """Every arrow between two units of the package is one :data:`MAY_IMPORT` allows."""
    climbing = sorted(
        f"{module} -> {target}"
        for module, targets in IMPORTS.items()
        for target in targets
        if not _may_import(_unit(module) or module, _unit(target) or target)
    )
    assert climbing == [], (
        "imports that MAY_IMPORT does not allow (move the code, or change the table and the "
        f"package docstrings with it): {climbing}"
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected part of ``graph`` with more than one node (or a
    node that imports itself), each as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.append(member)
                if member == node:
                    break
            if len(part) > 1 or node in graph.get(node, ()):
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_anywhere():
    """No module of ``abstain_guard``, ``adapters/`` or ``calibration/`` imports one that
    imports it back, directly or through others — counting imports inside functions and under
    ``TYPE_CHECKING`` (see :data:`MAY_IMPORT`)."""
    assert _cycles(IMPORTS) == [], f"import circles (each a set of modules): {_cycles(IMPORTS)}"


def _package_folders() -> list[Path]:
    return sorted(
        {p.parent for folder in PACKAGE_FOLDERS.values() for p in folder.rglob("__init__.py")}
    )


def test_no_package_holds_more_than_max_modules():
    counts = {
        str(folder.relative_to(ROOT)): len([p for p in folder.glob("*.py") if p.stem != "__init__"])
        for folder in _package_folders()
        if folder != SCORERS
    }
    crowded = {folder: n for folder, n in counts.items() if n > MAX_MODULES}
    assert crowded == {}, f"packages with more than {MAX_MODULES} modules: {crowded}"


def test_no_function_is_longer_than_max_function_lines():
    long = {
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}": length
        for path in MODULES.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES  # type: ignore[operator]
    }
    assert long == {}, f"functions longer than {MAX_FUNCTION_LINES} lines: {long}"


#: What history looks like in a text: an issue reference or a calendar date.
HISTORY = re.compile(r"\b[Ii]ssues? #?[0-9]+\b|\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")


def _texts_without_history() -> list[Path]:
    docs = [p for p in (ROOT / "docs").rglob("*.md")]
    return [*MODULES.values(), ROOT / "Makefile", ROOT / "README.md", *docs]


def test_no_history_in_library_code_makefile_or_docs():
    found = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
        for path in _texts_without_history()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert found == [], "history belongs in commit messages:\n" + "\n".join(found)


_MAY_IMPORT_LINE = re.compile(r"^May import:(.*?)(?:\n\s*\n|\Z)", re.S | re.M)


@pytest.mark.parametrize("unit", sorted(u for u in MAY_IMPORT if MODULES[u].name == "__init__.py"))
def test_each_package_docstring_states_its_row(unit: str):
    """A package's docstring says what lives there and, in a paragraph ``May import: ...``,
    exactly the units its row of :data:`MAY_IMPORT` allows."""
    doc = ast.get_docstring(ast.parse(MODULES[unit].read_text())) or ""
    match = _MAY_IMPORT_LINE.search(doc)
    assert match, f"{unit}: the package docstring has no 'May import:' paragraph"
    stated = set(re.findall(r"``(abstain_guard[\w.]*)``", match.group(1)))
    assert stated == MAY_IMPORT[unit], (
        f"{unit}: the docstring says it may import {sorted(stated)}, "
        f"MAY_IMPORT says {sorted(MAY_IMPORT[unit])}"
    )


def test_importing_the_package_warns_of_nothing():
    """``import abstain_guard`` (and the scorers, the command line) with deprecation warnings
    as errors: no module of ours uses a deprecated API at import time."""
    code = "import abstain_guard, abstain_guard.scorers, abstain_guard.cli, abstain_guard.guard"
    out = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
