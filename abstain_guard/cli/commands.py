"""The ``abstain-guard`` parser, built from each subcommand's own ``add_parser``, and the
entry point."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence

from abstain_guard.errors import AbstainGuardError

from . import (
    ask,
    calibrate,
    demo,
    evaluate,
    monitor,
    plan,
    recalibrate,
    report,
    review,
    review_size,
    score,
    serve,
)

COMMANDS = (
    calibrate,
    ask,
    score,
    evaluate,
    report,
    demo,
    recalibrate,
    monitor,
    serve,
    review,
    review_size,
    plan,
)
"""The subcommand modules, in ``--help`` order: each has ``add_parser(subparsers)``."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    parser = argparse.ArgumentParser(
        prog="abstain-guard",
        description="Calibrate, run and evaluate a conformal abstention guard for an LLM.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log decisions")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also accepted after the command)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub).add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Run a command; user mistakes raise their typed :class:`AbstainGuardError`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    return int(args.func(args))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``abstain-guard`` script: a user mistake prints one ``error:``
    message and exits with 2 (``--debug``: with its traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except AbstainGuardError as exc:
        if "--debug" in args[: args.index("--") if "--" in args else len(args)]:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
