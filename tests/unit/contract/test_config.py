"""GuardConfig: defaults, validation, files (YAML / TOML / JSON) and environment variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from abstain_guard import GuardConfig
from abstain_guard.errors import ConfigError


def test_defaults() -> None:
    cfg = GuardConfig()
    assert cfg.mode == "participation" and cfg.participation == 0.8
    assert cfg.alpha == pytest.approx(0.2) and cfg.target == 0.8
    assert cfg.delta == 0.1 and cfg.risk_target is None
    assert cfg.abstain_message == "I don't know." and cfg.on_error == "abstain"
    assert cfg.scorer is None


def test_risk_mode_needs_a_target() -> None:
    with pytest.raises(ConfigError, match="risk_target"):
        GuardConfig(mode="risk")
    cfg = GuardConfig(mode="risk", risk_target=0.2, delta=0.05)
    assert cfg.target == 0.2


def test_unknown_key_names_it_and_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        GuardConfig(participaton=0.9)  # type: ignore[call-arg]
    msg = str(info.value)
    assert "participaton" in msg and "participation" in msg and "risk_target" in msg


@pytest.mark.parametrize(
    "kwargs",
    [
        {"participation": 1.0},
        {"participation": 0.0},
        {"delta": 1.5},
        {"risk_target": -0.1},
        {"mode": "strict"},
        {"on_error": "ignore"},
    ],
)
def test_invalid_values(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        GuardConfig(**kwargs)


def test_config_is_frozen_and_overridable() -> None:
    cfg = GuardConfig(participation=0.7)
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        cfg.participation = 0.5  # type: ignore[misc]
    other = cfg.with_overrides(mode="risk", risk_target=0.1)
    assert other.participation == 0.7 and other.mode == "risk"


def test_from_files(tmp_path: Path) -> None:
    (tmp_path / "g.yaml").write_text("mode: risk\nrisk_target: 0.15\nabstain_message: Not sure.\n")
    (tmp_path / "g.toml").write_text('[guard]\nmode = "risk"\nrisk_target = 0.15\n')
    (tmp_path / "g.json").write_text('{"participation": 0.9, "on_error": "raise"}')
    y = GuardConfig.from_file(tmp_path / "g.yaml")
    assert (y.mode, y.risk_target, y.abstain_message) == ("risk", 0.15, "Not sure.")
    t = GuardConfig.from_file(tmp_path / "g.toml")
    assert (t.mode, t.risk_target) == ("risk", 0.15)
    j = GuardConfig.from_file(tmp_path / "g.json")
    assert (j.participation, j.on_error) == (0.9, "raise")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        GuardConfig.from_file(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("mode: [unclosed\n")
    with pytest.raises(ConfigError, match="parse"):
        GuardConfig.from_file(tmp_path / "bad.yaml")
    (tmp_path / "x.ini").write_text("a=1")
    with pytest.raises(ConfigError, match="Unsupported"):
        GuardConfig.from_file(tmp_path / "x.ini")
    (tmp_path / "extra.json").write_text('{"particpation": 0.9}')
    with pytest.raises(ConfigError, match="particpation"):
        GuardConfig.from_file(tmp_path / "extra.json")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        GuardConfig.from_file(tmp_path / "list.yaml")


def test_from_env() -> None:
    env = {
        "ABSTAIN_GUARD_MODE": "risk",
        "ABSTAIN_GUARD_RISK_TARGET": "0.25",
        "ABSTAIN_GUARD_DELTA": "0.05",
        "ABSTAIN_GUARD_ON_ERROR": "raise",
        "UNRELATED": "1",
    }
    cfg = GuardConfig.from_env(env)
    assert (cfg.mode, cfg.risk_target, cfg.delta, cfg.on_error) == ("risk", 0.25, 0.05, "raise")
    assert GuardConfig.from_env({}) == GuardConfig()


def test_from_env_unknown_variable() -> None:
    with pytest.raises(ConfigError) as info:
        GuardConfig.from_env({"ABSTAIN_GUARD_PARTICIPATON": "0.9"})
    assert "ABSTAIN_GUARD_PARTICIPATON" in str(info.value)
    assert "ABSTAIN_GUARD_PARTICIPATION" in str(info.value)
    # variables owned by other components can be ignored explicitly
    cfg = GuardConfig.from_env({"ABSTAIN_GUARD_ARTIFACT": "x"}, ignore=("ABSTAIN_GUARD_ARTIFACT",))
    assert cfg == GuardConfig()


def test_the_process_variables_of_the_library_are_not_config_fields() -> None:
    """Engines and CPU kernels are set up by ``ABSTAIN_GUARD_*`` variables the library itself
    reads: a deployment that sets them must still read its config from the environment."""
    from abstain_guard.adapters.engine.kernel_env import NATIVE_KERNELS_ENV
    from abstain_guard.adapters.engine.threads import ENGINE_WORKERS_ENV

    env = {ENGINE_WORKERS_ENV: "2", NATIVE_KERNELS_ENV: "1", "ABSTAIN_GUARD_PARTICIPATION": "0.9"}
    assert GuardConfig.from_env(env).participation == 0.9


def test_env_overrides_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "g.yaml").write_text("participation: 0.7\nabstain_message: Pass.\n")
    monkeypatch.setenv("ABSTAIN_GUARD_PARTICIPATION", "0.95")
    cfg = GuardConfig.load(tmp_path / "g.yaml")
    assert cfg.participation == 0.95 and cfg.abstain_message == "Pass."
