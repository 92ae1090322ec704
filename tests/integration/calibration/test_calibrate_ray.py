"""``calibrate --executor ray``: a local Ray cluster (2 CPUs) with 2 replicas of the embedded
model calibrates 32 built-in probe questions and writes the artifact the local run writes
(scores, labels, threshold), also when one worker process is killed mid-run.

The replicas compute with the driver's torch thread count (1 and 2 threads give different
logprobs on this machine) and on its kernels (the session's cluster starts without the
driver's kernel settings: only ``pinned_kernel_env`` in the replicas' ``runtime_env`` gives
them; in ``make test-foreign`` a replica without it computes on other kernels), so every
answer is bitwise the local one.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from abstain_guard import GuardArtifact, GuardConfig
from abstain_guard.calibration.building.answering.executors import RayExecutor
from abstain_guard.calibration.building.answering.models import load_model
from abstain_guard.calibration.building.pipeline import calibrate
from abstain_guard.calibration.building.preflight import check_executor
from abstain_guard.calibration.building.questions.probe import builtin_probe_set
from abstain_guard.calibration.building.run.calibration_config import CalibrationConfig
from abstain_guard.cli.commands import build_parser
from abstain_guard.errors import ConfigError, DistributedChunkError

#: 32 questions split 12 / 8 / 8 / 4 (reference / train / calibration / test): both classes
#: in the geometry scorer's fitting splits, 5 chunks of at most 8, and 8 calibration scores
#: (participation 0.8 needs 4). Every answer costs a generation in each of the three runs.
ITEMS = builtin_probe_set()[:32]
RATIOS = (3, 2, 2, 1)
SETTINGS: dict[str, Any] = {"max_new_tokens": 16, "batch_size": 8}


def _config(tmp: Path, name: str, **extra: Any) -> CalibrationConfig:
    options = {"ratios": RATIOS, **SETTINGS, **extra}
    return CalibrationConfig(cache_dir=str(tmp / f"{name}.cache"), **options)


def _generations(cache: Path) -> dict[str, str]:
    """Every stored answer of a run (text, token ids, logprobs, entropies, geometry
    features), by cache key, as stored."""
    with sqlite3.connect(cache / "run.sqlite") as conn:
        return dict(conn.execute("SELECT key, value FROM kv WHERE ns = 'generation'"))


def _same_answers(a: Path, b: Path) -> None:
    """Bitwise the same stored answers (the scores alone could hide last-bit differences:
    the geometry scorer's trees are piecewise constant)."""
    left, right = _generations(a), _generations(b)
    assert left.keys() == right.keys() and len(left) == len(ITEMS)
    different = [k for k in left if left[k] != right[k]]
    assert not different, f"{len(different)} of {len(left)} stored answers differ"


def _same_artifact(a: Path, b: Path) -> None:
    left, right = GuardArtifact.load(a), GuardArtifact.load(b)
    np.testing.assert_array_equal(left.scores, right.scores)
    np.testing.assert_array_equal(left.correct, right.correct)
    assert left.metadata["calibration_ids"] == right.metadata["calibration_ids"]
    for cfg in (GuardConfig(participation=0.8), GuardConfig(participation=0.5)):
        assert left.decision_rule(cfg).threshold == right.decision_rule(cfg).threshold


LOCAL_CHUNKS: list[int] = []


@pytest.fixture(scope="module")
def local_model() -> Any:
    """The model a local run of ``SETTINGS`` loads: calibration's own ``load_model``, with
    the rows per decode step it gives every replica. Loaded here, not copied from the
    session's model: the decode path is probed up to those rows (on an Intel Xeon with MKL's
    branch left to the CPU rows stay independent at 8 but not at 16, so the session's model
    at 8 rows decodes on shared steps while the replicas decode each row alone), and a copy
    would share the session model's engine, whose path was chosen for 8 rows."""
    return load_model(CalibrationConfig(max_new_tokens=SETTINGS["max_new_tokens"]))


@pytest.fixture(scope="module")
def local_run(local_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same questions calibrated in this process."""
    tmp = tmp_path_factory.mktemp("local")
    calibrate(
        ITEMS,
        tmp / "guard",
        config=_config(tmp, "guard"),
        model=local_model,
        progress=False,
        on_generation_chunk=LOCAL_CHUNKS.append,
    )
    return tmp / "guard"


@pytest.fixture(scope="module")
def executor(ray_cluster: Any) -> Any:
    """2 replicas of the embedded model on the local cluster (one CPU each)."""
    ex = RayExecutor.start(CalibrationConfig(executor="ray", replicas=2, **SETTINGS))
    yield ex
    ex.shutdown()


@pytest.fixture(scope="module")
def ray_run(
    local_run: Path, executor: RayExecutor, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The same questions calibrated on the replicas, one worker process killed mid-chunk
    (one Ray run serves both tests below: a run that survives a kill must still be the local
    run, chunk by chunk and bit by bit)."""
    tmp = tmp_path_factory.mktemp("ray")
    chunks: list[int] = []
    killed: list[int] = []

    def kill_one(size: int) -> None:
        chunks.append(size)
        # the PIDs of the replicas working on a chunk now
        busy = [int(executor.infos[i]["pid"]) for i in sorted(executor._busy)]
        if not killed and busy:
            os.kill(busy[0], signal.SIGKILL)  # mid-chunk: it is generating one now
            killed.append(busy[0])

    calibrate(
        ITEMS,
        tmp / "guard",
        config=_config(tmp, "guard", executor="ray", replicas=2),
        executor=executor,
        progress=False,
        on_generation_chunk=kill_one,
    )
    return {"out": tmp / "guard", "cache": tmp / "guard.cache", "chunks": chunks, "killed": killed}


@pytest.mark.model
@pytest.mark.slow
def test_ray_run_writes_the_local_artifact(
    local_run: Path, executor: RayExecutor, ray_run: dict[str, Any]
) -> None:
    _same_artifact(local_run, ray_run["out"])
    _same_answers(local_run.parent / "guard.cache", ray_run["cache"])
    # the local run's chunks, each generated on a replica and stored here
    assert sorted(ray_run["chunks"]) == sorted(LOCAL_CHUNKS) and len(ray_run["chunks"]) > 2
    assert all(i["threads"] == executor.infos[0]["threads"] for i in executor.infos)


@pytest.mark.model
@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_artifact_is_the_same(
    local_run: Path, executor: RayExecutor, ray_run: dict[str, Any]
) -> None:
    killed = ray_run["killed"]
    assert killed
    pids = ray.get([a.info.remote() for a in executor.actors])
    assert killed[0] not in [p["pid"] for p in pids]  # Ray restarted that replica
    _same_artifact(local_run, ray_run["out"])
    _same_answers(local_run.parent / "guard.cache", ray_run["cache"])


def test_ray_settings_need_the_ray_executor() -> None:
    with pytest.raises(ConfigError, match="--replicas only apply to --executor ray"):
        check_executor(CalibrationConfig(replicas=2))
    check_executor(CalibrationConfig(executor="ray", replicas=2, gpus_per_replica=1))


def test_cli_executor_flags_reach_the_config() -> None:
    ray_flags = ["--executor", "ray", "--address", "auto", "--replicas", "4"]
    args = build_parser().parse_args(
        ["calibrate", "--data", "builtin", "--out", "x", *ray_flags, "--gpus-per-replica", "1"]
    )
    assert (args.executor, args.address, args.replicas, args.gpus_per_replica) == (
        "ray",
        "auto",
        4,
        1.0,
    )


def test_a_chunk_that_keeps_failing_is_reported_and_the_others_are_stored(
    ray_cluster: Any,
) -> None:
    class _PickyReplica:  # defined here: Ray ships it by value (tests/ is not importable there)
        """A replica stand-in without a model: answers every chunk but one holding "bad"."""

        def info(self) -> dict[str, Any]:
            return {"pid": os.getpid()}

        def generate(self, chunk: list[Any], *args: Any) -> list[str]:
            if any(it.id == "bad" for it in chunk):
                raise RuntimeError("this chunk always fails")
            return [it.id for it in chunk]

    # all a chunk's report reads of a question is its id: a stand-in shipped by value, so the
    # stand-in replicas' processes import no calibration code (~6 core-s each with QAItem)
    @dataclasses.dataclass(frozen=True)
    class _Question:
        id: str

    actors = [ray.remote(num_cpus=0)(_PickyReplica).remote() for _ in range(2)]
    ex = RayExecutor(ray=ray, actors=actors, infos=ray.get([a.info.remote() for a in actors]))
    items: list[Any] = [_Question(f"q{i}") for i in range(6)]
    items[3] = _Question("bad")
    todo = [(1, items[:2]), (2, items[2:4]), (3, items[4:])]
    stored: dict[int, list[str]] = {}
    with pytest.raises(DistributedChunkError) as caught:
        ex.generate(
            todo,
            capture="none",
            reference=None,
            on_done=lambda index, chunk, rows: stored.update({index: rows}),
        )
    assert stored == {1: ["q0", "q1"], 3: ["q4", "q5"]}  # the others went on and were stored
    message = str(caught.value)
    assert "chunk 2 (questions q2, bad)" in message and "this chunk always fails" in message
    assert "run the same command again" in message
    ex.shutdown()


def _agent_runs(cache: Path) -> dict[str, str]:
    with sqlite3.connect(cache / "run.sqlite") as conn:
        return dict(conn.execute("SELECT key, value FROM kv WHERE ns = 'agent_runs'"))


@pytest.mark.model
@pytest.mark.slow
def test_agent_runs_on_ray_replicas_are_the_local_ones(
    local_model: Any,
    executor: RayExecutor,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``calibrate --agent --executor ray``: the replicas build the agent from its factory
    and run the questions; every stored run (messages, tool calls, final answer's ids and
    logprobs) is bitwise the local run's, and so is the artifact."""
    monkeypatch.chdir(Path(__file__).resolve().parents[3])  # examples/ is importable
    items = builtin_probe_set(relations=("capital", "currency", "continent"))[:4]
    agent = {  # one question per split: 4 agent runs here and 4 on the replicas
        "agent": "examples.country_agent:build_forced_agent",
        "agent_step_limit": 6,
        "scorer": "perplexity",
        "ratios": (1, 1, 1, 1),
        "participation": 0.5,
    }
    local = _config(tmp_path, "local", **agent)
    model = local_model  # as loaded there
    calibrate(items, tmp_path / "local", config=local, model=model, progress=False)
    calibrate(
        items,
        tmp_path / "ray",
        config=_config(tmp_path, "ray", executor="ray", replicas=2, **agent),
        executor=executor,
        progress=False,
    )
    local, remote = _agent_runs(tmp_path / "local.cache"), _agent_runs(tmp_path / "ray.cache")
    assert local.keys() == remote.keys() and len(local) == len(items)
    assert [k for k in local if local[k] != remote[k]] == []
    left, right = GuardArtifact.load(tmp_path / "local"), GuardArtifact.load(tmp_path / "ray")
    np.testing.assert_array_equal(left.scores, right.scores)
