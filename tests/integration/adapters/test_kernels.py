"""Kernel facts: what decides the last bits, how a difference is told, and the guard's
warning (once, not a refusal, with the calibration scores near the threshold)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from langchain_core.messages import AIMessage

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.adapters.engine.kernel_env import (
    FOREIGN_KERNEL_ENV,
    FOREIGN_KERNELS_ENV,
    NATIVE_KERNELS_ENV,
    PORTABLE_KERNEL_ENV,
    is_x86_64,
    pinned_kernel_env,
    requested_kernel_env,
)
from abstain_guard.adapters.engine.kernels import kernel_facts, mkl_branch
from abstain_guard.artifact.calibration_set import CalibrationSet
from abstain_guard.calibration.measure.deployment_check import kernel_summary
from abstain_guard.contract.deployment import DeploymentRecord, PromptRecord, sha256_text
from abstain_guard.contract.kernels import (
    STATED_TOLERANCE,
    bit_deciding,
    kernel_differences,
    kernel_note,
    near_threshold,
)
from abstain_guard.errors import KernelMismatchWarning
from abstain_guard.guard.policy import AbstentionPolicy
from abstain_guard.scorers import PerplexityScorer

HERE = {
    "torch": "2.13.0+cpu",
    "device_type": "cpu",
    "device_name": None,
    "cpu": {"vendor": "AuthenticAMD", "model": "AMD EPYC", "isa": ["avx2", "fma"]},
    "aten_capability": "AVX2",
    "blas": "mkl 2024.2",
    "mkl_branch": "AUTO",
    "onednn": {"version": "3.12.0", "enabled": True},
    "env": {"ATEN_CPU_CAPABILITY": "avx2"},
}


def _with(**changes: object) -> dict[str, object]:
    return {**HERE, **changes}


def test_the_process_records_the_kernels_it_runs() -> None:
    """The facts are read back from ATen and MKL, and on x86-64 the library asked for the
    portable settings before torch computed (conftest imports nothing that computes)."""
    facts = kernel_facts("cpu")
    assert facts["aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["torch"] == torch.__version__
    assert facts["mkl_branch"] == mkl_branch()
    if is_x86_64():
        for key in requested_kernel_env():
            assert key in facts["env"], key
        if facts["env"]["ATEN_CPU_CAPABILITY"] == "avx2" and "avx2" in facts["cpu"]["isa"]:
            assert facts["aten_capability"] == "AVX2"
        if facts["env"]["ATEN_CPU_CAPABILITY"] == "default":
            assert facts["aten_capability"] == "DEFAULT"


@pytest.mark.skipif(not is_x86_64(), reason="the kernel settings are x86-64 ones")
def test_the_mode_variables_choose_what_the_library_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Portable by default, nothing with the native flag, another processor's kernels with
    the foreign flag (which wins: it is the mode the suite runs in to see a foreign machine)."""
    monkeypatch.delenv(FOREIGN_KERNELS_ENV, raising=False)
    monkeypatch.delenv(NATIVE_KERNELS_ENV, raising=False)
    assert requested_kernel_env() == PORTABLE_KERNEL_ENV
    monkeypatch.setenv(NATIVE_KERNELS_ENV, "1")
    assert requested_kernel_env() == {}
    monkeypatch.setenv(FOREIGN_KERNELS_ENV, "1")
    assert requested_kernel_env() == FOREIGN_KERNEL_ENV
    assert FOREIGN_KERNEL_ENV["ATEN_CPU_CAPABILITY"] != PORTABLE_KERNEL_ENV["ATEN_CPU_CAPABILITY"]


