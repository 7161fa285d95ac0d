"""Baselines that run the same programs without slicewise's controller.

- Multi-controller JAX: every worker process of a gang runs the loop itself
  (`HostWorker.bench_loop`), the way a MaxText-style job runs.
- Plain Ray: a driver calls one method per computation on ordinary Ray actors (one per
  host, on the same nodes, with the same JAX setup), waiting for each or pipelining.

Both are driven from a `BaselineDriver`: a process of its own that joins the
controller's Ray cluster, so that the client measuring slicewise is not a Ray driver
too (a driver keeps threads of its own busy) and both sides are measured from
processes alike.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from controller.hostenv import HostPlacement, simulated_host_env
from slicewise.common.mesh import GangShape, MeshSpec, ShardingSpec
from slicewise.common.ops import ExecOp, LoadOp, PutOp


def multi_controller_rate(
    actor_names: list[str],
    program_id: str,
    handles: list[str],
    n: int,
    window: int = 3,
    pace_s: float = 0.0,
) -> float:
    """Computations per second when every worker of a gang (its actors' names) loops on
    its own (with `pace_s`, launching no faster than one call per `pace_s`:
    JaxRuntime.run_loop). Needs a Ray driver in this process."""
    import ray

    actors = [ray.get_actor(name, namespace="slicewise") for name in actor_names]
    seconds = ray.get(
        [a.bench_loop.remote(program_id, handles, n, window, pace_s) for a in actors],
        timeout=600,
    )
    return n / max(seconds)


def worker_thread_names(actor_names: list[str]) -> dict[int, dict[int, str]]:
    """Each worker's Python threads by OS thread id, by worker pid (HostWorker.thread_names
    and .stats). Needs a Ray driver in this process."""
    import ray

    actors = [ray.get_actor(name, namespace="slicewise") for name in actor_names]
    names = ray.get([a.thread_names.remote() for a in actors], timeout=60)
    pids = [s["pid"] for s in ray.get([a.stats.remote() for a in actors], timeout=60)]
    return dict(zip(pids, names, strict=True))


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


class PlainRay:
    """Plain Ray actors, one per host of a gang's shape on the given nodes, each running
    the program on its part of `x`; `waited` and `pipelined` time calls of it. Needs a
    Ray driver in this process; `close` kills the actors."""

    def __init__(
        self,
        shape: GangShape,
        node_ids: list[str],
        serialized: bytes,
        mesh: MeshSpec,
        x: np.ndarray,
        pspec: tuple,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        remote_cls = ray.remote(PlainJaxActor)
        self.actors: list[Any] = []
        for p, node_id in enumerate(node_ids):
            placement = HostPlacement(
                p // shape.hosts_per_slice,
                p % shape.hosts_per_slice,
                shape.num_slices,
                shape.hosts_per_slice,
                shape.chips_per_host,
            )
            self.actors.append(
                remote_cls.options(
                    num_cpus=0,
                    runtime_env={"env_vars": simulated_host_env(placement)},
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(shape, p)
            )
        try:
            coordinator = ray.get(self.actors[0].free_address.remote(), timeout=120)
            ray.get(
                [
                    a.initialize.remote(coordinator, p // shape.hosts_per_slice)
                    for p, a in enumerate(self.actors)
                ],
                timeout=180,
            )
            ray.get([a.load.remote(serialized, mesh, x, pspec) for a in self.actors], timeout=120)
            self.waited(1)  # compiles, outside any timing
        except BaseException:
            self.close()
            raise

    def waited(self, n: int) -> float:
        """Computations per second, the driver waiting for each before the next."""
        import ray

        started = time.perf_counter()
        for _ in range(n):
            ray.get([a.step.remote() for a in self.actors], timeout=120)
        return n / (time.perf_counter() - started)

    def pipelined(self, n: int) -> float:
        """Computations per second, all `n` submitted before the driver waits."""
        import ray

        started = time.perf_counter()
        ray.get([a.step.remote() for _ in range(n) for a in self.actors], timeout=600)
        return n / (time.perf_counter() - started)

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []


def _drive(address: str, requests: Any, answers: Any) -> None:
    """A BaselineDriver's process: joins the Ray cluster of the controller at `address`
    and runs the requests it is sent, answering each ("ok", result) or ("error",
    message), until it is sent None."""
    import slicewise
    from benchmarks.common import attached_to_ray

    plain: PlainRay | None = None
    with slicewise.connect(address) as client, attached_to_ray(client):
        answers.send(("ok", None))
        try:
            while (request := requests.recv()) is not None:
                name, args = request
                try:
                    if name == "multi_controller_rate":
                        result: Any = multi_controller_rate(*args)
                    elif name == "worker_thread_names":
                        result = worker_thread_names(*args)
                    elif name == "plain_ray":
                        if plain is not None:
                            plain.close()
                        plain = PlainRay(*args)
                        result = None
                    elif name in ("plain_waited", "plain_pipelined"):
                        if plain is None:
                            raise RuntimeError("no plain Ray actors: call plain_ray first")
                        result = getattr(plain, name.removeprefix("plain_"))(*args)
                    else:
                        raise ValueError(f"unknown request {name!r}")
                    answers.send(("ok", result))
                except Exception as exc:  # noqa: BLE001 - sent back and raised there
                    answers.send(("error", f"{type(exc).__name__}: {exc}"))
        finally:
            if plain is not None:
                plain.close()


class BaselineDriver:
    """Runs the baselines from a process of its own (see the module's docstring):

    with BaselineDriver(controller.address) as driver:
        rate = driver.multi_controller_rate(actor_names, program_id, handles, n)
        driver.plain_ray(shape, node_ids, serialized, mesh, x, pspec)
        driver.plain_pipelined(n)

    The process is `python -m benchmarks.baselines`, talking over its stdin and stdout
    (no fork of this process, where jax and Ray run, and no import of the caller's main
    module, which multiprocessing's spawn would make).
    """

    def __init__(self, address: str, timeout_s: float = 900.0) -> None:
        from multiprocessing.connection import Connection

        self._timeout_s = timeout_s
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.baselines", address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=root,
            env=os.environ | {"PYTHONPATH": path},
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        # Connections of their own on the pipes (they close what they hold).
        self._requests = Connection(os.dup(self.process.stdin.fileno()), readable=False)
        self._answers = Connection(os.dup(self.process.stdout.fileno()), writable=False)
        self.process.stdin.close()
        self.process.stdout.close()
        try:
            self._answer("joining the Ray cluster")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _answer(self, what: str) -> Any:
        if not self._answers.poll(self._timeout_s):
            raise TimeoutError(f"the baseline driver did not finish {what} in {self._timeout_s} s")
        try:
            status, result = self._answers.recv()
        except (EOFError, OSError):
            raise RuntimeError(
                f"the baseline driver exited (code {self.process.wait(timeout=30)}) during "
                f"{what}; its errors are above"
            ) from None
        if status != "ok":
            raise RuntimeError(f"the baseline driver failed {what}: {result}")
        return result

    def _call(self, name: str, *args: Any) -> Any:
        self._requests.send((name, args))
        return self._answer(name)

    def multi_controller_rate(self, *args: Any) -> float:
        """See the module-level `multi_controller_rate`."""
        rate: float = self._call("multi_controller_rate", *args)
        return rate

    def worker_thread_names(self, actor_names: list[str]) -> dict[int, dict[int, str]]:
        names: dict[int, dict[int, str]] = self._call("worker_thread_names", actor_names)
        return names

    def plain_ray(self, *args: Any) -> None:
        """Starts the plain Ray actors (see `PlainRay`), replacing any started before."""
        self._call("plain_ray", *args)

    def plain_waited(self, n: int) -> float:
        rate: float = self._call("plain_waited", n)
        return rate

    def plain_pipelined(self, n: int) -> float:
        rate: float = self._call("plain_pipelined", n)
        return rate

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self._requests.send(None)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self._requests.close()
        self._answers.close()

    def __enter__(self) -> BaselineDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    """`python -m benchmarks.baselines CONTROLLER`: a BaselineDriver's process, taking
    requests on stdin and answering on stdout."""
    from multiprocessing.connection import Connection

    answers = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # what jax, Ray or a print write goes to stderr, not into the answers
    _drive(sys.argv[1], Connection(os.dup(0), writable=False), answers)


if __name__ == "__main__":
    main()
