"""Load and fault bench of ``abstain-guard serve --replicas N`` (Ray Serve, the shipped guard).

On a local Ray cluster of this machine's cores, in this process: for 1 and for 2 replicas
(each replica reserving cores / N CPUs and computing with that many threads), start the
deployment (one monitor actor, a fresh monitor log), drive it with the load of
``bench/serving/serve_load.py`` (``--requests`` requests, ``--concurrency`` at once, plain and
streamed in turn, every tenth one malformed) and check the monitor's decision count against
the answered requests. Then, with 2 replicas, a replica is killed (``ray.kill`` on its
actor) while ``--kill-requests`` requests run: the requests lost (not answered; their
statuses), the decisions in the monitor log against the requests answered, and the places
the killed replica held in the monitor's admission order (its requests in flight), and the
time until Ray Serve reports the application running with 2 replica actors and a request is
answered (``recover_s``). Prints one JSON line.

On a 2-core machine two replicas share the cores one replica used: no throughput gain can
show here (``cores`` is in the JSON); the bench measures what replicas cost and what a
failure loses, not the scaling of replicas with their own cores or GPUs.

Run: ``flock /tmp/heavy.lock .venv/bin/python bench/serving/serve_replicas.py``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import QUESTIONS, load

from abstain_guard import GuardConfig, default_artifact_path
from abstain_guard.monitor.log import read_log
from abstain_guard.serve.ray_serve import Deployment, ReplicaServer, ReplicaSpec
from abstain_guard.serve.runner import free_port


def _spec() -> ReplicaSpec:
    return ReplicaSpec(
        artifact=str(default_artifact_path()),
        config=GuardConfig(participation=0.8).model_dump(mode="json"),
    )


async def _ask(client: httpx.AsyncClient, url: str, question: str) -> tuple[int, str | None]:
    body = {"model": "abstain-guard", "messages": [{"role": "user", "content": question}]}
    try:
        r = await client.post(url, json=body)
    except httpx.HTTPError:
        return 599, None
    return r.status_code, r.json()["id"] if r.status_code == 200 else None


def _replica_actors() -> list[Any]:
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::abstain-guard")
    ]


async def kill_one(server: ReplicaServer, url: str, requests: int, concurrency: int) -> dict:
    """Kill a replica while ``requests`` run; what was lost and how long recovery took."""
    before = {r.run_id for r in read_log(server.log_path or "")[1]}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(i: int) -> tuple[int, str | None]:
            async with gate:
                return await _ask(client, url, QUESTIONS[i % len(QUESTIONS)])

        tasks = [asyncio.create_task(one(i)) for i in range(requests)]
        busy_by = time.monotonic() + 120
        while server.state()["deployment"]["in_flight"] < concurrency // 2:
            if time.monotonic() > busy_by:
                raise RuntimeError("the replicas never got busy: nothing to kill under load")
            await asyncio.sleep(0.05)
        ray.kill(_replica_actors()[0], no_restart=True)
        killed = time.monotonic()
        answers = await asyncio.gather(*tasks)
        while server.state()["deployment"]["in_flight"] > 0:
            await asyncio.sleep(0.2)
        logged = {r.run_id for r in read_log(server.log_path or "")[1]} - before
        deployment = server.state()["deployment"]
        recovered = None
        while time.monotonic() - killed < 300:
            running = (
                len(_replica_actors()) == 2
                and serve.status().applications[server.app_name].status == "RUNNING"
            )
            if running and (await _ask(client, url, QUESTIONS[0]))[0] == 200:
                recovered = round(time.monotonic() - killed, 1)
                break
            await asyncio.sleep(0.5)
    answered = {i for status, i in answers if status == 200}
    return {
        "requests": requests,
        "answered": len(answered),
        "lost": requests - len(answered),
        "lost_statuses": dict(Counter(str(s) for s, _ in answers if s != 200)),
        "answered_in_monitor_log": len(answered & logged),
        "every_answered_in_log": answered <= logged,
        "logged_not_answered": len(logged - answered),
        "in_flight_on_killed_replica": deployment["released_by_dead_replicas"],
        "recover_s": recovered,
    }


async def run(args: argparse.Namespace, cores: int) -> dict[str, Any]:
    out: dict[str, Any] = {"bench": "serve_replicas", "cores": cores, "requests": args.requests,
                           "concurrency": args.concurrency}  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="serve_replicas-"))
    port = free_port()  # Ray Serve's proxy keeps the port it started on
    for n in (1, 2):
        server = ReplicaServer(
            _spec(),
            Deployment(replicas=n, port=port, cpus_per_replica=cores / n),
            log_path=str(tmp / f"live-{n}.jsonl"),
        )
        start = time.perf_counter()
        server.start()
        url = server.base_url + "/chat/completions"
        try:
            result = {"start_s": round(time.perf_counter() - start, 1)}
            limits = httpx.Limits(max_connections=args.concurrency + 2)
            async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                result.update((await load(client, url, args.requests, args.concurrency))[0])
            while server.state()["deployment"]["in_flight"] > 0:
                await asyncio.sleep(0.2)
            state = server.state()
            result["monitor_decisions"] = state["decisions"]
            result["monitor_counts_every_decision"] = state["decisions"] == result["decided"]
            result["decisions_by_replica"] = sorted(
                state["deployment"]["decisions_by_replica"].values()
            )
            out[f"replicas_{n}"] = result
            if n == 2:
                out["kill"] = await kill_one(server, url, args.kill_requests, args.concurrency)
        finally:
            server.stop()
    one, two = out["replicas_1"], out["replicas_2"]
    out["throughput_2_over_1"] = round(two["throughput_rps"] / one["throughput_rps"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kill-requests", type=int, default=24)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
    try:
        result = asyncio.run(run(args, cores))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
