"""The scorer registry, derived from the scorer classes themselves.

Artifacts store a scorer's ``kind``; the guard, ``calibrate``, ``evaluate``, the CLI and the
docs read :func:`scorer_names` / :func:`scorer_spec`; :func:`build_scorer` is the one way to
build a scorer by name and :func:`scorer_from_state` rebuilds a stored one. Every class in
the built-in scorer modules (:data:`BUILT_IN_MODULES`, in the order listings show them) is
registered under its ``kind`` — or under each of its ``presets`` — with the family and the
fields it declares (:class:`~abstain_guard.scorers._base.Scorer`). Scorer modules import
only numpy and scipy when loaded, so the registry loads no optional dependency. The kinds
are stored in artifacts: never rename one.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from abstain_guard.errors import ArtifactSchemaError, ConfigError, GivenAnswerError
from abstain_guard.scorers._base import Scorer, ScorerState, given_answer_route

BUILT_IN_MODULES: tuple[str, ...] = (
    "perplexity",
    "max_sequence_probability",
    "mean_token_entropy",
    "geometry",
    "geometry_plus",
    "probe",
    "likelihood_probe",
    "calibrated",
    "p_true",
    "attention_score",
    "eigenscore",
    "sar",
    "semantic_entropy",
    "blackbox",
    "verbalized_confidence",
)
"""The modules of :mod:`abstain_guard.scorers` that define the built-in scorers."""


@dataclass(frozen=True)
class ScorerSpec:
    """One registered kind: a scorer class and the constructor parameters of its preset.

    Everything else is the class's own declaration: :attr:`family`, :attr:`reads`,
    :attr:`fitted` (it has a ``fit``) and :attr:`summary` (its docstring's first line).
    """

    kind: str
    cls: type[Scorer]
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.cls.family

    @property
    def reads(self) -> frozenset[str] | None:
        return self.cls.reads

    @property
    def answer_route(self) -> str | None:
        """How its scorers score an answer they did not generate
        (:func:`~abstain_guard.scorers._base.given_answer_route` of :attr:`reads`)."""
        return given_answer_route(self.cls.reads)

    @property
    def fitted(self) -> bool:
        return callable(getattr(self.cls, "fit", None))

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.cls) or self.kind).split("\n\n")[0].replace("\n", " ")


def _specs(cls: type[Scorer]) -> list[ScorerSpec]:
    presets = cls.presets or {cls.kind: {}}
    return [ScorerSpec(kind, cls, dict(params)) for kind, params in presets.items()]


@functools.cache
def _registry() -> dict[str, ScorerSpec]:
    out: dict[str, ScorerSpec] = {}
    for name in BUILT_IN_MODULES:
        module = importlib.import_module(f"abstain_guard.scorers.{name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (
                cls.__module__ == module.__name__
                and issubclass(cls, Scorer)
                and "kind" in vars(cls)
            ):
                out.update((spec.kind, spec) for spec in _specs(cls))
    return out


def register_scorer(cls: type[Scorer]) -> None:
    """Register a custom scorer class under its ``kind`` (and its ``presets``), so that
    artifacts which store it can be loaded."""
    _registry().update((s.kind, s) for s in _specs(cls))


def scorer_spec(kind: str) -> ScorerSpec:
    """The registry entry of ``kind``.

    Raises:
        ArtifactSchemaError: if ``kind`` is not registered.
    """
    spec = _registry().get(kind)
    if spec is None:
        raise ArtifactSchemaError(
            f"Unknown scorer kind {kind!r}; known kinds: {sorted(_registry())}. "
            "Register custom scorers with abstain_guard.scorers.register_scorer before loading."
        )
    return spec


def scorer_names(*, family: str | Sequence[str] | None = None) -> tuple[str, ...]:
    """Registered kinds in registry order, optionally only those of some families."""
    families = (family,) if isinstance(family, str) else family
    return tuple(s.kind for s in _registry().values() if families is None or s.family in families)


def answer_checking_kinds() -> tuple[str, ...]:
    """The registered kinds that can score an answer they did not generate, in registry order."""
    return tuple(s.kind for s in _registry().values() if s.answer_route is not None)


def require_answer_route(scorer: Scorer) -> str:
    """How ``scorer`` scores an answer it did not generate (:meth:`Scorer.answer_route`).

    Raises:
        GivenAnswerError: it cannot; the message names the kinds that can.
    """
    route = scorer.answer_route()
    if route is None:
        reads = sorted(type(scorer).reads or ())
        raise given_answer_refusal(scorer.name, f"it reads {reads or 'nothing it declares'}")
    return route


def given_answer_refusal(name: str, why: str) -> GivenAnswerError:
    """The error refusing to check a given answer with scorer ``name`` (``why``: what it
    reads), naming the kinds that can."""
    return GivenAnswerError(
        f"The scorer {name!r} cannot score an answer it did not generate ({why}). Scorers "
        f"that can: {', '.join(answer_checking_kinds())} (and calibrated ones over them); "
        "calibrate with one of them to check logged answers."
    )


def scorer_class(kind: str) -> type[Scorer]:
    """The class of a registered scorer kind.

    Raises:
        ArtifactSchemaError: if ``kind`` is not registered.
    """
    return scorer_spec(kind).cls


def build_scorer(kind: str, *, model: Any = None, samples: Any = None, **params: Any) -> Scorer:
    """A new, unfitted scorer of ``kind``: the one way to build a scorer by name.

    Args:
        kind: a registered kind (:func:`scorer_names`).
        model: the chat model, for scorers that read it (``"model"`` in their ``reads``).
        samples: a shared ``SampleSource`` for sampling scorers (built from ``model`` when
            not given); scorers sharing one draw K samples once per prompt.
        **params: constructor parameters of the scorer (over its preset's).

    Raises:
        ConfigError: ``kind`` needs the chat model and none was given.
    """
    spec = scorer_spec(kind)
    cls, kwargs = spec.cls, {**spec.params, **params}
    if "model" not in (spec.reads or ()):
        return cls(**kwargs)
    if model is None:
        raise ConfigError(
            f"Scorer {kind!r} reads the chat model ({spec.summary}); pass model=... "
            "(the GeometryChatModel that produced the responses)."
        )
    if spec.family == "sampling":
        return cls(model, samples=samples, **kwargs)  # type: ignore[call-arg]
    return cls(model, **kwargs)  # type: ignore[call-arg]


def scorer_from_state(state: ScorerState) -> Scorer:
    """Rebuild any registered scorer from its stored state."""
    return scorer_class(state.kind).from_state(state)
