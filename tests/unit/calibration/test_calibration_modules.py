"""How ``calibration/`` is put together (issue 35): it imports itself relatively, shared
steps live outside the orchestrator, and renamed modules keep their old names for a release."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CALIBRATION = ROOT / "calibration"


def _modules() -> list[Path]:
    return sorted(CALIBRATION.rglob("*.py"))


def _imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def test_calibration_imports_itself_relatively():
    """Every import of a calibration module from inside calibration/ is relative (lazy ones
    too), so import graphs and greps by path see the arrows."""
    absolute = []
    for path in _modules():
        for node in _imports(path):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                if name.startswith("abstain_guard.calibration"):
                    absolute.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert absolute == []


@pytest.mark.parametrize(
    "module",
    [
        "building/answering/executors.py",
        "building/agent_calibration.py",
        "building/answering/online_geometry.py",
        "measure/held_out.py",
        "measure/evaluate.py",
        "measure/baselines.py",
        "measure/deployment_check.py",
        "measure/agent_live.py",
    ],
)
def test_steps_do_not_import_the_orchestrator(module):
    """Helpers several steps share (load_model, build_judges, judge_answers, the labels) live
    in building/answering/models.py and building/judges/judging.py, not in the pipeline that
    runs the steps."""
    found = [
        node.lineno
        for node in _imports(CALIBRATION / module)
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("pipeline")
    ]
    assert found == []
