"""Import paths that moved, kept working for one release with a ``DeprecationWarning``.

Issue 35 gave the scorers one home, :mod:`abstain_guard.scorers`: the registry and the
``Scorer`` base left ``abstain_guard.scoring``, the likelihood scorers left
``abstain_guard.likelihood``, and the scorers the guard runs on live answers left
``abstain_guard.calibration.inference`` (a folder named for offline work), and
``abstain_guard.chat_models`` (specs and identities of chat models) became
``abstain_guard.chat_model_specs``.

Issue 49 grouped the modules by concept: ``abstain_guard/`` into ``guarantee/``,
``contract/``, ``artifact/``, ``monitor/``, ``guard/`` and ``cli/``; ``adapters/`` into
``capture/``, ``tools/``, ``model/``, ``engine/`` and ``chat/``; ``calibration/building/`` into
``run/``, ``questions/``, ``judges/`` and ``answering/`` (:data:`MOVED_MODULES` lists every
move). Where a package took the name of the module it replaced (``abstain_guard.artifact``,
``.monitor``, ``.guard``, ``.cli``, ``abstain_guard.adapters.capture``, ``.tools``), the
package exports that module's public names: the old path is still a current one. The module
``abstain_guard.conformal``, which the package exports by name, stays importable under its old
dotted path too (``abstain_guard/__init__.py``).

Code that still imports an old path gets the same objects, and a ``DeprecationWarning`` naming
the new path when it reads a name from the old module. A class path recorded under an old
module (an artifact's chat model record, ``"module:Class"``) resolves to the same class
(:func:`current_class_path`).

There are no files at the old paths: :func:`install` (called by ``abstain_guard/__init__``,
which runs before any ``abstain_guard.*`` import) puts a finder on ``sys.meta_path`` that
answers for exactly the module names in :data:`MOVED_MODULES`. Delete this module and that
call in the next release.

May import: nothing of the package (it is imported first).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = [
    "MOVED_MODULES",
    "REGROUPED",
    "MovedModule",
    "current_class_path",
    "install",
    "moved_attribute_getter",
]

_NEW = "abstain_guard.scorers"


@dataclass(frozen=True)
class MovedModule:
    """Where the names of one old module live now.

    Attributes:
        home: the module that holds the old module's names.
        names: the names that moved elsewhere, each to its module.
    """

    home: str
    names: Mapping[str, str] = field(default_factory=dict)

    def module_of(self, name: str) -> str:
        return self.names.get(name, self.home)


_FORMULAS = {
    "attention_score": f"{_NEW}.attention_score",
    "token_sar": f"{_NEW}.sar",
    "sar": f"{_NEW}.sar",
    "greedy_semantic_classes": f"{_NEW}.semantic_entropy",
    "semantic_entropy": f"{_NEW}.semantic_entropy",
    "eigenscore": f"{_NEW}.eigenscore",
}
_OLD = "abstain_guard.calibration.inference"

MOVED_MODULES: dict[str, MovedModule] = {
    # renamed: it holds specs and identities of chat models, not chat models
    "abstain_guard.chat_models": MovedModule("abstain_guard.contract.chat_model_specs"),
    "abstain_guard.scoring": MovedModule(_NEW),
    "abstain_guard.likelihood": MovedModule(_NEW),
    _OLD: MovedModule(_NEW, _FORMULAS),
    f"{_OLD}.attention": MovedModule(f"{_NEW}.attention_score"),
    f"{_OLD}.aux_models": MovedModule(f"{_NEW}._aux_models"),
    f"{_OLD}.calibrated": MovedModule(f"{_NEW}.calibrated"),
    f"{_OLD}.calibrator": MovedModule(f"{_NEW}._calibrator"),
    f"{_OLD}.features": MovedModule(f"{_NEW}._features"),
    f"{_OLD}.geometry": MovedModule(f"{_NEW}.geometry"),
    f"{_OLD}.geometry_fast": MovedModule(f"{_NEW}.geometry_fast"),
    f"{_OLD}.geometry_plus": MovedModule(f"{_NEW}.geometry_plus"),
    f"{_OLD}.model_access": MovedModule(f"{_NEW}._model_access"),
    f"{_OLD}.p_true": MovedModule(f"{_NEW}.p_true"),
    f"{_OLD}.sampling": MovedModule(
        f"{_NEW}._sampling",
        {
            **{k: v for k, v in _FORMULAS.items() if k != "attention_score"},
            "SARScorer": f"{_NEW}.sar",
            "SemanticEntropyScorer": f"{_NEW}.semantic_entropy",
            "SIMILARITY_THRESHOLD": f"{_NEW}.semantic_entropy",
            "EigenScoreScorer": f"{_NEW}.eigenscore",
        },
    ),
}
"""Old module name → where its names live now."""

REGROUPED: dict[str, dict[str, str]] = {
    # abstain_guard/: the guarantee, the contract, the artifact, the monitor, the guard, the CLI
    "abstain_guard": {
        "abstain_actions": "guard.abstain_actions",
        "action_risk": "guarantee.action_risk",
        "agent_steps": "guarantee.agent_steps",
        "artifact_files": "artifact.files",
        "chains": "guard.chains",
        "chat_model_specs": "contract.chat_model_specs",
        "cli_checks": "cli.checks",
        "cli_serve": "cli.serve",
        "decision": "guarantee.decision",
        "deployment": "contract.deployment",
        "drift": "monitor.drift",
        "frontier": "guarantee.frontier",
        "groups": "guarantee.groups",
        "kernels": "contract.kernels",
        "metadata": "contract.metadata",
        "middleware": "guard.middleware",
        "monitor_binding": "monitor.binding",
        "monitor_log": "monitor.log",
        "monitor_resume": "monitor.resume",
        "monitor_scope": "monitor.scope",
        "monitor_state": "monitor.state",
        "partial_release": "guarantee.partial_release",
        "policy": "guard.policy",
        "prompts": "contract.prompts",
        "risk_control": "guarantee.risk_control",
        "runnables": "contract.runnables",
        "selection": "guarantee.selection",
        "stream_guard": "guard.stream_gate",
        "streaming": "contract.streaming",
        "tool_choice": "contract.tool_choice",
        "tracing": "guard.tracing",
        "validation": "guarantee.validation",
    },
    # adapters/: capture, tools, model, engine, chat
    "abstain_guard.adapters": {
        "architectures": "capture.architectures",
        "attention": "capture.attention",
        "batching": "engine.batching",
        "capture_features": "capture.features",
        "chat_batch": "chat.batch",
        "chat_host": "chat.host",
        "chat_model": "chat.model",
        "chat_replay": "chat.replay",
        "chat_streaming": "chat.streaming",
        "decode_step": "capture.decode_step",
        "encoding": "engine.encoding",
        "generation": "engine.generation",
        "geometry": "capture.geometry",
        "geometry_torch": "capture.geometry_torch",
        "gguf_cache": "model.gguf_cache",
        "hook_routes": "capture.hook_routes",
        "kernel_env": "engine.kernel_env",
        "kernels": "engine.kernels",
        "loading": "model.loading",
        "prefix": "engine.prefix",
        "replay": "engine.replay",
        "response_metadata": "engine.response_metadata",
        "scheduler": "engine.scheduler",
        "source_parts": "capture.source_parts",
        "streaming": "engine.streaming",
        "threads": "engine.threads",
        "tool_formats": "tools.formats",
        "tool_schema": "tools.schema",
        "types": "capture.types",
        "vllm_folder": "model.vllm_folder",
    },
    # calibration/building/: run, questions, judges, answering (config and generation were
    # renamed before issue 49: calibration_config, answers)
    "abstain_guard.calibration.building": {
        "agent_questions": "questions.agent_questions",
        "agents": "answering.agents",
        "answers": "answering.answers",
        "api_generation": "answering.api_generation",
        "calibration_config": "run.calibration_config",
        "config": "run.calibration_config",
        "conversations": "questions.conversations",
        "dataset_files": "questions.dataset_files",
        "datasets": "questions.datasets",
        "executors": "answering.executors",
        "generation": "answering.answers",
        "items": "questions.items",
        "judges.text": "questions.answer_text",
        "judging": "judges.judging",
        "lookup_facts": "questions.lookup_facts",
        "models": "answering.models",
        "named_datasets": "questions.named_datasets",
        "online_geometry": "answering.online_geometry",
        "probe": "questions.probe",
        "probe_relations": "questions.probe_relations",
        "ray_judges": "answering.ray_judges",
        "run_lock": "run.lock",
        "store": "run.store",
        "stream_calibration": "answering.stream_calibration",
        "tool_labels": "questions.tool_labels",
    },
}
"""Issue 49: package → old module name → its module now, relative to the package."""

_NAMES_MOVED: dict[str, dict[str, str]] = {
    # the one Wilson interval is the guarantee's (groups, the monitor and the benches use it)
    "abstain_guard.drift": {"wilson_interval": "abstain_guard.guarantee.intervals"},
    # a cached answer's row: shared by the local and the API generators (no import circle)
    **{
        f"abstain_guard.calibration.building.{old}": {
            name: "abstain_guard.calibration.building.answering.answer_rows"
            for name in (
                "HELD_OUT",
                "LIKELIHOOD_METADATA",
                "STATES_NS",
                "AnswerRow",
                "AnswerRows",
                "Capture",
                "means_digest",
                "plan_chunks",
            )
        }
        for old in ("answers", "generation")
    },
}
"""Names of a moved module that did not go to its new home."""

MOVED_MODULES.update(
    {
        f"{package}.{old}": MovedModule(
            f"{package}.{new}", _NAMES_MOVED.get(f"{package}.{old}", {})
        )
        for package, renamed in REGROUPED.items()
        for old, new in renamed.items()
    }
)


def _public_home(module: str) -> str:
    """The path to recommend: a private helper module's names are exported by the package."""
    return _NEW if module.startswith(f"{_NEW}._") else module