def test_a_started_process_gets_the_kernels_this_one_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What Ray replicas, Ray Serve replicas and the monitor actor are started with: the
    kernel variables as set here and the library's mode flags, so a child computes on the
    kernels its parent records."""
    from abstain_guard.calibration.building.answering.executors import replica_env

    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.setenv(FOREIGN_KERNELS_ENV, "1")
    env = pinned_kernel_env()
    assert env["MKL_CBWR"] == "COMPATIBLE" and env[FOREIGN_KERNELS_ENV] == "1"
    assert env["ATEN_CPU_CAPABILITY"] == os.environ["ATEN_CPU_CAPABILITY"]
    replica = replica_env(2)
    assert {k: replica[k] for k in env} == env and replica["OMP_NUM_THREADS"] == "2"


def test_a_child_started_with_the_pinned_environment_computes_on_the_recorded_kernels() -> None:
    """A child process that gets ``pinned_kernel_env`` reads back the parent's ATen
    capability and MKL branch, in the normal and in the foreign-kernel mode (a child
    started with other settings computes on other kernels:
    ``test_a_setting_the_user_exported_wins_and_is_recorded``)."""
    code = (
        "from abstain_guard.adapters.engine.kernels import kernel_facts;"
        "import torch; torch.ones(3).exp().sum();"
        "f = kernel_facts('cpu'); print(f['aten_capability'], f['mkl_branch'])"
    )
    here = kernel_facts("cpu")
    base = {k: v for k, v in os.environ.items() if k not in pinned_kernel_env()}

    def child(extra: dict[str, str]) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**base, **extra},
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.split()

    assert child(pinned_kernel_env()) == [here["aten_capability"], here["mkl_branch"]]


def test_bit_deciding_facts_name_the_cpu_only_where_mkl_lets_it_decide() -> None:
    assert bit_deciding(HERE)["cpu"] == {
        "vendor": "AuthenticAMD",
        "model": "AMD EPYC",
        "isa": ["avx2", "fma"],
    }
    # the same CPU model string with AVX-512 is another CPU for MKL's dispatch
    avx512 = _with(cpu={**HERE["cpu"], "isa": ["avx2", "fma", "avx512f"]})  # type: ignore[dict-item]
    assert kernel_differences(avx512, HERE)[0].startswith("cpu:")
    fixed = bit_deciding(_with(mkl_branch="AVX2"))
    assert "cpu" not in fixed and fixed["mkl_branch"] == "AVX2"
    gpu = bit_deciding(_with(device_type="cuda", device_name="NVIDIA H100"))
    assert gpu["device_name"] == "NVIDIA H100" and "cpu" not in gpu
    assert bit_deciding(None) == {}


def test_kernel_differences() -> None:
    assert kernel_differences(HERE, HERE) == []
    # the onednn version and the environment do not decide the bits by themselves
    assert kernel_differences(_with(env={}, onednn={"version": "9"}), HERE) == []
    (diff,) = kernel_differences(_with(aten_capability="AVX512"), HERE)
    assert diff == "aten_capability: 'AVX512' here vs 'AVX2' at calibration"
    other_cpu = _with(cpu={"vendor": "GenuineIntel", "model": "Xeon", "isa": []})
    assert kernel_differences(other_cpu, HERE)[0].startswith("cpu:")
    # an artifact written before kernels were recorded: nothing to compare
    assert kernel_differences(HERE, None) == []
    assert kernel_differences(None, HERE) == [
        "the response records no kernel facts (generation['kernels'])"
    ]


def test_near_threshold_counts_the_decisions_a_move_could_flip() -> None:
    scores = np.array([0.1, 0.5 - 2e-5, 0.5, 0.5 + 5e-5, 0.9])
    assert near_threshold(scores, 0.5, 1e-4) == 3
    assert near_threshold(scores, 0.5, 1e-5) == 1
    assert near_threshold(scores, float("inf"), 1.0) == 0


SYSTEM = "Answer."


def _policy(on_mismatch: str = "raise") -> AbstentionPolicy:
    rng = np.random.default_rng(0)
    scores = rng.uniform(1.0, 3.0, size=200)
    record = DeploymentRecord(
        model_fingerprint="m-1",
        chat_template_sha256="t-1",
        decoding={"temperature": 0.0, "kernels": HERE},
        prompts={"open": PromptRecord(system_prompt=SYSTEM, max_new_tokens=24)},
    )
    artifact = GuardArtifact.from_calibration(
        scorer=PerplexityScorer(),
        calibration=CalibrationSet(scores, rng.uniform(size=200) > (scores - 1) / 2),
        model_fingerprint="m-1",
        metadata={"deployment": record.to_json()},
    )
    return AbstentionPolicy(artifact, GuardConfig(on_mismatch=on_mismatch))


def _message(kernels: dict[str, object]) -> AIMessage:
    generation = {
        "max_new_tokens": 24,
        "temperature": 0.0,
        "system_prompt_sha256": sha256_text(SYSTEM),
        "chat_template_sha256": "t-1",
        "kernels": kernels,
    }
    lp = {"content": [{"token": "Paris", "logprob": -0.1, "top_logprobs": []}]}
    return AIMessage("Paris", response_metadata={"generation": generation, "logprobs": lp})


def test_guard_on_other_kernels_warns_once_and_notes_every_decision() -> None:
    policy = _policy(on_mismatch="raise")  # kernels are a tolerance, never a refusal
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decisions = [policy.decide(_message(_with(aten_capability="DEFAULT")))[1] for _ in range(3)]
    kernel_warnings = [w for w in caught if issubclass(w.category, KernelMismatchWarning)]
    assert len(kernel_warnings) == 1
    note = str(kernel_warnings[0].message)
    expected = kernel_note(
        ["aten_capability: 'DEFAULT' here vs 'AVX2' at calibration"],
        policy.artifact.scores,
        policy.rule.threshold,
    )
    assert note == expected
    near = near_threshold(policy.artifact.scores, policy.rule.threshold, STATED_TOLERANCE)
    assert f"{near} of 200 calibration scores" in note
    for d in decisions:
        assert d.guarantee.warnings == (f"{note}",)


def test_guard_on_the_calibrated_kernels_says_nothing() -> None:
    policy = _policy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelMismatchWarning)
        _, decision = policy.decide(_message(HERE))
    assert not decision.guarantee.warnings


def test_live_check_kernel_summary() -> None:
    rows = [
        {"live_score": 0.5, "stored_score": 0.5 + 3e-6},
        {"live_score": 0.2, "stored_score": 0.2},
        {"live_score": None, "stored_score": 0.3},
    ]
    scores = np.array([0.1, 0.5 - 1e-6, 0.5 + 2.9e-6, 0.7])
    summary = kernel_summary(HERE, _with(aten_capability="DEFAULT"), rows, scores, 0.5)
    assert summary["same"] is False and len(summary["differences"]) == 1
    assert summary["abs_score_diff_max"] == pytest.approx(3e-6)
    assert summary["calibration_scores_near_threshold"] == 2
    assert kernel_summary(HERE, HERE, rows, scores, 0.5)["same"] is True


def test_a_setting_the_user_exported_wins_and_is_recorded() -> None:
    """The library only fills in unset variables: a user who forces other kernels gets them,
    and the record (read back from ATen, not from the setting) says which ran."""
    code = (
        "from abstain_guard.adapters.engine.kernels import kernel_facts;"
        "import torch; torch.ones(3).exp().sum();"
        "f = kernel_facts('cpu'); print(f['aten_capability'], f['env']['ATEN_CPU_CAPABILITY'])"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["DEFAULT", "default"]
