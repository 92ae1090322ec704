"""Bad inputs: each is a typed error with one line saying what to change, exit code 2, no
traceback, no model loaded and nothing written outside the test's folder."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import abstain_guard.guard.chains
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.artifact.guard_artifact import GuardArtifact
from abstain_guard.calibration.building import pipeline, preflight
from abstain_guard.calibration.measure import deployment_check, held_out
from abstain_guard.calibration.measure import evaluate as evaluate_module
from abstain_guard.cli import commands as cli
from abstain_guard.errors import (
    ConfigError,
    DatasetError,
    ModelNotFoundError,
    OutputPathError,
    PreflightError,
    ResultsFileError,
)
from abstain_guard.scorers import build_scorer

REPO = Path(__file__).resolve().parents[3]


class ModelLoaded(AssertionError):
    """A model was loaded although validation should have stopped the run first."""


@pytest.fixture(autouse=True)
def guarded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise ModelLoaded("a model was loaded before validation finished")

    for module in (pipeline, evaluate_module, deployment_check):
        monkeypatch.setattr(module, "load_model", fail)
    monkeypatch.setattr(abstain_guard.guard.chains, "load_chat_model", fail)
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("ABSTAIN_GUARD_"):
            monkeypatch.delenv(name)


def _rows(n: int, row: Callable[[int], Any] | None = None) -> str:
    make = row or (lambda i: {"question": f"What is item {i}?", "answer": f"a{i}"})
    return "".join(json.dumps(make(i)) + "\n" for i in range(n))


def _file(tmp: Path, name: str, text: str | bytes) -> str:
    path = tmp / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return str(path)


def _good(tmp: Path) -> str:
    return _file(tmp, "q.jsonl", _rows(100))


def _calibrate(tmp: Path, *extra: str, data: str | None = None, out: str | None = None) -> list:
    return [
        "calibrate",
        "--data",
        data or _good(tmp),
        "--out",
        out or str(tmp / "guard"),
        "--quiet",
        *extra,
    ]


def _with_extra_row(tmp: Path, row: str) -> str:
    return _file(tmp, "q.jsonl", _rows(100) + row + "\n")


def _non_empty_dir(tmp: Path) -> str:
    (tmp / "notes").mkdir()
    (tmp / "notes" / "todo.txt").write_text("x")
    return str(tmp / "notes")


def _read_only(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
    (tmp / "ro").mkdir()
    real = os.access

    def access(path: Any, mode: int) -> bool:
        return False if Path(path) == tmp / "ro" else real(path, mode)

    monkeypatch.setattr(preflight.os, "access", access)


def _artifact(tmp: Path, name: str = "art") -> str:
    """A tiny artifact of a likelihood scorer whose metadata points its cache outside."""
    data = _good(tmp)
    ids = [f"q:{i}" for i in range(1, 21)]
    art = GuardArtifact.from_calibration(
        scorer=build_scorer("perplexity"),
        calibration=CalibrationSet(np.linspace(0.1, 2.0, 10), np.arange(10) % 2 == 0),
        model_fingerprint="fp",
        metadata={
            "data": data,
            "config": {},
            "cache_dir": str(tmp / "elsewhere" / "cache"),
            "calibration_ids": ids[:10],
            "test_ids": ids[10:],
        },
    )
    art.save(tmp / name)
    return str(tmp / name)


@dataclass
class Case:
    name: str
    argv: Callable[[Path], list[str]]
    error: type[Exception]
    fragments: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    patch: Callable[[pytest.MonkeyPatch, Path], None] | None = None


CASES = [
    Case("limit-0", lambda t: _calibrate(t, "--limit", "0"), ConfigError, ("limit", "got 0")),
    Case("limit-negative", lambda t: _calibrate(t, "--limit", "-5"), ConfigError, ("limit",)),
    Case(
        "scorer-bogus",
        lambda t: _calibrate(t, "--scorer", "bogus"),
        ConfigError,
        ("unknown scorer 'bogus'", "geometry"),
    ),
    Case("seed-negative", lambda t: _calibrate(t, "--seed", "-1"), ConfigError, ("seed",)),
    Case(
        "cache-dir-is-a-file",
        lambda t: _calibrate(t, "--cache-dir", _file(t, "f.txt", "x")),
        OutputPathError,
        ("f.txt is a file",),
    ),
    Case(
        "scorer-params-bad-key",
        lambda t: _calibrate(t, "--config", _file(t, "c.yaml", "scorer_params: {bogus: 1}\n")),
        ConfigError,
        ("scorer_params", "bogus", "valid parameters"),
    ),
    Case(
        "report-results-jsonl",
        lambda t: ["report", "--results", _good(t), "--out", str(t / "rep")],
        ResultsFileError,
        ("not one JSON document", "results.json"),
    ),
    Case(
        "report-results-missing",
        lambda t: ["report", "--results", str(t / "nope.json"), "--out", str(t / "rep")],
        ResultsFileError,
        ("does not exist",),
    ),
    Case(
        "out-is-a-file",
        lambda t: _calibrate(t, out=_file(t, "o.txt", "x")),
        OutputPathError,
        ("o.txt is a file",),
    ),
    Case(
        "out-non-empty-non-artifact",
        lambda t: _calibrate(t, out=_non_empty_dir(t)),
        OutputPathError,
        ("not an artifact", "todo.txt"),
    ),
    Case(
        "out-under-read-only-parent",
        lambda t: _calibrate(t, out=str(t / "ro" / "guard")),
        PreflightError,  # the artifact and its cache beside it
        ("2 problems", "ro is not writable", "--cache-dir"),
        patch=_read_only,
    ),
    Case(
        "model-missing",
        lambda t: _calibrate(t, "--config", _file(t, "c.yaml", "model: /nonexistent\n")),
        ModelNotFoundError,
        ("/nonexistent", "not a folder"),
    ),
    Case(
        "max-new-tokens-beyond-context",
        lambda t: _calibrate(t, "--config", _file(t, "c.yaml", "max_new_tokens: 100000\n")),
        ConfigError,
        ("max_new_tokens 100000", "8192"),
    ),
    Case(
        "question-100kB",
        lambda t: _calibrate(
            t, data=_with_extra_row(t, json.dumps({"question": "x" * 100_000, "answer": "y"}))
        ),
        DatasetError,
        ("too long", "q.jsonl:101", "100,000 characters"),
    ),
    Case(
        "malformed-jsonl-row",
        lambda t: _calibrate(t, data=_with_extra_row(t, '{"question": "Q?", "answer": ')),
        DatasetError,
        ("q.jsonl:101: invalid JSON", "column 30", "--skip-bad-rows"),
    ),
    Case(
        "answer-is-a-number",
        lambda t: _calibrate(t, data=_with_extra_row(t, '{"question": "N?", "answer": 0}')),
        DatasetError,
        ("q.jsonl:101", "JSON number", "kind: numeric"),
    ),
    Case(
        "answer-is-an-object",
        lambda t: _calibrate(t, data=_with_extra_row(t, '{"question": "D?", "answer": {"a": 1}}')),
        DatasetError,
        ("q.jsonl:101", "JSON object"),
    ),
    Case(
        "answer-is-a-boolean",
        lambda t: _calibrate(t, data=_with_extra_row(t, '{"question": "B?", "answer": true}')),
        DatasetError,
        ("q.jsonl:101", "JSON boolean"),
    ),
    Case(
        "answer-alias-is-a-number",
        lambda t: _calibrate(t, data=_with_extra_row(t, '{"question": "L?", "answer": ["x", 3]}')),
        DatasetError,
        ("q.jsonl:101", "alias"),
    ),
    Case(
        "identical-questions",
        lambda t: _calibrate(
            t, data=_file(t, "q.jsonl", _rows(100, lambda i: {"question": "Same?", "answer": "a"}))
        ),
        DatasetError,
        ("99 bad rows", "q.jsonl:2: duplicate question (same as line 1", "and 79 more"),
    ),
    Case(
        "near-duplicate-question",
        lambda t: _calibrate(
            t, data=_with_extra_row(t, json.dumps({"question": "what is  ITEM 7", "answer": "b"}))
        ),
        DatasetError,
        ("q.jsonl:101: duplicate question (same as line 8",),
    ),
    Case(
        "non-utf8",
        lambda t: _calibrate(
            t,
            data=_file(
                t,
                "q.jsonl",
                _rows(50).encode() + '{"question": "Caf\xe9?", "answer": "x"}\n'.encode("latin-1"),
            ),
        ),
        DatasetError,
        ("line 51 is not valid UTF-8", "0xe9", "column 18"),
    ),
    Case(
        "several-problems-at-once",
        lambda t: _calibrate(
            t,
            "--config",
            _file(t, "c.yaml", "model: /nonexistent\n"),
            data=_with_extra_row(t, '{"question": "B?", "answer": true}'),
            out=_file(t, "o.txt", "x"),
        ),
        PreflightError,
        ("3 problems", "o.txt is a file", "/nonexistent", "JSON boolean"),
    ),
    Case(
        "evaluate-out-is-a-file",
        lambda t: ["evaluate", "--artifact", _artifact(t), "--out", _file(t, "o.txt", "x")],
        OutputPathError,
        ("o.txt is a file",),
    ),
    Case(
        "evaluate-missing-artifact-and-bad-limit",
        lambda t: ["evaluate", "--artifact", str(t / "none"), "--out", "rep", "--limit", "0"],
        PreflightError,
        ("2 problems", "No artifact at", "--limit must be a positive integer"),
    ),
    Case(
        "evaluate-unknown-baseline",
        lambda t: ["evaluate", "--artifact", _artifact(t), "--out", "r", "--baselines", "vibes"],
        ConfigError,
        ("Unknown baseline", "vibes"),
    ),
    Case(
        "live-guard-env-variable",
        lambda t: ["evaluate", "--live", "--artifact", _artifact(t), "--out", "live"],
        ConfigError,
        ("mode",),
        env={"ABSTAIN_GUARD_MODE": "bogus"},
    ),
    Case(
        "ask-unknown-env-variable",
        lambda t: ["ask", "--artifact", _artifact(t), "Q?"],
        ConfigError,
        ("ABSTAIN_GUARD_PARTICIPATON", "ABSTAIN_GUARD_PARTICIPATION"),
        env={"ABSTAIN_GUARD_PARTICIPATON": "0.9"},
    ),
    Case(
        "demo-zero-questions",
        lambda t: ["demo", "--artifact", _artifact(t), "--out", "demo", "--questions", "0"],
        ConfigError,
        ("--questions must be a positive integer",),
    ),
]


def _listing() -> set[str]:
    return {p.name for p in REPO.iterdir()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_typed_error_before_any_model_loads(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    if case.patch is not None:
        case.patch(monkeypatch, tmp_path)
    argv = case.argv(tmp_path)
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    before_repo, before_cwd = _listing(), set(os.listdir(tmp_path))

    with pytest.raises(case.error) as info:
        cli.run(argv)
    message = str(info.value)
    for fragment in case.fragments:
        assert fragment in message
    capsys.readouterr()

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("error: ")
    assert _listing() == before_repo
    assert set(os.listdir(tmp_path)) == before_cwd  # not even a cache or a report folder


def test_debug_prints_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = _calibrate(tmp_path, "--limit", "0")
    assert cli.main([*argv, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: ")


def test_skip_bad_rows_opts_into_skipping_and_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = _rows(100) + '{"question": "B?", "answer": true}\n{"question": "What is item 3?", '
    rows += '"answer": "z"}\n{"broken\n'
    data = _file(tmp_path, "q.jsonl", rows)
    # validation passes: the run goes on to load the model (refused here)
    with pytest.raises(ModelLoaded):
        cli.run(_calibrate(tmp_path, "--skip-bad-rows", data=data))
    assert any("skipped 3 bad rows" in r.getMessage() for r in caplog.records)


def test_evaluate_writes_its_cache_only_under_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The artifact's metadata points its cache elsewhere: evaluate uses <out>/cache."""
    art = _artifact(tmp_path)

    class Model:
        fingerprint = "fp"

    class Stop(Exception):
        pass

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise Stop

    monkeypatch.setattr(evaluate_module, "load_model", lambda cfg: Model())
    monkeypatch.setattr(held_out, "generate_answers", stop)
    with pytest.raises(Stop):
        cli.run(["evaluate", "--artifact", art, "--out", "rep", "--quiet"])
    assert (tmp_path / "rep" / "cache" / "run.sqlite").is_file()
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(Stop):
        cli.run(["evaluate", "--artifact", art, "--out", "rep2", "--cache-dir", "c", "--quiet"])
    assert (tmp_path / "c" / "run.sqlite").is_file() and not (tmp_path / "rep2").exists()


