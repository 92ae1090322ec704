"""``abstain-guard --help`` and every subcommand's ``--help`` import nothing heavy, and
calibrate's options are the config's fields."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from abstain_guard.cli.calibrate import OWN_OPTIONS, RENAMED, config_overrides
from abstain_guard.cli.commands import COMMANDS, build_parser

HEAVY = ("torch", "transformers", "sklearn", "xgboost", "sentence_transformers", "fastapi")

BLOCKED_HELP = textwrap.dedent(
    """
    import importlib.abc, json, sys

    HEAVY = set(json.loads(sys.argv[1]))
    asked = []

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HEAVY:
                asked.append(name)
                raise ImportError(f"{name} is blocked: --help must not import it")
            return None

    sys.meta_path.insert(0, Blocker())
    from abstain_guard.cli.commands import main

    codes = {}
    for argv in json.loads(sys.argv[2]):
        try:
            main(argv)
            codes[" ".join(argv)] = None
        except SystemExit as exc:
            codes[" ".join(argv)] = exc.code
    print(json.dumps({"codes": codes, "asked": sorted(set(asked))}))
    """
)


def _subcommands() -> list[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return list(sub.choices)


def test_help_imports_nothing_heavy() -> None:
    names = _subcommands()
    assert len(names) == len(COMMANDS)  # one subcommand a module
    argvs = [["--help"], *([name, "--help"] for name in names)]
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED_HELP, json.dumps(HEAVY), json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["codes"] == {" ".join(argv): 0 for argv in argvs}
    assert report["asked"] == [], f"--help tried to import {report['asked']}"


def test_every_calibrate_option_sets_a_config_field() -> None:
    from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    dests = {a.dest for a in sub.choices["calibrate"]._actions} - {"help", "debug"}
    fields = {RENAMED.get(d, d) for d in dests - OWN_OPTIONS}
    assert dests >= OWN_OPTIONS and fields <= set(CalibrationConfig.model_fields)
    given_flags = ["--address", "auto", "--review", "5", "--skip-bad-rows", "--limit", "7"]
    judge = ["--judge-model", "openai:gpt-4o-mini"]
    args = parser.parse_args(["calibrate", "--data", "d", "--out", "o", *given_flags, *judge])
    overrides = config_overrides(args)
    assert set(overrides) == fields
    given = {k: v for k, v in overrides.items() if v is not None}
    assert given == {
        "ray_address": "auto",
        "review_size": 5,
        "skip_bad_rows": True,
        "limit": 7,
        "judge": {"name": "llm", "model": "openai:gpt-4o-mini"},
    }
    config = CalibrationConfig(**given)
    assert (config.ray_address, config.review_size, config.limit) == ("auto", 5, 7)
    left_off = config_overrides(parser.parse_args(["calibrate", "--data", "d", "--out", "o"]))
    assert all(v is None for v in left_off.values())  # a switch left off leaves the file's
