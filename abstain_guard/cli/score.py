"""``abstain-guard score``: the guard's decision on every logged answer of a file.

Each line of ``--data`` is one JSON object: ``question``, ``answer`` and optionally ``id``,
``token_ids`` (the ids the model generated), ``finish_reason`` (``"stop"`` or ``"length"``),
``model_fingerprint`` and ``system_prompt`` (what it was generated with). Each line of
``--out`` is ``{"id", "decision"}``, in input order, the decision being the guard's
(:meth:`~abstain_guard.guard.runnable.AbstentionGuard.check`: its scorer and, in ``model``,
the model whose calibration it relies on). A line that cannot be checked (malformed, another
recorded model or system prompt, an answer the calibrated deployment could not have
generated) is refused: an abstention whose ``error`` says why. Nothing is dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from abstain_guard.default import DEFAULT_ARTIFACT_DIR
from abstain_guard.errors import ConfigError, DatasetError

from .checks import guard_config, positive


def _chunks(path: Path, size: int) -> Iterator[list[tuple[int, str]]]:
    """``(line number, line)`` of the non-blank lines of ``path``, ``size`` at a time."""
    chunk: list[tuple[int, str]] = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                chunk.append((number, line))
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _checked(guard: Any, prompt: Any, record: Any, chunk: list[tuple[int, str]]) -> list[Any]:
    """The decision on each line of ``chunk``, or the error that refused it."""
    from abstain_guard.guard.answer_check import LoggedAnswer

    results: list[Any] = []
    pairs, where = [], []
    for number, line in chunk:
        answer_id = str(number)
        try:
            logged = LoggedAnswer.parse(line, number)
            answer_id = logged.id
            logged.check(guard.artifact, record)
        except Exception as exc:
            results.append((answer_id, exc))
            continue
        where.append(len(results))
        results.append((logged.id, None))
        pairs.append((prompt.invoke({"question": logged.question}), logged.answer))
    decided = guard.check_batch(pairs, {"max_concurrency": len(pairs)}, return_exceptions=True)
    for i, outcome in zip(where, decided, strict=True):
        results[i] = (results[i][0], outcome)
    return results


def _line(guard: Any, answer_id: str, outcome: Any) -> dict[str, Any]:
    """The output line of one answer: its decision, or the refusal of an error (fails closed)."""
    if isinstance(outcome, BaseException):
        error = f"{type(outcome).__name__}: {outcome}"
        _, decision = guard.policy.abstain("answer refused", error)
        outcome = decision.replace(model=guard.artifact.model_fingerprint)
    return {"id": answer_id, "decision": outcome.to_dict()}


def _score(args: argparse.Namespace) -> int:
    positive(args.batch_size, "--batch-size")
    data, out = Path(args.data), Path(args.out)
    if not data.is_file():
        raise DatasetError(f"No answers file at {data}: pass --data with a JSON-lines file.")
    if out.exists() and out.is_dir():
        raise ConfigError(f"--out {out} is a directory; pass the path of a JSON-lines file.")
    from abstain_guard.guard.chains import load_guard_chain

    chain, guard, _ = load_guard_chain(args.artifact, guard_config(args.config), kind=args.kind)
    guard.artifact.answer_route()  # a scorer that cannot is refused before any line
    record = guard.policy.deployment
    assert record is not None  # load_guard_chain refuses an artifact without one
    _, prompt = record.kind(args.kind)
    counts = {"answered": 0, "abstained": 0, "refused": 0}
    with out.open("w", encoding="utf-8") as fh:
        for chunk in _chunks(data, args.batch_size):
            for answer_id, outcome in _checked(guard, chain.first, prompt, chunk):
                line = _line(guard, answer_id, outcome)
                fh.write(json.dumps(line) + "\n")
                decision = line["decision"]
                kind = "refused" if decision["reason"] == "answer refused" else None
                counts[kind or ("abstained" if decision["abstained"] else "answered")] += 1
            fh.flush()
    print(
        f"{sum(counts.values())} answers: {counts['answered']} answered, {counts['abstained']} "
        f"abstained, {counts['refused']} refused (decisions in {out})",
        file=sys.stderr,
    )
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``score`` to the subparsers ``sub``; returns its parser."""
    score = sub.add_parser(
        "score", help="the guard's decision on each logged answer of a JSON-lines file"
    )
    score.add_argument("--artifact", default=str(DEFAULT_ARTIFACT_DIR), help="artifact directory")
    score.add_argument(
        "--data",
        required=True,
        help="JSON lines: question, answer, optional id, token_ids, finish_reason "
        "('stop' or 'length'), model_fingerprint, system_prompt",
    )
    score.add_argument("--out", required=True, help="JSON-lines file of decisions to write")
    score.add_argument("--config", help="guard config (YAML/TOML/JSON): mode, target")
    score.add_argument(
        "--kind",
        choices=["open", "choice", "numeric"],
        help="question kind the answers were prompted as (default: the artifact's only kind)",
    )
    score.add_argument(
        "--batch-size", type=int, default=16, help="answers checked at once (default 16)"
    )
    score.set_defaults(func=_score)
    return score
