"""The seam between the gang manager and the cluster: the few things gangs ask of Ray
(its node table, all-or-nothing reservations, worker actors and their control channels)
as a small interface, and `RayBackend`, the one implementation that calls Ray.

Unit tests put an in-memory backend in its place (tests/unit/fake_cluster.py), so that
admission, rollback, sharing and preemption run without processes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from controller.channel import ControllerEnd
from controller.coordination import CoordinationService
from controller.simcluster import SLICE_NAME_LABEL, WORKER_ID_LABEL
from slicewise.common.files import last_lines
from slicewise.common.framing import ChannelError
from slicewise.common.mesh import GangShape
from slicewise.common.ops import Completions, Op
from slicewise.common.trace import Span

# Threads per worker actor: outstanding batches plus concurrent reads.
_WORKER_THREADS = 16


@dataclass(frozen=True)
class HostBundle:
    """One host's part of a reservation: `chips` on host `worker_id` of a slice."""

    slice_name: str
    worker_id: int
    chips: int
    head_resource: str = ""  # on host 0 of a slice: Ray's `TPU-<type>-head` resource


@dataclass(frozen=True)
class WorkerSpec:
    """One worker actor to start, in bundle `process_id` of its gang's reservation."""

    name: str  # unique per gang and epoch (gang.worker_name)
    gang_id: str
    shape: GangShape
    process_id: int
    chips: int
    env: Mapping[str, str]  # what JAX must find in the process environment at start
    window: int
    token: str  # the secret the worker's control channel asks for


class Reservation(Protocol):
    """Hosts being held for one gang, all of them at once or none."""

    async def ready(self) -> None:
        """Returns once every host is held."""


class Worker(Protocol):
    """A started worker actor, as the controller calls it."""

    async def free_address(self, host: str) -> str: ...

    async def initialize(
        self,
        coordinator: str,
        epoch: int,
        *,
        partition_index: int,
        bind_address: str | None,
        timeout_s: int,
    ) -> dict[str, Any]: ...

    async def data_address(self) -> str: ...

    async def stats(self) -> dict[str, Any]: ...

    async def compiled_text(self, program_id: str) -> str: ...

    async def trace_spans(self, last: int = 0) -> list[Span]:
        """The worker's spans; with `last`, only its most recent `last`."""
        ...

    async def drop_pin(self, pin_id: str) -> None: ...

    async def prepare_stash(self, name: str) -> None:
        """Starts a stash actor on the worker's host for a later `stash_state`."""
        ...

    async def stash_state(self, name: str, handles: list[str]) -> int:
        """Copies the worker's pieces of the arrays into a stash on its host (worker/stash.py)."""
        ...

    async def prepare_data(self, program: str, overrides: tuple[tuple[str, str], ...]) -> None:
        """Has the worker begin loading the data of a program's batches in the background."""
        ...

    async def log_tail(self, lines: int) -> str:
        """The last `lines` lines of the worker's stderr."""
        ...


class Channel(Protocol):
    """The controller's end of a worker's control channel (controller/channel.py):
    `heard_at` is when anything last came from the worker (time.monotonic), `progress`
    what its latest heartbeat said (controller/health.py)."""

    heard_at: float
    progress: dict[str, Any]

    async def send(self, ops: list[Op]) -> None: ...

    def write(self, ops: list[Op], frames: list[bytes]) -> None:
        """Queues `ops`, already encoded as `frames` (channel.encode_batch)."""

    async def drain(self) -> None:
        """Waits until what was written is on its way."""

    def hurry(self, seq: int) -> None:
        """Asks the worker to report operation `seq` as soon as it completes."""

    def listen(
        self,
        on_results: Callable[[Completions], None],
        on_error: Callable[[ChannelError], None],
    ) -> None:
        """Hands each frame of completions to `on_results` as it arrives, and the
        channel's failure to `on_error`, once."""

    def close(self) -> None: ...


class Coordination(Protocol):
    """A gang's jax.distributed coordination service (controller/coordination.py)."""

    address: str

    def stop(self) -> None: ...


class ClusterBackend(Protocol):
    """Everything the gang manager and its gangs need from the cluster."""

    def nodes(self) -> list[dict[str, Any]]:
        """The node table, as `ray.nodes()` rows (may block: it is called in a thread)."""
        ...

    def reserve(self, name: str, hosts: Sequence[HostBundle]) -> Reservation:
        """Starts reserving every host at once, each pinned to its slice and host."""
        ...

    def start_worker(self, reservation: Reservation, spec: WorkerSpec) -> Worker:
        """Launches one worker in its bundle of the reservation; returns at once."""
        ...

    async def connect(self, address: str, token: str, epoch: int, name: str) -> Channel:
        """Opens the control channel of a formed worker (`name` says which, in errors)."""
        ...

    def kill(self, worker: Worker) -> None:
        """Stops a worker at once; safe to call for one that is already gone."""
        ...

    def drop_stash(self, name: str) -> None:
        """Ends a stash actor (worker/stash.py), if it is still there."""
        ...

    def coordination_service(self, host: str, num_processes: int) -> Coordination:
        """Starts a gang's jax.distributed coordination service here, on `host` (may block:
        it is called in a thread)."""
        ...

    def remove(self, reservation: Reservation) -> None:
        """Frees every host of a reservation, held or still pending."""
        ...

    def last_words(self, error: BaseException) -> str:
        """The end of what a worker process wrote to stderr before it died, when `error`
        says one died and its output is readable here (a simulated host); else ""."""
        ...


