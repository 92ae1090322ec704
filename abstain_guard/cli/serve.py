"""``abstain-guard serve``: the guard (or, with ``--no-guard``, the raw model) as an
OpenAI-compatible endpoint (the serve extra; imported inside the command)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any

from abstain_guard.config import GuardConfig
from abstain_guard.default import DEFAULT_ARTIFACT_DIR
from abstain_guard.errors import ConfigError

from .checks import (
    add_model_options,
    all_at_once,
    artifact_model,
    artifacts_exist,
    given_model,
    guard_config,
    positive,
)

if TYPE_CHECKING:
    from abstain_guard.serve.step_record import StepLimits

logger = logging.getLogger("abstain_guard.serve")


def _serve(args: argparse.Namespace) -> int:
    if args.replicas is not None and args.replicas < 1:
        raise ConfigError(f"--replicas must be a positive integer, got {args.replicas}.")
    try:
        from abstain_guard.serve.runner import serve
        from abstain_guard.serve.telemetry import configure_logging
    except ImportError as exc:
        raise ConfigError(
            f"abstain-guard serve needs the serve extra ({exc}); install it with "
            "pip install 'abstain-guard[serve]'."
        ) from exc
    configure_logging(args.log_level)
    if (args.replicas or 1) > 1 or args.ray_address is not None:
        return _serve_replicas(args)
    if args.cpus_per_replica is not None:
        raise ConfigError("--cpus-per-replica only applies with --replicas 2+ or --ray-address.")
    service = _model_service(args) if args.no_guard else _guard_service(args)
    monitor = None if args.no_guard else serve_monitor(service, args.monitor_log)
    serve(
        service,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        api_key=_api_key(args),
        monitor=monitor,
    )
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$ABSTAIN_GUARD_API_KEY``, else None (no key)."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def _serve_replicas(args: argparse.Namespace) -> int:
    """``--replicas N`` / ``--ray-address``: the guard's replicas on Ray Serve, one monitor."""
    if args.no_guard:
        raise ConfigError(
            "--replicas / --ray-address serve a guard on Ray Serve; --no-guard runs in one "
            "process only (drop --replicas and --ray-address)."
        )
    from abstain_guard.serve.ray_serve import (
        Deployment,
        ReplicaServer,
        ReplicaSpec,
        import_ray_serve,
        shared_vllm_engine,
    )
    from abstain_guard.serve.runner import is_loopback

    import_ray_serve()  # the extra is missing: say so before anything starts
    artifact, config, steps = _guard_options(args)
    spec = ReplicaSpec(
        artifact=artifact,
        config=config.model_dump(mode="json"),
        kind=args.kind,
        model_name=args.model_name,
        max_in_flight=args.max_in_flight,
        steps=steps,
        api_key=_api_key(args),
        loopback=is_loopback(args.host),
        # a vLLM guard: your server, or one engine started for the replicas
        engine_url=args.engine_url or shared_vllm_engine(artifact),
        log_level=args.log_level,
    )
    deployment = Deployment(
        replicas=args.replicas or 1,
        host=args.host,
        port=args.port,
        cpus_per_replica=args.cpus_per_replica or 1.0,
        ray_address=args.ray_address,
    )
    server = ReplicaServer(spec, deployment, log_path=args.monitor_log)

    def started(server: ReplicaServer) -> None:
        _say_monitor(server.state()["resumed"], args.monitor_log)
        logger.info(
            "%d replicas on Ray Serve at %s (one drift monitor for all of them)",
            server.replicas,
            server.base_url,
        )

    server.run_until_signal(on_started=started)
    return 0


def serve_monitor(service: Any, log_path: str | None) -> Any:
    """The drift monitor ``serve`` feeds (a fitted ``GuardMonitor``; None without a guard).

    With ``--monitor-log`` naming an existing log, the monitor resumes it (its decisions and
    feedback replayed: the tests go on, feedback for decisions from before the restart is
    taken) and logs so; without one it warns that a restart starts the tests afresh.

    Raises:
        MonitorLogError: the log cannot be resumed (another artifact, rule or setting).
    """
    from abstain_guard.serve.app import service_monitor

    monitor = service_monitor(service, log_path=log_path)
    if monitor is None:
        return None
    _say_monitor(monitor.state()["resumed"], log_path)
    return monitor


def _say_monitor(resumed: dict[str, Any] | None, log_path: str | None) -> None:
    """Log whether the monitor resumed ``log_path`` or keeps its tests in memory."""
    if resumed is not None:
        logger.info(
            "the drift monitor resumed %s (%d decisions, %d feedback, %d alarms): its tests go "
            "on, and their false-alarm bound holds over the whole log.",
            log_path, resumed["decisions"], resumed["feedback"], resumed["alarms"],
        )  # fmt: skip
    elif log_path is None:
        logger.warning(
            "no --monitor-log: the drift monitor keeps its tests in memory only, so a restart "
            "starts them afresh (each restart spends another false-alarm budget) and forgets "
            "the decisions feedback can label. Pass --monitor-log to resume them."
        )


