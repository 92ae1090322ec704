"""``abstain-guard ask``: answer or abstain for questions (arguments, or stdin lines)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from abstain_guard.default import DEFAULT_ARTIFACT_DIR

from .checks import guard_config


def _questions(args: argparse.Namespace) -> list[str]:
    if args.questions:
        return list(args.questions)
    return [line.strip() for line in sys.stdin if line.strip()]


def _ask(args: argparse.Namespace) -> int:
    questions = _questions(args)
    if not questions:
        print("No question given: pass questions as arguments or on stdin.", file=sys.stderr)
        return 2
    from abstain_guard.guard.chains import load_guard_chain
    from abstain_guard.guard.policy import decision_of

    config = guard_config(args.config)
    chain, _, _ = load_guard_chain(args.artifact, config, kind=args.kind)
    for question in questions:
        msg = chain.invoke({"question": question})
        info = decision_of(msg)
        assert info is not None
        decision = "ABSTAINED" if info.abstained else "ANSWERED"
        print(f"Q: {question}")
        answer = msg.content
        withheld = msg.response_metadata.get("withheld_response") or {}
        if info.abstained and withheld.get("content"):
            answer = f"{msg.content}   (withheld: {withheld['content']!r})"
        print(f"A: {answer}")
        score = "unscorable" if info.score is None else f"{info.score:.4g}"
        why = f"  ({info.error})" if info.error else ""
        print(
            f"   {decision}  score={score}  threshold={info.threshold:.4g}  "
            f"{info.mode} target={info.target}{why}"
        )
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``ask`` to the subparsers ``sub``; returns its parser."""
    ask = sub.add_parser("ask", help="answer or abstain for questions")
    ask.add_argument("--artifact", default=str(DEFAULT_ARTIFACT_DIR), help="artifact directory")
    ask.add_argument("--config", help="guard config (YAML/TOML/JSON): mode, target")
    ask.add_argument(
        "--kind",
        choices=["open", "choice", "numeric"],
        help="question kind to prompt as (default: the artifact's only kind); choice "
        "questions must list their lettered options",
    )
    ask.add_argument("questions", nargs="*", help="questions (default: read stdin lines)")
    ask.set_defaults(func=_ask)
    return ask