def test_live_check_writes_its_cache_only_under_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    art = _artifact(tmp_path)

    class Stop(Exception):
        pass

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise Stop

    monkeypatch.setattr(deployment_check, "load_guard_chain", lambda *a, **k: (None, None, None))
    monkeypatch.setattr(deployment_check, "generate_answers", stop)
    with pytest.raises(Stop):
        deployment_check.live_check(art, model=object(), out=tmp_path / "live", progress=False)
    assert (tmp_path / "live" / "cache" / "run.sqlite").is_file()
    assert not (tmp_path / "elsewhere").exists()


def test_an_over_long_input_abstains_unless_on_error_raise() -> None:
    """The guard fails closed on a question too long for the model (on_error="abstain")."""
    import asyncio

    from langchain_core.language_models import BaseChatModel

    from abstain_guard import AbstentionGuard, GuardConfig
    from abstain_guard.errors import ContextLengthError

    class TooLong(BaseChatModel):
        @property
        def _llm_type(self) -> str:
            return "too-long"

        def _generate(self, *args: Any, **kwargs: Any) -> Any:
            raise ContextLengthError("the prompt has 9000 tokens; the context window is 8192.")

    art = GuardArtifact.from_calibration(
        scorer=build_scorer("perplexity"),
        calibration=CalibrationSet(np.linspace(1, 3, 20), [1, 0] * 10),
    )
    guard = AbstentionGuard(TooLong(), artifact=art, config=GuardConfig(participation=0.5))
    for out in (guard.invoke("x" * 100_000), asyncio.run(guard.ainvoke("x"))):
        decision = out.response_metadata["abstention"]
        assert out.content == "I don't know." and decision["abstained"] is True
        assert decision["reason"] == "input too long" and "9000 tokens" in decision["error"]
    strict = AbstentionGuard(
        TooLong(), artifact=art, config=GuardConfig(participation=0.5, on_error="raise")
    )
    with pytest.raises(ContextLengthError):
        strict.invoke("x")
