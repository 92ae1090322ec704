"""Import paths that moved to :mod:`abstain_guard.scorers` (issue 35) keep working for one
release: the same objects, with a ``DeprecationWarning`` that names the new path; and
artifacts saved before the move load, since they store a scorer's ``kind``, not its module."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

import abstain_guard
from abstain_guard import scorers
from abstain_guard.deprecated_paths import MOVED_MODULES
from abstain_guard.scorers import scorer_names, scorer_spec


def test_the_old_registry_path_gives_the_same_functions_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"abstain_guard\.scorers\.build_scorer"):
        from abstain_guard.scoring import build_scorer
    with pytest.warns(DeprecationWarning, match=r"abstain_guard\.scorers\.Scorer"):
        from abstain_guard.scoring import Scorer
    assert build_scorer is scorers.build_scorer
    assert Scorer is scorers.Scorer


def test_the_old_likelihood_path_gives_the_same_classes_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"abstain_guard\.scorers\.PerplexityScorer"):
        from abstain_guard.likelihood import PerplexityScorer, token_logprobs
    assert PerplexityScorer is scorers.PerplexityScorer
    assert token_logprobs is scorers.token_logprobs


def test_the_old_inference_modules_resolve_into_scorers() -> None:
    from abstain_guard.scorers.geometry import GeometryScorer
    from abstain_guard.scorers.sar import SARScorer, sar

    old = importlib.import_module("abstain_guard.calibration.inference.geometry")
    with pytest.warns(DeprecationWarning, match=r"abstain_guard\.scorers\.geometry\.Geo"):
        assert old.GeometryScorer is GeometryScorer
    with pytest.warns(DeprecationWarning):
        from abstain_guard.calibration.inference.sampling import SampleSource
        from abstain_guard.calibration.inference.sampling import SARScorer as Old
        from abstain_guard.calibration.inference.sampling import sar as old_sar
    assert Old is SARScorer and old_sar is sar and SampleSource is scorers.SampleSource
    with pytest.warns(DeprecationWarning):
        from abstain_guard.calibration.inference import CalibratedScorer
        from abstain_guard.calibration.inference import sar as package_sar
    assert package_sar is sar, "a function, not the module abstain_guard.scorers.sar"
    assert CalibratedScorer is scorers.CalibratedScorer
    with pytest.warns(DeprecationWarning, match=r"to abstain_guard\.scorers\.TokenBlock"):
        from abstain_guard.calibration.inference.features import TokenBlock
    assert TokenBlock is scorers.TokenBlock


def test_the_old_calibration_attribute_warns() -> None:
    with pytest.warns(DeprecationWarning, match=r"abstain_guard\.scorers\.geometry"):
        from abstain_guard.calibration import GeometryScorer
    assert GeometryScorer is scorers.GeometryScorer


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_every_old_module_imports_and_points_at_an_existing_module(old: str) -> None:
    module = importlib.import_module(old)
    moved = MOVED_MODULES[old]
    for home in {moved.home, *moved.names.values()}:
        importlib.import_module(home)
    for name, home in moved.names.items():
        assert hasattr(importlib.import_module(home), name), f"{old}.{name} -> {home}"
    with pytest.raises(AttributeError):
        module.__wrapped__  # noqa: B018 - dunder names are not forwarded


def test_unknown_names_of_an_old_module_still_raise() -> None:
    old = importlib.import_module("abstain_guard.scoring")
    with pytest.warns(DeprecationWarning), pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018


def test_the_new_paths_do_not_warn(recwarn: pytest.WarningsRecorder) -> None:
    from abstain_guard.scorers import GeometryScorer, build_scorer  # noqa: F401

    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_every_registered_kind_points_into_scorers() -> None:
    for kind in scorer_names():
        target = scorer_spec(kind).target
        module = target if isinstance(target, str) else target.__module__
        if scorer_spec(kind).family != "custom":
            assert module.startswith("abstain_guard.scorers."), (kind, module)


def test_the_shipped_artifact_still_loads_by_its_kind() -> None:
    """The default guard was saved before the move; its scorer state names a kind."""
    folder = Path(abstain_guard.__file__).parent / "default_guard"
    kind = json.loads((folder / "scorer.json").read_text())["kind"]
    artifact = abstain_guard.GuardArtifact.load(folder)
    assert artifact.scorer.kind == kind
    target = scorer_spec(kind).target
    module = target.split(":")[0] if isinstance(target, str) else target.__module__
    assert type(artifact.scorer).__module__ == module  # the registry's home of that kind
    assert module.startswith("abstain_guard.scorers.")


def test_the_old_chat_model_spec_path_warns() -> None:
    from abstain_guard.chat_model_specs import ChatModelSpec

    with pytest.warns(DeprecationWarning, match=r"abstain_guard\.chat_model_specs\.ChatModel"):
        from abstain_guard.chat_models import ChatModelSpec as Old
    assert Old is ChatModelSpec
