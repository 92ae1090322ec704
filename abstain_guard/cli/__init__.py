"""The ``abstain-guard`` command line (console script ``abstain_guard.cli:main``).

One module per subcommand, each with its own ``add_parser``; :mod:`.commands` builds the
parser from them (:data:`~.commands.COMMANDS`) and holds ``main``; :mod:`.checks` holds the
checks they share.

Heavy imports (torch, transformers, xgboost, FastAPI) happen inside the commands, so
``--help`` and configuration errors are instant. The package exports :func:`main`, the console
script.

May import: ``abstain_guard.serve``, ``abstain_guard.calibration``, ``abstain_guard.guard``,
``abstain_guard.monitor``, ``abstain_guard.artifact``, ``abstain_guard.backends``,
``abstain_guard.scorers``, ``abstain_guard.contract``, ``abstain_guard.guarantee``,
``abstain_guard.config``, ``abstain_guard.default``, ``abstain_guard.errors``.
"""

from __future__ import annotations

from abstain_guard.cli.commands import main

__all__ = ["main"]
