"""Baselines that run the same programs without slicewise's controller.

- Multi-controller JAX: every worker process of a gang runs the loop itself
  (`HostWorker.bench_loop`), the way a MaxText-style job runs.
- Plain Ray: a driver calls one method per computation on ordinary Ray actors (one per
  host, on the same nodes, with the same JAX setup), waiting for each or pipelining.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from controller.hostenv import HostPlacement, simulated_host_env
from slicewise.common.mesh import GangShape, MeshSpec, ShardingSpec
from slicewise.common.ops import ExecOp, LoadOp, PutOp


def multi_controller_rate(
    gang: Any, program_id: str, handles: list[str], n: int, window: int = 3, pace_s: float = 0.0
) -> float:
    """Computations per second when every worker of `gang` loops on its own (with
    `pace_s`, launching no faster than one call per `pace_s`: JaxRuntime.run_loop)."""
    import ray

    actors = [ray.get_actor(w.actor_name, namespace="slicewise") for w in gang.stats().workers]
    seconds = ray.get(
        [a.bench_loop.remote(program_id, handles, n, window, pace_s) for a in actors],
        timeout=600,
    )
    return n / max(seconds)


def worker_thread_names(gang: Any) -> dict[int, dict[int, str]]:
    """Each worker's Python threads by OS thread id, by worker pid (HostWorker.thread_names)."""
    import ray

    workers = gang.stats().workers
    actors = [ray.get_actor(w.actor_name, namespace="slicewise") for w in workers]
    names = ray.get([a.thread_names.remote() for a in actors], timeout=60)
    return {w.pid: n for w, n in zip(workers, names, strict=True)}


class PlainJaxActor:
    """One host's JAX process driven call by call from a Ray driver."""

    def __init__(self, shape: GangShape, process_id: int) -> None:
        from worker.runtime import JaxRuntime

        self.runtime = JaxRuntime(shape, process_id)
        self.process_id = process_id
        self._seq = 0

    def free_address(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"127.0.0.1:{s.getsockname()[1]}"

    def initialize(self, coordinator: str, partition_index: int) -> None:
        self.runtime.initialize(
            coordinator, partition_index=partition_index, bind_address=coordinator, timeout_s=120
        )

    def load(self, serialized: bytes, mesh: MeshSpec, x: np.ndarray, pspec: tuple) -> None:
        sharding = ShardingSpec.from_partition_spec(mesh, pspec)
        pieces = sharding.process_pieces(x.shape, self.runtime.gang)[self.process_id]
        self.runtime.stage("x", [(i, np.asarray(x[i], order="C")) for i in pieces])
        self.runtime.apply(PutOp(1, "x", x.shape, x.dtype.name, sharding, "x"))
        self.runtime.apply(LoadOp(2, "p", serialized, mesh))

    def step(self) -> None:
        """One computation, waited for: the next call starts after this one is done."""
        self._seq += 1
        self.runtime.apply(ExecOp(self._seq, "p", ("x",), ("x",))).wait()


def plain_ray_rates(
    shape: GangShape,
    node_ids: list[str],
    serialized: bytes,
    mesh: MeshSpec,
    x: np.ndarray,
    pspec: tuple,
    n: int,
) -> dict[str, float]:
    """Computations per second with a Ray driver calling plain actors: each call waited
    for ("waited"), and all calls submitted before waiting ("pipelined")."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote_cls = ray.remote(PlainJaxActor)
    actors = []
    for p, node_id in enumerate(node_ids):
        placement = HostPlacement(
            p // shape.hosts_per_slice,
            p % shape.hosts_per_slice,
            shape.num_slices,
            shape.hosts_per_slice,
            shape.chips_per_host,
        )
        actors.append(
            remote_cls.options(
                num_cpus=0,
                runtime_env={"env_vars": simulated_host_env(placement)},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(shape, p)
        )
    try:
        coordinator = ray.get(actors[0].free_address.remote(), timeout=120)
        ray.get(
            [
                a.initialize.remote(coordinator, p // shape.hosts_per_slice)
                for p, a in enumerate(actors)
            ],
            timeout=180,
        )
        ray.get([a.load.remote(serialized, mesh, x, pspec) for a in actors], timeout=120)
        ray.get([a.step.remote() for a in actors], timeout=120)  # compile outside the timing

        started = time.perf_counter()
        for _ in range(n):
            ray.get([a.step.remote() for a in actors], timeout=120)
        waited = n / (time.perf_counter() - started)

        started = time.perf_counter()
        ray.get([a.step.remote() for _ in range(n) for a in actors], timeout=600)
        pipelined = n / (time.perf_counter() - started)
        return {"waited": waited, "pipelined": pipelined}
    finally:
        for a in actors:
            ray.kill(a)