#: The environment variable ``serve`` reads its API key from (``--api-key`` wins).
API_KEY_ENV = "ABSTAIN_GUARD_API_KEY"
#: The environment variable ``serve`` reads its log level from (``--log-level`` wins).
LOG_LEVEL_ENV = "ABSTAIN_GUARD_LOG_LEVEL"


def _guard_service(args: argparse.Namespace) -> Any:
    """The guard of ``--artifact`` (default: the shipped one), checked before loading."""
    from abstain_guard.artifact.guard_artifact import GuardArtifact
    from abstain_guard.guard.chains import calibrated_chat_model
    from abstain_guard.serve.service import GuardService

    artifact, config, steps = _guard_options(args)
    model = None
    if args.engine_url is not None:  # a vLLM guard in front of your own `vllm serve`
        from abstain_guard.serve.ray_serve import vllm_model_of

        _backend_matches("vllm", artifact)
        model = vllm_model_of(artifact, args.engine_url)
    elif args.device is not None:  # the calibrated model, on another device
        model = calibrated_chat_model(GuardArtifact.load(artifact), device=args.device)
    return GuardService.from_artifact(
        artifact,
        config,
        model=model,
        kind=args.kind,
        model_name=args.model_name,
        max_in_flight=args.max_in_flight,
        step_record=steps.record(),
    )


def _guard_options(args: argparse.Namespace) -> tuple[str, GuardConfig, StepLimits]:
    """The artifact, guard config and step-record limits of a guarded ``serve``, checked
    (all problems at once)."""
    from abstain_guard.serve.step_record import StepLimits

    artifact = args.artifact or str(DEFAULT_ARTIFACT_DIR)
    local_only = [f for f in ("max_tokens",) if getattr(args, f) is not None]
    all_at_once(
        lambda: _no_options(local_only, "only with --no-guard (a guard runs its artifact's"),
        lambda: artifacts_exist([artifact]),
        lambda: artifact_model(artifact, args),
        lambda: guard_config(args.config),
        lambda: positive(args.port, "--port"),
        lambda: positive(args.max_in_flight, "--max-in-flight"),
        lambda: positive(args.step_record_size, "--step-record-size"),
        lambda: _positive_seconds(args.step_record_ttl, "--step-record-ttl"),
        lambda: _positive_cpus(args.cpus_per_replica),
        lambda: _backend_matches(args.backend, artifact),
    )
    given = {"max_entries": args.step_record_size, "ttl_s": args.step_record_ttl}
    steps = StepLimits(**{k: v for k, v in given.items() if v is not None})
    return artifact, guard_config(args.config), steps


#: Options of a guard only (errors with ``--no-guard``).
GUARD_ONLY = (
    "artifact",
    "config",
    "kind",
    "monitor_log",
    "step_record_size",
    "step_record_ttl",
    "engine_url",
)


def _model_service(args: argparse.Namespace) -> Any:
    """The raw model of ``--model`` without a guard (``--no-guard``)."""
    from abstain_guard.contract.model_names import DEFAULT_MODEL, ModelName
    from abstain_guard.guard.chains import load_chat_model
    from abstain_guard.serve.passthrough import ModelService

    guard_only = [f for f in GUARD_ONLY if getattr(args, f) is not None]
    all_at_once(
        lambda: _no_options(guard_only, "not with --no-guard (no guard runs: it serves the"),
        lambda: positive(args.port, "--port"),
        lambda: positive(args.max_in_flight, "--max-in-flight"),
        lambda: positive(args.max_tokens, "--max-tokens"),
    )
    max_tokens = args.max_tokens or 256
    name = given_model(args) or ModelName(DEFAULT_MODEL)
    if args.backend == "vllm":  # the raw model on vLLM, for a side-by-side look
        from abstain_guard.backends.vllm_chat import VLLMChatModel

        if not isinstance(name.model, str):
            raise ConfigError(f"--backend vllm serves a local model, not {name.label}.")
        model = VLLMChatModel(model=name.model, gguf_file=name.gguf_file, max_tokens=max_tokens)
    else:
        model = load_chat_model(
            name.model,
            gguf_file=name.gguf_file,
            max_new_tokens=max_tokens,
            device=args.device or "cpu",
        )
    return ModelService(
        model,
        model_name=args.model_name,
        max_tokens=max_tokens,
        max_in_flight=args.max_in_flight,
    )


def _backend_matches(backend: str | None, artifact: str) -> None:
    """``--backend`` (when given) names the backend the artifact was calibrated on.

    Raises:
        ConfigError: it names another one.
    """
    if backend is None:
        return
    from abstain_guard.artifact.guard_artifact import GuardArtifact

    decoding = (GuardArtifact.load(artifact).metadata.get("deployment") or {}).get("decoding")
    recorded = "vllm" if (decoding or {}).get("backend") == "vllm" else "exact"
    if backend != recorded:
        raise ConfigError(
            f"--backend {backend}: the artifact {artifact} was calibrated on the {recorded} "
            f"backend and is served on it (its guarantee holds there); serve it with "
            f"--backend {recorded}, or calibrate for {backend} (calibrate --backend {backend})."
        )


