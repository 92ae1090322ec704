"""``calibrate --executor ray``: generation (with capture) and judging on Ray actors, one
model replica (:class:`_Replica`) each, each running the local run's
:func:`~.answers.generate_chunk`. What stays on the driver, what crosses the network, why the
artifact equals the local one and how failed chunks resume: docs/scale-out.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from abstain_guard.errors import ConfigError, DistributedChunkError

from ..judges.base import Judge, Judgment
from ..questions.datasets import QAItem
from ..run.calibration_config import CalibrationConfig
from .answer_rows import AnswerRow, Capture
from .answers import ChunkAnswer

logger = logging.getLogger("abstain_guard.calibration")

#: Answers judged per remote call.
JUDGE_CHUNK = 64
#: Questions per remote call of agent runs (each run is several model calls).
AGENT_CHUNK = 4


def import_ray() -> Any:
    """The ``ray`` module, or a ConfigError saying how to install the extra."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"--executor ray needs Ray ({exc}); install the extra with "
            "pip install 'abstain-guard[ray]', or use --executor local."
        ) from exc
    return ray


def local_threads() -> int:
    """torch's intra-op thread count in this process: what a local run computes with."""
    import torch

    return int(torch.get_num_threads())


def replica_env(threads: int) -> dict[str, str]:
    """The environment of a replica's process: the kernels this process computes on
    (:func:`abstain_guard.adapters.engine.kernel_env.pinned_kernel_env`, read by ATen and MKL before
    the replica computes, so its answers are bitwise the driver's on any processor) and its
    threads (:func:`replica_thread_env`)."""
    from abstain_guard.adapters.engine.kernel_env import pinned_kernel_env

    return {**pinned_kernel_env(), **replica_thread_env(threads)}


def replica_thread_env(threads: int) -> dict[str, str]:
    """The thread environment of a replica's process: it only sizes the replica's pools to its
    reservation (the engine sets the threads of decode steps itself; docs/scale-out.md, 'Same
    result'), and keeps this process's ``MKL_NUM_THREADS`` if set."""
    from abstain_guard.adapters.engine.threads import ENGINE_WORKERS_ENV

    env = {"OMP_NUM_THREADS": str(threads), ENGINE_WORKERS_ENV: str(threads)}
    if "MKL_NUM_THREADS" in os.environ:
        env["MKL_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"]
    return env


