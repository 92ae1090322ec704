"""README's four recipes stay true to the command line: every ``abstain-guard`` command in
"Guard your own model" parses with the real parser, names registered scorers, and names its
model in the grammar ``--model`` reads. (Each recipe's flow runs end to end in its
integration test: the vLLM connector in tests/integration/backends/test_vllm_backend.py, a
logprob-less endpoint in the black-box calibration test, a GGUF file on a device in
tests/integration/calibration/test_model_option_gguf.py, a judge and a review in
tests/unit/calibration/test_review_workflow.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from abstain_guard.cli.commands import build_parser
from abstain_guard.contract.model_names import parse_model_name
from abstain_guard.scorers._registry import scorer_names

README = Path(__file__).resolve().parents[3] / "README.md"


def _recipe_commands() -> list[list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Guard your own model") : text.index("## How many labels")]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("abstain-guard "):
                commands.append(shlex.split(line)[1:])
    return commands


def test_the_readme_has_its_four_recipes() -> None:
    text = README.read_text(encoding="utf-8")
    assert all(f"**({r})" in text for r in "abcd")
    assert len(_recipe_commands()) >= 8


@pytest.mark.parametrize("argv", _recipe_commands(), ids=lambda a: " ".join(a[:3]))
def test_each_recipe_command_parses(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    scorer = getattr(args, "scorer", None)
    if scorer is not None:
        assert scorer in scorer_names(), f"README names scorer {scorer!r}, not registered"
    model = getattr(args, "model", None)
    if model is not None:
        parse_model_name(
            model,
            served_model=getattr(args, "served_model", None),
            api_key_env=getattr(args, "api_key_env", None),
        )
