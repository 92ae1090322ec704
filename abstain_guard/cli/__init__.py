"""The ``abstain-guard`` command line (console script ``abstain_guard.cli:main``).

* :mod:`.commands` — the parser, built from each subcommand's ``add_parser``, and ``main``;
* one module per subcommand: :mod:`.calibrate`, :mod:`.ask`, :mod:`.score`, :mod:`.evaluate`,
  :mod:`.report`, :mod:`.demo`, :mod:`.recalibrate`, :mod:`.serve`, :mod:`.review`,
  :mod:`.review_size`, :mod:`.plan`;
* :mod:`.checks` — the checks the subcommands share.

Heavy imports (torch, transformers, xgboost, FastAPI) happen inside the commands, so
``--help`` and configuration errors are instant. The package exports :func:`main`, the console
script.

May import: ``abstain_guard.serve``, ``abstain_guard.calibration``, ``abstain_guard.guard``,
``abstain_guard.artifact``, ``abstain_guard.backends``, ``abstain_guard.scorers``,
``abstain_guard.contract``, ``abstain_guard.guarantee``, ``abstain_guard.config``,
``abstain_guard.default``, ``abstain_guard.errors``.
"""

from __future__ import annotations

from abstain_guard.cli.commands import main

__all__ = ["main"]