class _Replica:
    """One model replica (a Ray actor): generates chunks and judges answers."""

    def __init__(self, config: dict[str, Any], threads: int) -> None:
        import torch

        from .models import load_model

        torch.set_num_threads(threads)
        self.config = CalibrationConfig(**config)
        self.model = load_model(self.config)
        self.judges: dict[str, Judge] = {}

    def info(self) -> dict[str, Any]:
        """What the driver records about the model, and this worker's PID and threads."""
        import torch

        settings = getattr(self.model, "decoding_settings", None)
        return {
            "fingerprint": str(getattr(self.model, "fingerprint", "unknown")),
            "chat_template_sha256": getattr(self.model, "chat_template_sha256", None),
            "decoding": settings() if callable(settings) else {},
            "batch_decode": bool(getattr(self.model, "batch_decode", False)),
            "capture": getattr(self.model, "capture", None),
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
        }

    def generate(
        self,
        chunk: list[QAItem],
        capture: Capture,
        capture_mode: str | None,
        reference: Any,
        digest: str | None,
    ) -> list[ChunkAnswer]:
        """:func:`~.answers.generate_chunk` on this replica (in ``capture_mode``; with
        ``reference`` means installed for ``capture="geometry"``)."""
        from abstain_guard.scorers import with_capture

        from .answers import generate_chunk

        runner = with_capture(self.model, capture_mode)  # type: ignore[arg-type]
        if capture == "geometry":
            runner = runner.with_reference(reference)
        return generate_chunk(runner, chunk, self.config, capture, digest)

    def run_agents(
        self, chunk: list[QAItem], factory: str, scorer: Any, step_limit: int
    ) -> list[AnswerRow]:
        """The cached rows (:func:`~.agents.run_row`) of the agent ``factory`` builds around
        this replica's model — prepared by ``scorer`` when given, as the middleware
        prepares it — run on each question of ``chunk``."""
        from .agents import load_agent_factory, run_rows

        model = self.model if scorer is None else scorer.prepare(self.model)
        agent = load_agent_factory(factory)(model)
        rows = {
            it.id: row for it, row in run_rows(agent, chunk, step_limit, self.config.batch_size)
        }
        return [rows[it.id] for it in chunk]

    def replay_token_ids(
        self, pairs: list[tuple[list[int], list[int]]], batch_size: int, return_states: bool
    ) -> list[Any]:
        """:func:`~abstain_guard.adapters.engine.replay.replay_token_ids` on this replica."""
        from abstain_guard.adapters.engine.replay import replay_token_ids

        return replay_token_ids(
            self.model, pairs, batch_size=batch_size, return_states=return_states
        )

    def judge(self, spec: Any, identity: str, inputs: list[Any]) -> list[dict[str, Any]]:
        """Verdicts (``Judgment.to_json()``) of the judge ``spec`` on ``inputs``."""
        from ..judges.registry import make_judge

        key = repr(spec)
        if key not in self.judges:
            self.judges[key] = make_judge(spec)
        judge = self.judges[key]
        if judge.identity != identity:
            raise ConfigError(
                f"The judge built on a Ray worker is {judge.identity}, the driver's is "
                f"{identity}: install the same abstain_guard version on every node."
            )
        return [j.to_json() for j in judge.judge_many(inputs, progress=False)]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failure_cause(exc: BaseException) -> str:
    """One line saying why a remote call failed: the exception raised on the worker (Ray
    wraps it in a ``RayTaskError`` whose own text is a traceback header), else the Ray
    error itself (a dead actor, a lost worker)."""
    cause = getattr(exc, "cause", None)
    err = cause if isinstance(cause, BaseException) else exc
    lines = [ln.strip() for ln in _ANSI.sub("", str(err)).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0][:200] if lines else '(no message)'}"


@dataclass
class _Job:
    """One unit of remote work: its question ids (for the report), how to submit it to an
    actor, and what to do with its result."""

    label: str
    ids: list[str]
    submit: Callable[[Any], Any]
    done: Callable[[Any], None]


