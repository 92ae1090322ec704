"""``abstain-guard serve --replicas N``: model replicas on Ray Serve behind one endpoint, with
one drift monitor for the deployment.

Each replica loads the guard as the single server does and serves the same app
(:func:`~abstain_guard.serve.app.create_app`); the decisions, feedback and metrics of every
replica go to one monitor actor
(:class:`~abstain_guard.serve.monitor_actor.DeploymentMonitor`), started on this node before
the replicas. Ray is imported lazily (the ``ray`` extra). docs/serving.md, "Replicas on Ray
Serve".
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from types import FrameType
from typing import Any

from abstain_guard.errors import ConfigError
from abstain_guard.serve.admission import DEFAULT_MAX_IN_FLIGHT
from abstain_guard.serve.app import create_app
from abstain_guard.serve.monitor_actor import (
    MONITOR_TIMEOUT_S,
    ActorStepRecord,
    DeploymentMonitor,
    RayMonitorLink,
)
from abstain_guard.serve.runner import Endpoint
from abstain_guard.serve.service import GuardService
from abstain_guard.serve.step_record import StepLimits
from abstain_guard.serve.telemetry import configure_logging

#: The Ray namespace of the monitor actor.
NAMESPACE = "abstain_guard"


def import_ray_serve() -> tuple[Any, Any]:
    """``(ray, ray.serve)``, or a ConfigError saying which extra to install."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ConfigError(
            f"serve --replicas / --ray-address need Ray Serve ({exc}); install it with "
            "pip install 'abstain-guard[serve,ray]'."
        ) from exc
    return ray, serve


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds (plain values: it travels to the replicas).

    Attributes:
        artifact: the artifact directory (the same path on every node).
        config: the guard config, ``GuardConfig.model_dump(mode="json")``.
        kind, model_name, max_in_flight: as ``serve``'s options.
        steps: the step record's limits (the step record is the monitor actor's, shared by
            the replicas).
        api_key: the key ``/v1/*`` requests must send (None: none).
        loopback: whether the endpoint listens on loopback only.
        monitor: the monitor actor's name (in :data:`NAMESPACE`; set by
            :meth:`ReplicaServer.start`).
        monitor_timeout_s: how long a replica waits for the monitor actor before it
            answers 503 with ``Retry-After``.
        engine_url: the vLLM engine every replica of a vLLM-calibrated guard generates on
            (one engine, started by the driver: :func:`shared_vllm_engine`; None: the
            project's engine, one per replica).
        log_level: the level each replica logs at, as JSON lines on its stderr (what
            ``serve --log-level`` sets in the driver; None: Ray's logging left as it is).
    """

    artifact: str
    config: dict[str, Any]
    monitor: str = ""
    kind: str | None = None
    model_name: str = "abstain-guard"
    max_in_flight: int | None = None
    steps: StepLimits = field(default_factory=StepLimits)
    api_key: str | None = None
    loopback: bool = True
    engine_url: str | None = None
    monitor_timeout_s: float = MONITOR_TIMEOUT_S
    log_level: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicaSpec:
        """The spec from its :func:`~dataclasses.asdict` form (what travels to the replicas)."""
        return cls(**{**data, "steps": StepLimits(**data["steps"])})


@dataclass(frozen=True)
class Deployment:
    """How the replicas are deployed.

    Attributes:
        replicas: the number of replicas.
        host, port: where Ray Serve's HTTP proxy listens (on every node).
        cpus_per_replica: CPUs each replica reserves (and its threads).
        ray_address: the cluster ``ray.init`` joins when no Ray session runs (None: a local
            one).
        app_name: the Ray Serve application (and monitor actor) name.
    """

    replicas: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    cpus_per_replica: float = 1.0
    ray_address: str | None = None
    app_name: str = "abstain-guard"


def build_replica(
    spec: ReplicaSpec, actor: Any, replica: str, handle: Any, *, model: Any = None
) -> tuple[GuardService, RayMonitorLink]:
    """A replica's guard service and its link to the monitor ``actor``: decisions, feedback,
    metrics and the agent runs' step records all go to the actor (``model``: an already
    loaded chat model instead of the artifact's; tests)."""
    from abstain_guard.config import GuardConfig

    if spec.log_level is not None:
        configure_logging(spec.log_level)
    link = RayMonitorLink(actor, replica, handle, 1, timeout_s=spec.monitor_timeout_s)
    steps = ActorStepRecord(link, spec.steps)
    if model is None and spec.engine_url is not None:
        model = vllm_model_of(spec.artifact, spec.engine_url)
    service = GuardService.from_artifact(
        spec.artifact,
        GuardConfig.model_validate(spec.config),
        model=model,
        kind=spec.kind,
        model_name=spec.model_name,
        max_in_flight=spec.max_in_flight,
        step_record=steps,
    )
    link.batch = int(getattr(service.chat_model, "max_batch_size", 1))
    return service, link


def vllm_model_of(artifact: str, engine_url: str | None = None) -> Any:
    """The vLLM backend's chat model an artifact calibrated on vLLM records (None for any
    other artifact), attached to ``engine_url`` when given (a transport option: the model's
    identity, so the guard's check, is the recorded one)."""
    from abstain_guard.artifact.guard_artifact import GuardArtifact
    from abstain_guard.backends import VLLM_CHAT_MODEL
    from abstain_guard.contract.chat_model_specs import ChatModelSpec
    from abstain_guard.contract.deployment import DeploymentRecord

    record = DeploymentRecord.from_metadata(GuardArtifact.load(artifact).metadata)
    api = record.chat_model if record is not None else None
    if api is None or api.spec.class_path != VLLM_CHAT_MODEL:
        return None
    kwargs = dict(api.spec.kwargs)
    if engine_url is not None:
        kwargs["engine_url"] = engine_url
    return ChatModelSpec(class_path=VLLM_CHAT_MODEL, kwargs=kwargs).build()


def shared_vllm_engine(artifact: str) -> str | None:
    """Start (in this process, stopped at its exit) the one vLLM engine the replicas of a
    vLLM-calibrated guard share, and return its URL; None for other artifacts. Ray Serve
    routes requests to replicas; vLLM batches what they send to the one engine."""
    model = vllm_model_of(artifact)
    if model is None:
        return None
    url, _ = model.engine()
    return str(url)


class GuardReplica:
    """One replica of the deployment: the guard and the app, its decisions sent to the
    monitor actor (wrapped with ``serve.ingress()`` by :func:`replica_deployment`)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        import ray  # the replica runs on Ray

        self.spec = ReplicaSpec.from_dict(spec)
        context = ray.get_runtime_context()
        self.service, self.link = build_replica(
            self.spec,
            ray.get_actor(self.spec.monitor, namespace=NAMESPACE),
            str(context.get_actor_id()),
            context.current_actor,
        )

    async def __serve_build_asgi_app__(self) -> Any:
        await self.link.register()
        return create_app(
            self.service,
            api_key=self.spec.api_key,
            loopback=self.spec.loopback,
            link=self.link,
        )


def replica_deployment(spec: ReplicaSpec, replicas: int, cpus_per_replica: float) -> Any:
    """The bound Ray Serve application: ``replicas`` replicas of :class:`GuardReplica`, each
    reserving ``cpus_per_replica`` CPUs and computing with that many threads."""
    from abstain_guard.adapters.engine.threads import ENGINE_WORKERS_ENV  # torch: heavy

    _, serve = import_ray_serve()
    threads = str(max(1, int(cpus_per_replica)))
    # the kernels this process records, before the replica imports torch (ATen and MKL read
    # them once): a replica computes as the driver does on any processor
    env = {**_kernel_env(), "OMP_NUM_THREADS": threads, ENGINE_WORKERS_ENV: threads}
    batch_and_queue = spec.max_in_flight or DEFAULT_MAX_IN_FLIGHT
    deployment = serve.deployment(
        serve.ingress()(GuardReplica),
        name="abstain-guard",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica, "runtime_env": {"env_vars": env}},
        # the replica's own admission answers 429 beyond max_in_flight: let requests reach it
        max_ongoing_requests=batch_and_queue + 8,
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=60.0,
    )
    return deployment.bind(asdict(spec))


def start_monitor(
    ray: Any,
    name: str,
    spec: ReplicaSpec,
    log_path: str | None,
    monitor_options: Mapping[str, Any] | None = None,
) -> Any:
    """Start the deployment's monitor actor ``name`` on this node (a detached, named actor
    that Ray restarts; one left by an earlier run under that name is replaced), fitted on
    ``spec``'s artifact and config, its step record with ``spec``'s limits."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    _kill_named(ray, name)
    node = ray.get_runtime_context().get_node_id()
    actor = (
        ray.remote(DeploymentMonitor)
        .options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=-1,
            max_task_retries=-1,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            # the driver's kernel settings (it computes no forward; were it to load
            # the model, it would do so on the recorded kernels)
            runtime_env={"env_vars": _kernel_env()},
        )
        .remote(
            os.path.abspath(spec.artifact),
            dict(spec.config),
            log_path=None if log_path is None else os.path.abspath(log_path),
            monitor_options=dict(monitor_options or {}),
            steps=spec.steps,
        )
    )
    ray.get(actor.state.remote())  # fitted (or the log refused: raised here)
    return actor


def _kernel_env() -> dict[str, str]:
    """:func:`abstain_guard.adapters.engine.kernel_env.pinned_kernel_env` (imported here: it loads
    torch, which the serving core does not need at import time)."""
    from abstain_guard.adapters.engine.kernel_env import pinned_kernel_env

    return pinned_kernel_env()


def _kill_named(ray: Any, name: str, timeout_s: float = 30.0) -> None:
    """Kill the actor ``name`` if there is one, and wait until its name is free."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            old = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        ray.kill(old, no_restart=True)
        time.sleep(0.2)
    raise ConfigError(f"The actor {name!r} of an earlier deployment did not stop in time.")


class ReplicaServer(Endpoint):
    """The replicas of the guard on Ray Serve with one monitor actor::

        with ReplicaServer(spec, Deployment(replicas=2, port=8000)) as server:
            OpenAI(base_url=server.base_url, api_key="none")...

    Uses the running Ray session, else ``ray.init(address=deployment.ray_address)``.
    :meth:`stop` deletes the application and the monitor actor (and shuts down a cluster it
    started).

    Args:
        spec: what each replica builds.
        deployment: how many replicas, where they listen, what each reserves.
        log_path: the monitor log (``--monitor-log``).
        monitor_options: other :class:`~abstain_guard.monitor.guard_monitor.GuardMonitor`
            settings of the monitor actor.
    """

    def __init__(
        self,
        spec: ReplicaSpec,
        deployment: Deployment | None = None,
        *,
        log_path: str | None = None,
        monitor_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.deployment = deployment or Deployment()
        self.host, self.port = self.deployment.host, self.deployment.port
        self.log_path = log_path
        self.monitor_options = dict(monitor_options or {})
        self.owns_ray = False
        self.monitor: Any = None

    @property
    def replicas(self) -> int:
        """The number of replicas deployed."""
        return self.deployment.replicas

    def start(self) -> ReplicaServer:
        """Start the monitor actor, then the replicas; returns once all of them serve."""
        ray, serve = import_ray_serve()
        deployment = self.deployment
        if not ray.is_initialized():
            ray.init(address=deployment.ray_address, include_dashboard=False, log_to_driver=False)
            self.owns_ray = True
        name = f"{deployment.app_name}-monitor"
        self.monitor = start_monitor(ray, name, self.spec, self.log_path, self.monitor_options)
        self.spec = replace(self.spec, monitor=name)
        serve.start(http_options={"host": self.host, "port": self.port})
        app = replica_deployment(self.spec, deployment.replicas, deployment.cpus_per_replica)
        serve.run(app, name=deployment.app_name, route_prefix="/", blocking=False)
        return self

    def state(self) -> dict[str, Any]:
        """The monitor actor's state (``/v1/monitor``)."""
        ray, _ = import_ray_serve()
        state: dict[str, Any] = ray.get(self.monitor.state.remote())
        return state

    def stop(self) -> None:
        """Delete the application (admitted requests finish) and the monitor actor."""
        ray, serve = import_ray_serve()
        if not ray.is_initialized():
            return
        serve.delete(self.deployment.app_name)
        if self.monitor is not None:
            ray.kill(self.monitor, no_restart=True)
            self.monitor = None
        if self.owns_ray:
            serve.shutdown()
            ray.shutdown()

    def run_until_signal(self, on_started: Callable[[ReplicaServer], None] | None = None) -> None:
        """Serve until SIGINT / SIGTERM, then :meth:`stop` (what ``abstain-guard serve
        --replicas N`` does); ``on_started`` is called once every replica serves."""
        stop = threading.Event()

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop.set()

        self.start()
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
            signal.signal(sig, on_signal)
        try:
            if on_started is not None:
                on_started(self)
            while not stop.wait(1.0):
                pass
        finally:
            self.stop()