class _PlacementGroup:
    """A Ray placement group as a Reservation."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg

    async def ready(self) -> None:
        await self.pg.ready()


class _Actor:
    """A HostWorker actor handle as a Worker."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def free_address(self, host: str) -> str:
        return await self.actor.free_address.remote(host)

    async def initialize(
        self,
        coordinator: str,
        epoch: int,
        *,
        partition_index: int,
        bind_address: str | None,
        timeout_s: int,
    ) -> dict[str, Any]:
        return await self.actor.initialize.remote(
            coordinator,
            epoch,
            partition_index=partition_index,
            bind_address=bind_address,
            timeout_s=timeout_s,
        )

    async def data_address(self) -> str:
        return await self.actor.data_address.remote()

    async def stats(self) -> dict[str, Any]:
        return await self.actor.stats.remote()

    async def compiled_text(self, program_id: str) -> str:
        return await self.actor.compiled_text.remote(program_id)

    async def trace_spans(self, last: int = 0) -> list[Span]:
        return await self.actor.trace_spans.remote(last=last)

    async def drop_pin(self, pin_id: str) -> None:
        await self.actor.drop_pin.remote(pin_id)

    async def prepare_stash(self, name: str) -> None:
        await self.actor.prepare_stash.remote(name)

    async def stash_state(self, name: str, handles: list[str]) -> int:
        return await self.actor.stash_state.remote(name, handles)

    async def prepare_data(self, program: str, overrides: tuple[tuple[str, str], ...]) -> None:
        await self.actor.prepare_data.remote(program, overrides)

    async def log_tail(self, lines: int) -> str:
        return await self.actor.log_tail.remote(lines)


class RayBackend:
    """The cluster as Ray shows it: placement groups hold gangs, actors are workers."""

    def __init__(self) -> None:
        self._actor_class: Any = None  # ray.remote(HostWorker), made once on first use

    def nodes(self) -> list[dict[str, Any]]:
        import ray

        return ray.nodes()

    def reserve(self, name: str, hosts: Sequence[HostBundle]) -> Reservation:
        """One placement group, one bundle per host, each pinned to its slice and host by
        label: Ray reserves all bundles of a group atomically, so a gang is held whole or
        not at all, never in part."""
        from ray.util.placement_group import placement_group

        bundles = []
        for h in hosts:
            bundle = {"TPU": float(h.chips)}
            if h.head_resource:
                bundle[h.head_resource] = 1.0
            bundles.append(bundle)
        selectors = [
            {SLICE_NAME_LABEL: h.slice_name, WORKER_ID_LABEL: str(h.worker_id)} for h in hosts
        ]
        return _PlacementGroup(
            placement_group(
                bundles, strategy="STRICT_SPREAD", name=name, bundle_label_selector=selectors
            )
        )

    def start_worker(self, reservation: Reservation, spec: WorkerSpec) -> Worker:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from worker.actor import HostWorker

        assert isinstance(reservation, _PlacementGroup)
        if self._actor_class is None:
            self._actor_class = ray.remote(HostWorker)
        actor = self._actor_class.options(
            num_cpus=0,
            resources={"TPU": float(spec.chips)},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                reservation.pg, placement_group_bundle_index=spec.process_id
            ),
            runtime_env={"env_vars": dict(spec.env)},
            max_concurrency=_WORKER_THREADS,
            max_restarts=0,
            name=spec.name,
        ).remote(spec.gang_id, spec.shape, spec.process_id, window=spec.window, token=spec.token)
        return _Actor(actor)

    async def connect(self, address: str, token: str, epoch: int, name: str) -> Channel:
        return await ControllerEnd.connect(address, token, epoch, name)

    def kill(self, worker: Worker) -> None:
        import ray

        assert isinstance(worker, _Actor)
        with contextlib.suppress(Exception):
            ray.kill(worker.actor, no_restart=True)

    def coordination_service(self, host: str, num_processes: int) -> Coordination:
        return CoordinationService(host, num_processes)

    def drop_stash(self, name: str) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(name), no_restart=True)

    def remove(self, reservation: Reservation) -> None:
        from ray.util.placement_group import remove_placement_group

        assert isinstance(reservation, _PlacementGroup)
        with contextlib.suppress(Exception):
            remove_placement_group(reservation.pg)

    def last_words(self, error: BaseException) -> str:
        """Ray names a dead actor's pid in the error (`pid: 14767`); a worker's stderr is
        `worker-<id>-<job>-<pid>.err` in the logs directory of the Ray session, on its
        node: readable from the controller when the node is this machine."""
        import ray

        if not isinstance(error, ray.exceptions.ActorDiedError):
            return ""
        found = re.search(r"^\s*pid: (\d+)$", str(error), re.MULTILINE)
        node = getattr(ray._private.worker, "_global_node", None)
        if found is None or node is None:
            return ""
        with contextlib.suppress(Exception):
            files = sorted(Path(node.get_logs_dir_path()).glob(f"worker-*-{found[1]}.err"))
            if files:
                return last_lines(files[-1], 20, max_bytes=4096).rstrip("\n")
        return ""