@dataclass
class RayExecutor:
    """Model replicas on a Ray cluster: create with :meth:`start`, pass as the ``executor`` of
    :func:`~..pipeline.calibrate`, :meth:`shutdown` when done (``calibrate`` does it for an
    executor it started)."""

    ray: Any
    actors: list[Any]
    infos: list[dict[str, Any]]
    capture_mode: str | None = None
    owns_ray: bool = False
    _busy: set[int] = field(default_factory=set)

    @classmethod
    def start(
        cls,
        config: CalibrationConfig,
        *,
        threads: int | None = None,
        max_restarts: int = 3,
        max_task_retries: int = 3,
    ) -> RayExecutor:
        """Connect to (or start) Ray and start ``config.replicas`` model replicas.

        Uses the running Ray session when there is one, else ``ray.init(address=
        config.ray_address)`` (None starts a local cluster; ``"auto"`` joins the one
        ``ray start`` runs here; ``ray://host:10001`` a remote one). Each replica reserves
        ``config.cpus_per_replica`` CPUs and ``config.gpus_per_replica`` GPUs and computes
        with ``threads`` torch threads (default: ``config.threads_per_replica``, else this
        process's count, as the local run would).
        """
        ray = import_ray()
        owns = False
        if not ray.is_initialized():
            ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False)
            owns = True
        n_threads = threads or config.threads_per_replica or local_threads()
        remote = ray.remote(
            num_cpus=config.cpus_per_replica,
            num_gpus=config.gpus_per_replica,
            max_restarts=max_restarts,
            max_task_retries=max_task_retries,
            runtime_env={"env_vars": replica_env(n_threads)},
        )(_Replica)
        payload = config.model_dump(mode="json")
        actors = [remote.remote(payload, n_threads) for _ in range(config.replicas)]
        try:
            infos = ray.get([a.info.remote() for a in actors])
        except Exception:
            for actor in actors:
                ray.kill(actor)
            if owns:
                ray.shutdown()
            raise
        fingerprints = {i["fingerprint"] for i in infos}
        if len(fingerprints) > 1:
            raise ConfigError(
                f"The Ray replicas loaded different models ({sorted(fingerprints)}): every "
                "node must hold the same model files."
            )
        return cls(ray=ray, actors=actors, infos=infos, owns_ray=owns)

    def with_capture_mode(self, capture_mode: str | None) -> RayExecutor:
        """The same replicas generating in ``capture_mode`` (``with_capture``; the held-out
        and train splits run in the scorer's mode, as the local run's ``held_model``)."""
        return dataclasses.replace(self, capture_mode=capture_mode)

    def driver_model(self, config: CalibrationConfig) -> _DriverModel:
        """A stand-in for the model on the driver (see :class:`_DriverModel`)."""
        return _DriverModel(dict(self.infos[0]), config)

    # --- work -----------------------------------------------------------------------

    def generate(
        self,
        todo: Sequence[tuple[int, list[QAItem]]],
        *,
        capture: Capture,
        reference: Any,
        on_done: Callable[[int, list[QAItem], list[ChunkAnswer]], None],
    ) -> None:
        """Generate each ``(index, chunk)`` on a replica; ``on_done`` stores it on the driver
        as it arrives.

        Raises:
            DistributedChunkError: some chunks failed after Ray's retries (the others are
                stored).
        """
        from .answer_rows import means_digest

        digest = means_digest(reference) if capture == "geometry" else None
        ref = self.ray.put(reference) if reference is not None else None
        mode = self.capture_mode
        jobs = []
        for index, chunk in todo:

            def submit(actor: Any, chunk: list[QAItem] = chunk) -> Any:
                return actor.generate.remote(chunk, capture, mode, ref, digest)

            def done(result: Any, index: int = index, chunk: list[QAItem] = chunk) -> None:
                on_done(index, chunk, result)

            jobs.append(_Job(f"chunk {index}", [it.id for it in chunk], submit, done))
        self._run(jobs)

    def run_agents(
        self,
        todo: Sequence[QAItem],
        *,
        factory: str,
        scorer: Any,
        step_limit: int,
        on_done: Callable[[QAItem, dict[str, Any]], None],
    ) -> None:
        """Run the agent on each question of ``todo`` on the replicas (chunks of
        :data:`AGENT_CHUNK`); ``on_done`` stores each row on the driver as its chunk arrives.

        Raises:
            DistributedChunkError: some chunks failed after Ray's retries (the others are
                stored).
        """
        ref = self.ray.put(scorer) if scorer is not None else None
        jobs = []
        for start in range(0, len(todo), AGENT_CHUNK):
            chunk = list(todo[start : start + AGENT_CHUNK])

            def submit(actor: Any, chunk: list[QAItem] = chunk) -> Any:
                return actor.run_agents.remote(chunk, factory, ref, step_limit)

            def done(result: Any, chunk: list[QAItem] = chunk) -> None:
                for it, row in zip(chunk, result, strict=True):
                    on_done(it, row)

            label = f"agent runs {start + 1}-{start + len(chunk)}"
            jobs.append(_Job(label, [it.id for it in chunk], submit, done))
        self._run(jobs)

    def replay_token_ids(
        self,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        *,
        batch_size: int = 16,
        return_states: bool = False,
    ) -> list[Any]:
        """Replay exact ``(prompt ids, response ids)`` pairs on the replicas, in order (the
        driver never loads the model)."""
        out: dict[int, list[Any]] = {}
        jobs = []
        for start in range(0, len(pairs), batch_size):
            part = [
                ([int(t) for t in p], [int(t) for t in r])
                for p, r in pairs[start : start + batch_size]
            ]

            def submit(actor: Any, part: list[Any] = part) -> Any:
                return actor.replay_token_ids.remote(part, batch_size, return_states)

            def done(result: Any, start: int = start) -> None:
                out[start] = list(result)

            jobs.append(_Job(f"replay {start + 1}-{start + len(part)}", [], submit, done))
        self._run(jobs)
        return [r for start in sorted(out) for r in out[start]]

    def judge(self, spec: Any, identity: str, inputs: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        """``(index, Judgment)`` for ``inputs``, judged on the replicas in chunks of
        :data:`JUDGE_CHUNK` (yielded after all are back)."""
        out: list[tuple[int, Any]] = []
        jobs = []
        for start in range(0, len(inputs), JUDGE_CHUNK):
            part = list(inputs[start : start + JUDGE_CHUNK])

            def submit(actor: Any, part: list[Any] = part) -> Any:
                return actor.judge.remote(spec, identity, part)

            def done(result: Any, start: int = start) -> None:
                out.extend((start + i, Judgment.from_json(j)) for i, j in enumerate(result))

            label = f"judging answers {start}-{start + len(part) - 1}"
            jobs.append(_Job(label, [str(p[0])[:60] for p in part], submit, done))
        self._run(jobs)
        yield from out

    def _run(self, jobs: list[_Job]) -> None:
        """Every job on the first free replica; failed jobs (after Ray's retries) are set
        aside while the rest go on, then reported together."""
        ray = self.ray
        pending = deque(jobs)
        free = list(range(len(self.actors)))
        flying: dict[Any, tuple[_Job, int]] = {}
        failed: list[tuple[_Job, str]] = []
        while pending or flying:
            while free and pending:
                slot = free.pop(0)
                job = pending.popleft()
                flying[job.submit(self.actors[slot])] = (job, slot)
                self._busy.add(slot)
            if not flying:  # no replica left alive
                failed.extend((job, "no replica left alive") for job in pending)
                break
            ready, _ = ray.wait(list(flying), num_returns=1)
            job, slot = flying.pop(ready[0])
            self._busy.discard(slot)
            try:
                result = ray.get(ready[0])
            except Exception as exc:  # RayActorError, RayTaskError, WorkerCrashedError
                logger.warning("%s failed on replica %d after retries: %s", job.label, slot, exc)
                failed.append((job, failure_cause(exc)))
                if self._alive(slot):
                    free.append(slot)
                continue
            job.done(result)
            free.append(slot)
        if failed:
            raise DistributedChunkError(
                [(job.label, job.ids, cause) for job, cause in failed],
            )

    def _alive(self, slot: int) -> bool:
        """Whether replica ``slot`` answers (restarted by Ray if its process died); its PID
        is refreshed."""
        try:
            self.infos[slot] = self.ray.get(self.actors[slot].info.remote(), timeout=900)
        except Exception as exc:
            logger.warning("replica %d is gone (%s); the others go on", slot, exc)
            return False
        return True

    def shutdown(self) -> None:
        """Stop the replicas (and the local Ray this executor started)."""
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(actor)
        self.actors = []
        if self.owns_ray:
            self.ray.shutdown()


class _DriverModel:
    """The model as the driver sees it under ``--executor ray``: the fingerprint, chat
    template, decoding settings and decode mode reported by a replica (what the artifact
    records), without loading the weights. Anything else (replaying answers cached without
    capture, as likelihood scorers need) loads the model here on first use."""

    def __init__(
        self, info: dict[str, Any], config: CalibrationConfig, update: dict[str, Any] | None = None
    ) -> None:
        self._info = info
        self._config = config
        self._update = update or {}
        self._model: Any = None
        self.fingerprint = info["fingerprint"]
        self.chat_template_sha256 = info["chat_template_sha256"]
        self.batch_decode = info["batch_decode"]
        self.capture = info["capture"]

    def decoding_settings(self) -> dict[str, Any]:
        """The decoding settings a replica reported."""
        return dict(self._info["decoding"])

    def model_copy(self, *, update: dict[str, Any]) -> _DriverModel:
        """A stand-in for ``model.model_copy(update=...)`` (``with_capture``), still unloaded."""
        info = {**self._info, **{k: v for k, v in update.items() if k == "capture"}}
        return _DriverModel(info, self._config, {**self._update, **update})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._model is None:
            from .models import load_model

            t = time.perf_counter()
            model = load_model(self._config)
            self._model = model.model_copy(update=self._update) if self._update else model
            logger.info(
                "loaded the model on the driver to replay answers (%.0fs)",
                time.perf_counter() - t,
            )
        return getattr(self._model, name)