def moved_attribute_getter(old: str, home_of: Callable[[str], str | None]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names of ``old`` that moved: each access warns and
    returns the object from its new module, ``home_of(name)`` (``None``: not a moved name)."""

    def __getattr__(name: str) -> Any:
        home = home_of(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {_public_home(home)}.{name}; the old path works "
            "until the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__


def current_class_path(path: str) -> str:
    """``"module:Class"`` with an old module (:data:`MOVED_MODULES`) replaced by the module
    that defines ``Class`` now; any other path unchanged."""
    module, sep, name = path.partition(":")
    moved = MOVED_MODULES.get(module)
    if not sep or moved is None:
        return path
    return f"{moved.module_of(name.split('.')[0])}:{name}"


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers for the old module names only; every other import passes through."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        # A package (empty __path__), so that `import old.package.module` still resolves.
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        moved = MOVED_MODULES[module.__name__]

        def home_of(name: str) -> str | None:
            return None if name.startswith("__") else moved.module_of(name)

        module.__doc__ = f"Moved to {_public_home(moved.home)} (deprecated path)."
        module.__getattr__ = moved_attribute_getter(module.__name__, home_of)  # type: ignore[method-assign]


_FINDER = _MovedModuleFinder()


def install() -> None:
    """Put the finder of old module names first on ``sys.meta_path`` (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