def _positive_cpus(value: float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"--cpus-per-replica must be a positive number of CPUs, got {value}.")


def _positive_seconds(value: float | None, option: str) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{option} must be a positive number of seconds, got {value}.")


def _no_options(names: list[str], why: str) -> None:
    if names:
        flags = ", ".join("--" + n.replace("_", "-") for n in names)
        raise ConfigError(f"{flags}: {why} model).")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the subparsers ``sub``; returns its parser."""
    srv = sub.add_parser(
        "serve", help="serve the guard as an OpenAI-compatible endpoint (serve extra)"
    )
    _add_served_options(srv)
    _add_endpoint_options(srv)
    _add_monitor_options(srv)
    _add_replica_options(srv)
    srv.set_defaults(func=_serve)
    return srv


def _add_served_options(srv: argparse.ArgumentParser) -> None:
    """What is served: the guard of an artifact, or (``--no-guard``) the raw model."""
    srv.add_argument("--artifact", help="artifact directory (default: the shipped guard)")
    srv.add_argument("--config", help="guard config (YAML/TOML/JSON): mode, target")
    srv.add_argument(
        "--no-guard",
        action="store_true",
        help="serve the raw --model with OpenAI logprobs and no guard (a stand-in API model "
        "to calibrate a perplexity guard on)",
    )
    add_model_options(
        srv,
        local=True,
        what="default: the artifact's (given, it must be the artifact's; --device places it); "
        "with --no-guard, the model to serve",
    )
    srv.add_argument("--gguf-file", help="a GGUF file inside the folder --model names")
    srv.add_argument(
        "--engine-url",
        help="a vLLM-calibrated guard: your running `vllm serve` (http://host:8000), started "
        "with the guard's connector flag, instead of a server started for the guard",
    )
    srv.add_argument(
        "--backend",
        choices=("exact", "vllm"),
        help="the engine: a guard is served on the backend its artifact was calibrated on "
        "(given, it must be that one); with --no-guard, 'vllm' serves --model on vLLM "
        "(docs/vllm.md)",
    )
    srv.add_argument(
        "--max-tokens",
        type=int,
        help="with --no-guard: the most new tokens a request may ask for (default 256)",
    )


def _add_endpoint_options(srv: argparse.ArgumentParser) -> None:
    """Where and how the endpoint listens and admits requests."""
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument(
        "--kind",
        choices=["open", "choice", "numeric"],
        help="question kind to serve (default: the artifact's only kind)",
    )
    srv.add_argument("--model-name", default="abstain-guard", help="model id listed by /v1/models")
    srv.add_argument(
        "--max-in-flight",
        type=int,
        help="requests admitted at once, 429 beyond (default: the model's batch + queue)",
    )
    srv.add_argument(
        "--step-record-size",
        type=int,
        help="agent step gating: the most step decisions kept for the runs' next requests "
        "(default 100000; least recently used dropped first; a run whose earlier step was "
        "dropped abstains)",
    )
    srv.add_argument(
        "--step-record-ttl",
        type=float,
        help="agent step gating: seconds a step decision is kept (default 3600)",
    )


def _add_monitor_options(srv: argparse.ArgumentParser) -> None:
    """Who may call the endpoint, and where the drift monitor logs."""
    srv.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer <key>' on /v1/* (default: $ABSTAIN_GUARD_API_KEY); "
        "without one, a server listening beyond loopback refuses /v1/feedback",
    )
    srv.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default=os.environ.get(LOG_LEVEL_ENV, "info"),
        help="JSON log lines on stderr at this level and above; decisions are info (default: "
        "$ABSTAIN_GUARD_LOG_LEVEL, else info)",
    )
    srv.add_argument(
        "--monitor-log",
        help="append every decision, feedback and drift alarm to this JSONL file (the "
        "--feedback of abstain-guard recalibrate); an existing one is resumed: the monitor's "
        "tests go on across restarts",
    )


def _add_replica_options(srv: argparse.ArgumentParser) -> None:
    """Replicas on Ray Serve behind the one endpoint."""
    srv.add_argument(
        "--replicas",
        type=int,
        help="model replicas on Ray Serve behind this endpoint, with one drift monitor for "
        "all of them (ray extra; default 1: this process alone)",
    )
    srv.add_argument(
        "--ray-address",
        help="the Ray cluster for the replicas: 'auto' (the one 'ray start' runs here), "
        "ray://HEAD:10001; unset: a local cluster (implies Ray Serve, also with 1 replica)",
    )
    srv.add_argument(
        "--cpus-per-replica",
        type=float,
        help="with --replicas / --ray-address: CPUs each replica reserves and computes with "
        "(default 1)",
    )
