"""The package as a user gets it: the sdist and wheel build and pass ``twine check``, the
wheel holds every module and the shipped guard, and installed alone (its core dependencies,
no extra) into a fresh virtual environment it runs ``abstain-guard --help`` and decides on a
stored response with bitwise the score this (full) install computes.

The stored response (``tests/data/shipped_guard_response.json``) is the shipped chain's
reply to the artifact's first calibration question: ``load_guard_chain`` on the default
model, the reply's content and ``response_metadata`` (less its decision) as JSON.

The fresh environment gets the same versions of the core dependencies as this one
(constraints read from this environment), so the comparison is of the library, not of two
numpy releases; pip's cache makes a second run download nothing.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from abstain_guard import __version__

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
STORED_RESPONSE = ROOT / "tests" / "data" / "shipped_guard_response.json"
SOURCE_FOLDERS = {"abstain_guard": "abstain_guard", "adapters": "abstain_guard/adapters"}
SOURCE_FOLDERS["calibration"] = "abstain_guard/calibration"
"""Each source folder and where its files go in the wheel (pyproject's package-dir)."""
HEAVY = ("torch", "sklearn", "xgboost", "transformers")
"""What only the extras bring: the core install must not have them."""


def decide_stored(path: str) -> dict[str, object]:
    """The shipped guard's decision on the stored response at ``path``: its score as
    ``float.hex`` (every bit), whether it abstained, where the artifact was loaded from and
    which of the heavy modules got imported. Self-contained: the fresh environment runs this
    function's source."""
    import json
    import sys
    import warnings
    from pathlib import Path

    from langchain_core.messages import AIMessage

    from abstain_guard import GuardArtifact, default_artifact_path
    from abstain_guard.guard.policy import AbstentionPolicy

    stored = json.loads(Path(path).read_text())
    message = AIMessage(content=stored["content"], response_metadata=stored["response_metadata"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kernel note: made on other CPU kernels
        reply, _ = AbstentionPolicy(GuardArtifact.load(default_artifact_path())).decide(message)
    decision = reply.response_metadata["abstention"]
    return {
        "score": float(decision["score"]).hex(),
        "abstained": bool(decision["abstained"]),
        "artifact": str(default_artifact_path()),
        "heavy": [m for m in ("torch", "sklearn", "xgboost", "transformers") if m in sys.modules],
    }


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a command outside this environment (no PYTHONPATH, no active venv), from ``cwd``
    so that the repository's folders are not importable; fail with its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _this_environments_versions() -> str:
    """A pip constraints file: ``name==version`` of every distribution this environment
    imports from (this project and local builds such as ``torch+cpu`` left out), so that
    whatever the wheel's dependencies pull comes in the version the full install runs."""
    pins: dict[str, str] = {}
    for dist in metadata.distributions():  # in sys.path order: the one imported comes first
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name and name != "abstain-guard" and "+" not in dist.version:
            pins.setdefault(name, f"{name}=={dist.version}")
    return "".join(f"{pin}\n" for pin in sorted(pins.values()))


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel built from it (``python -m build``), in a folder of their own."""
    out = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "build", "--outdir", out, ROOT, cwd=out)
    return out


@pytest.fixture(scope="module")
def core_env(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment (no system site-packages) with the wheel and its core
    dependencies only; its ``bin`` folder."""
    home = tmp_path_factory.mktemp("core_env")
    (wheel,) = dist.glob("*.whl")
    venv.create(home / "venv", with_pip=False, clear=True)
    python = home / "venv" / "bin" / "python"
    constraints = home / "constraints.txt"
    constraints.write_text(_this_environments_versions())
    _run(
        sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile",
        "-c", constraints, wheel, cwd=home,
    )  # fmt: skip
    return python.parent


def test_the_sdist_and_wheel_pass_twine_check(dist: Path) -> None:
    files = sorted(dist.iterdir())
    stem = f"abstain_guard-{__version__}"
    assert [f.name for f in files] == [f"{stem}-py3-none-any.whl", f"{stem}.tar.gz"]
    done = _run(sys.executable, "-m", "twine", "check", "--strict", *files, cwd=dist)
    assert done.stdout.count("PASSED") == 2, done.stdout


def test_the_wheel_holds_every_module_the_shipped_guard_and_the_license(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{dest}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, dest in SOURCE_FOLDERS.items()
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    shipped = ROOT / "abstain_guard" / "default_guard"
    expected |= {f"abstain_guard/default_guard/{p.name}" for p in shipped.iterdir()}
    expected |= {"abstain_guard/py.typed", "abstain_guard/monitor/dashboard.html"}  # package data
    packaged = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packaged == expected, (
        f"missing from the wheel: {sorted(expected - packaged)}; "
        f"in the wheel but not in the tree: {sorted(packaged - expected)}"
    )
    info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    assert f"{info}/licenses/LICENSE" in names
    meta = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta


def test_the_core_install_has_no_heavy_dependency(core_env: Path) -> None:
    probe = f"import importlib.util as u; print([m for m in {HEAVY!r} if u.find_spec(m)])"
    done = _run(core_env / "python", "-I", "-c", probe, cwd=core_env)
    assert done.stdout.strip() == "[]", f"the core install has {done.stdout.strip()}"


def test_the_core_install_runs_the_cli_help(core_env: Path) -> None:
    done = _run(core_env / "abstain-guard", "--help", cwd=core_env)
    assert done.stdout.startswith("usage: abstain-guard"), done.stdout
    for command in ("calibrate", "ask", "evaluate", "demo", "serve"):
        assert command in done.stdout


def test_the_core_install_decides_bitwise_as_the_full_install(core_env: Path) -> None:
    """The shipped guard, loaded from the installed wheel with numpy and scipy alone, scores
    the stored response to the bit as this environment (torch, scikit-learn, ...) does."""
    script = f"{inspect.getsource(decide_stored)}\nprint(json.dumps(decide_stored(sys.argv[1])))"
    script = "import json, sys\n" + script
    done = _run(core_env / "python", "-I", "-c", script, STORED_RESPONSE, cwd=core_env)
    core = json.loads(done.stdout.strip().splitlines()[-1])
    full = decide_stored(str(STORED_RESPONSE))
    assert Path(str(core["artifact"])).is_relative_to(core_env.parent), core["artifact"]
    assert core["heavy"] == [], core
    assert (core["score"], core["abstained"]) == (full["score"], full["abstained"]), (core, full)
