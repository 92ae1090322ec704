"""Import paths that moved keep working for one release: to :mod:`abstain_guard.scorers`
(issue 35) and into the concept subpackages (issue 49). The same objects, with a
``DeprecationWarning`` that names the new path; a package that took its old module's name
exports that module's names, without a warning; artifacts saved before the moves load, since
they store a scorer's ``kind``, not its module, and a chat model class recorded under an old
module is the same class."""

from __future__ import annotations

import importlib
import json
import re
import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel

import abstain_guard
from abstain_guard import scorers
from abstain_guard.deprecated_paths import MOVED_MODULES, REGROUPED, MovedModule, current_class_path
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
    from abstain_guard.contract.chat_model_specs import ChatModelSpec

    with pytest.warns(DeprecationWarning, match=r"abstain_guard\.contract\.chat_model_specs\.Chat"):
        from abstain_guard.chat_models import ChatModelSpec as Old
    assert Old is ChatModelSpec


# --- issue 49: the package grouped by concept ---------------------------------------------

_REGROUPED_OLD = sorted(f"{package}.{old}" for package, moved in REGROUPED.items() for old in moved)


def _public_names(module: str) -> set[str]:
    obj = importlib.import_module(module)
    names = getattr(obj, "__all__", None)
    if names is None:
        names = [n for n in vars(obj) if not n.startswith("_") and n != "annotations"]
    return set(names)


def test_every_module_of_the_three_folders_that_moved_is_listed() -> None:
    """92 modules moved: 85 left an old path behind (six gave their name to a package, and
    ``abstain_guard.conformal`` stays an alias); the two deprecated files of
    calibration/building (``config``, ``generation``) became entries too."""
    assert len(_REGROUPED_OLD) == 87
    assert {"abstain_guard.monitor_log", "abstain_guard.adapters.chat_model"} <= set(_REGROUPED_OLD)
    assert "abstain_guard.calibration.building.judges.text" in _REGROUPED_OLD


@pytest.mark.parametrize("old", _REGROUPED_OLD)
def test_every_regrouped_module_gives_the_same_objects_with_a_warning(old: str) -> None:
    moved = MOVED_MODULES[old]
    module = importlib.import_module(old)
    names = _public_names(moved.home) | set(moved.names)
    assert names, old
    for name in sorted(names):
        home = moved.module_of(name)
        with pytest.warns(DeprecationWarning, match=re.escape(f"{old}.{name} moved to {home}.")):
            value = getattr(module, name)
        assert value is getattr(importlib.import_module(home), name), f"{old}.{name}"


COLLIDED = {
    "abstain_guard.artifact": "abstain_guard.artifact.guard_artifact",
    "abstain_guard.monitor": "abstain_guard.monitor.guard_monitor",
    "abstain_guard.guard": "abstain_guard.guard.runnable",
    "abstain_guard.cli": "abstain_guard.cli.commands",
    "abstain_guard.adapters.capture": "abstain_guard.adapters.capture.session",
    "abstain_guard.adapters.tools": "abstain_guard.adapters.tools.calls",
}
"""Packages that took the name of the module they replaced → where that module's code is."""


@pytest.mark.parametrize("package", sorted(COLLIDED))
def test_a_package_that_took_a_modules_name_exports_its_names(package: str) -> None:
    names = _public_names(COLLIDED[package])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = importlib.import_module(package)
        assert set(new.__all__) == names
        for name in names:
            assert getattr(new, name) is getattr(importlib.import_module(COLLIDED[package]), name)
    assert package not in MOVED_MODULES


def test_conformal_is_one_module_under_both_paths() -> None:
    """``from abstain_guard import conformal`` is public API: ``import abstain_guard.conformal``
    gives that module, the guarantee's, without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        import abstain_guard.conformal as old
        from abstain_guard.guarantee import conformal

    assert old is conformal is abstain_guard.conformal
    assert "abstain_guard.conformal" not in MOVED_MODULES


def test_the_old_config_and_generation_modules_of_building_still_resolve() -> None:
    from abstain_guard.calibration.building.answering import answer_rows, answers
    from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig

    config = importlib.import_module("abstain_guard.calibration.building.config")
    with pytest.warns(DeprecationWarning, match=r"building\.run\.calibration_config"):
        assert config.CalibrationConfig is CalibrationConfig
    generation = importlib.import_module("abstain_guard.calibration.building.generation")
    with pytest.warns(DeprecationWarning, match=r"building\.answering\.answers"):
        assert generation.generate_answers is answers.generate_answers
    with pytest.warns(DeprecationWarning, match=r"building\.answering\.answer_rows"):
        assert generation.AnswerRow is answer_rows.AnswerRow


def test_a_class_path_under_an_old_module_is_the_moved_class() -> None:
    assert (
        current_class_path("abstain_guard.adapters.chat_model:GeometryChatModel")
        == "abstain_guard.adapters.chat.model:GeometryChatModel"
    )
    assert current_class_path("langchain_openai:ChatOpenAI") == "langchain_openai:ChatOpenAI"
    assert current_class_path("abstain_guard.drift:wilson_interval") == (
        "abstain_guard.guarantee.intervals:wilson_interval"
    )


class _MovedChatModel(BaseModel):
    """Stands for an API chat model class whose module moved after an artifact recorded it."""

    model_name: str = "m"


def test_a_recorded_chat_model_under_an_old_module_is_the_same_model(monkeypatch) -> None:
    from abstain_guard.contract.chat_model_specs import (
        ChatModelRecord,
        ChatModelSpec,
        identity_mismatches,
    )

    monkeypatch.setitem(MOVED_MODULES, "old_home_of.chat_models", MovedModule(__name__))
    old_path = "old_home_of.chat_models:_MovedChatModel"
    record = ChatModelRecord(spec=ChatModelSpec(class_path=old_path), class_path=old_path)
    assert identity_mismatches(record, _MovedChatModel()) == []
    (problem,) = identity_mismatches(record, _MovedChatModel(model_name="other"))
    assert "model_name" in problem


def test_recorded_format_names_did_not_move() -> None:
    """Names written into artifacts and monitor logs are formats, not import paths: a file
    written before the move is read after it."""
    from abstain_guard.artifact.files import FORMAT_NAME
    from abstain_guard.monitor.log import LOG_FORMAT

    assert FORMAT_NAME == "abstain_guard.artifact"
    assert LOG_FORMAT == "abstain_guard.monitor_log"
