"""A gang: whole slices reserved through Ray placement groups, one worker actor per
host, all joined into one jax.distributed cluster, fed by one dispatch queue."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from controller import datalink, metrics
from controller.channel import ControllerEnd
from controller.dispatch import Dispatcher, Ticket
from controller.hostenv import HostPlacement, simulated_host_env, tpu_host_env
from controller.inventory import Slice
from controller.simcluster import SLICE_NAME_LABEL, WORKER_ID_LABEL
from slicewise.common.errors import WorkerError
from slicewise.common.framing import ChannelError, Pieces
from slicewise.common.mesh import GangShape, Index
from slicewise.common.ops import Op, OpResult
from slicewise.common.topology import SliceType
from slicewise.common.trace import Span, SpanRecorder

log = logging.getLogger(__name__)

# Threads per worker actor: outstanding batches plus concurrent reads.
_WORKER_THREADS = 16


def _failpoint(name: str) -> float:
    """Test-only pauses: if SLICEWISE_FAILPOINTS names a JSON file, its value for `name`
    (e.g. {"reserve_delay_s": 4}: wait that long before reserving, so a test can take a
    host away mid-reservation). Read on every use, so a test can set and clear it."""
    path = os.environ.get("SLICEWISE_FAILPOINTS")
    if not path:
        return 0.0
    try:
        with open(path) as f:
            return float(json.load(f).get(name, 0.0))
    except (OSError, ValueError):
        return 0.0


class GangState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    # Told to make room for a higher-priority request; still running until released.
    PREEMPTING = "preempting"
    # Workers stopped by preemption; queued to resume on new workers.
    PREEMPTED = "preempted"
    FAILED = "failed"
    RELEASED = "released"


class SliceLostError(WorkerError):
    """A slice being reserved lost a host: the reservation was rolled back."""


# Operations numbered ahead of their completion. Many for a gang with one client, so that
# a chain of calls goes out as one batch; fewer for a shared gang, where numbering late is
# what lets each client's work interleave by its weight.
EXCLUSIVE_IN_FLIGHT = 256
SHARED_IN_FLIGHT = 32


def worker_name(gang_id: str, epoch: int, process_id: int) -> str:
    """The Ray actor name of a gang's worker (an epoch per start, so a restarted gang's
    workers never collide with its old ones)."""
    return f"slicewise-{gang_id}-e{epoch}-p{process_id}"


class Gang:
    """Everything the controller holds for one gang."""

    def __init__(
        self,
        gang_id: str,
        client: str,
        stype: SliceType,
        slices: Sequence[Slice],
        *,
        window: int = 3,
        spans: SpanRecorder | None = None,
    ) -> None:
        self.gang_id = gang_id
        self.client = client
        self.slice_type = stype
        self.slices = list(slices)
        self.shape = GangShape(len(slices), stype.hosts, stype.chips_per_host)
        self.simulated = all(s.simulated for s in slices)
        self.platform = "cpu" if self.simulated else "tpu"
        self.state = GangState.STARTING
        self.failure = ""
        self.epoch = 0
        self.created_at = time.time()
        self.loaded_programs: dict[str, Ticket] = {}
        self._window = window
        self._placement_groups: list[Any] = []
        self._workers: list[Any] = []
        self._channels: list[ControllerEnd] = []
        self.data_addresses: list[str] = []
        self.spans = spans or SpanRecorder()
        # Shared gangs: attachment id -> (client name, weight); programs run per attachment.
        self.priority = 0
        self.shared_name = ""
        self.dispatcher = self._new_dispatcher()
        self.attachments: dict[str, tuple[str, float]] = {}
        self.programs_run: Counter[str] = Counter()
        self.preempt_deadline = 0.0
        self._watchers: set[asyncio.Queue[tuple[str, str]]] = set()

    def _new_dispatcher(self) -> Dispatcher:
        return Dispatcher(
            self._send,
            self._poll,
            self.shape.num_processes,
            max_in_flight=SHARED_IN_FLIGHT if self.shared_name else EXCLUSIVE_IN_FLIGHT,
            on_broken=self._on_broken,
            observer=self._observe,
        )

    def share(self, name: str) -> None:
        """Makes this the shared gang `name` that several clients attach to."""
        self.shared_name = name
        self.dispatcher.max_in_flight = SHARED_IN_FLIGHT

    # -- events ---------------------------------------------------------------------

    def publish(self, kind: str, message: str) -> None:
        """Tells everyone watching the gang (clients, the job that holds it)."""
        log.info("gang %s: %s: %s", self.gang_id, kind, message)
        for queue in list(self._watchers):
            if queue.full():
                queue.get_nowait()
            queue.put_nowait((kind, message))

    def watch(self) -> asyncio.Queue[tuple[str, str]]:
        queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue(maxsize=100)
        self._watchers.add(queue)
        return queue

    def unwatch(self, queue: asyncio.Queue[tuple[str, str]]) -> None:
        self._watchers.discard(queue)

    # -- start ----------------------------------------------------------------------

    async def start(self, timeout_s: float, lost: Callable[[], str | None] = lambda: None) -> None:
        """Reserves the slices, starts the workers and forms the jax.distributed cluster.

        All or nothing: on any failure every placement group and worker created so far
        is removed before the error propagates. `lost()` names a reserved slice that lost
        a host meanwhile (from the inventory); the reservation is then rolled back at once.

        Raises:
            SliceLostError: a slice lost a host while it was being reserved.
            WorkerError: reservation, worker start or formation failed or timed out.
        """
        started = time.monotonic()
        self.epoch += 1
        self.state = GangState.STARTING
        self.dispatcher = self._new_dispatcher()
        self.loaded_programs.clear()
        try:
            await asyncio.wait_for(self._watched(self._reserve(), lost), timeout_s)
            await asyncio.wait_for(
                self._watched(self._form(), lost),
                max(30.0, timeout_s - (time.monotonic() - started)),
            )
        except BaseException as exc:
            await self.stop()
            self.state = GangState.FAILED
            if isinstance(exc, SliceLostError):
                raise
            if isinstance(exc, TimeoutError):
                raise WorkerError(
                    f"gang {self.gang_id} did not start within {timeout_s:.0f} s "
                    f"(slices {[s.name for s in self.slices]}); the hosts may be overloaded "
                    "or gone"
                ) from None
            if isinstance(exc, Exception):
                raise WorkerError(
                    f"gang {self.gang_id} failed to start: {type(exc).__name__}: {exc}"
                ) from exc
            raise
        self.state = GangState.READY
        log.info(
            "gang %s ready: %d slice(s) %s, %d workers, in %.1f s",
            self.gang_id,
            len(self.slices),
            [s.name for s in self.slices],
            len(self._workers),
            time.monotonic() - started,
        )

    async def _watched(self, work: Any, lost: Callable[[], str | None]) -> None:
        """Runs `work`, giving up as soon as a slice of the gang is lost."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                name = None if task.done() else lost()
                if name is not None:
                    task.cancel()
                    raise SliceLostError(
                        f"slice {name} lost a host while gang {self.gang_id} was starting on it"
                    )
            task.result()
        finally:
            if not task.done():
                task.cancel()

    async def restart(
        self,
        slices: Sequence[Slice],
        timeout_s: float,
        lost: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Starts the gang again (after preemption) on `slices`, with new workers: its
        arrays are gone; programs are loaded again on first use."""
        await self.stop()
        self.slices = list(slices)
        self.preempt_deadline = 0.0
        await self.start(timeout_s, lost)

    async def _reserve(self) -> None:
        """One placement group for the whole gang, one bundle per host, each pinned to its
        slice and host by label: Ray reserves all bundles of a group atomically, so the
        gang is held whole or not at all, never in part."""
        from ray.util.placement_group import placement_group

        bundles: list[dict[str, float]] = []
        selectors: list[dict[str, str]] = []
        for s in self.slices:
            for h in range(s.type.hosts):
                bundle = {"TPU": float(self.shape.chips_per_host)}
                if h == 0:
                    bundle[s.type.head_resource] = 1.0
                bundles.append(bundle)
                selectors.append({SLICE_NAME_LABEL: s.name, WORKER_ID_LABEL: str(h)})
        if _failpoint("reserve_delay_s"):
            await asyncio.sleep(_failpoint("reserve_delay_s"))  # see _failpoint
        self._placement_groups.append(
            placement_group(
                bundles,
                strategy="STRICT_SPREAD",
                name=f"slicewise-{self.gang_id}-e{self.epoch}",
                bundle_label_selector=selectors,
            )
        )
        await self._placement_groups[0].ready()

    async def _form(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from worker.actor import HostWorker

        remote_cls = ray.remote(HostWorker)
        token = secrets.token_hex(16)
        head = self.slices[0].host(0)
        (pg,) = self._placement_groups
        for s_index, s in enumerate(self.slices):
            for h in range(s.type.hosts):
                placement = HostPlacement(
                    s_index, h, len(self.slices), s.type.hosts, s.type.chips_per_host
                )
                env = (
                    simulated_host_env(placement)
                    if self.simulated
                    else tpu_host_env(placement, head.address)
                )
                self._workers.append(
                    remote_cls.options(
                        num_cpus=0,
                        resources={"TPU": float(s.type.chips_per_host)},
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            pg, placement_group_bundle_index=placement.process_id
                        ),
                        runtime_env={"env_vars": env},
                        max_concurrency=_WORKER_THREADS,
                        max_restarts=0,
                        name=worker_name(self.gang_id, self.epoch, placement.process_id),
                    ).remote(
                        self.gang_id,
                        self.shape,
                        placement.process_id,
                        window=self._window,
                        token=token,
                    )
                )
        coordinator = await self._workers[0].free_address.remote(head.address)
        infos = await asyncio.gather(
            *(
                w.initialize.remote(
                    coordinator,
                    self.epoch,
                    partition_index=i // self.shape.hosts_per_slice,
                    bind_address=coordinator if self.simulated else None,
                    timeout_s=120,
                )
                for i, w in enumerate(self._workers)
            )
        )
        self.platform = infos[0]["platform"]
        self.data_addresses = list(
            await asyncio.gather(*(w.data_address.remote() for w in self._workers))
        )
        self._channels = list(
            await asyncio.gather(
                *(
                    ControllerEnd.connect(address, token, self.epoch, self.describe_process(p))
                    for p, address in enumerate(self.data_addresses)
                )
            )
        )

    # -- running --------------------------------------------------------------------

    async def _send(self, worker: int, ops: list[Op]) -> None:
        await self._channels[worker].send(ops)

    async def _poll(self, worker: int) -> list[OpResult]:
        try:
            return await self._channels[worker].receive()
        except ChannelError as exc:
            raise WorkerError(str(exc)) from exc

    def describe_process(self, process_id: int) -> str:
        """`host 1 of slice sim-2-v5litepod-16` for a jax.distributed process id."""
        s, h = divmod(process_id, self.shape.hosts_per_slice)
        return f"host {h} of slice {self.slices[s].name}"

    def _on_broken(self, reason: str) -> None:
        metrics.FAILURES.labels("worker").inc()
        if self.state in (GangState.READY, GangState.PREEMPTING):
            self.state = GangState.FAILED
            self.failure = reason
            self.publish("failed", reason)

    def _observe(
        self, kind: str, seq: int, queued_ns: int, settled_ns: int, error: str | None
    ) -> None:
        metrics.OPERATIONS.labels(kind).inc()
        metrics.DISPATCH_SECONDS.labels(kind).observe((settled_ns - queued_ns) / 1e9)
        if error:
            metrics.FAILURES.labels("operation").inc()
        self.spans.record(
            f"dispatch {kind}",
            "dispatch",
            queued_ns // 1000,
            settled_ns // 1000,
            thread=f"gang {self.gang_id}",
            gang=self.gang_id,
            seq=seq,
            **({"error": error} if error else {}),
        )

    def process_names(self) -> list[str]:
        return [
            f"{self.describe_process(p)} (process {p})" for p in range(self.shape.num_processes)
        ]

    async def collect_spans(self, timeout_s: float = 10.0) -> list[tuple[str, list[Span]]]:
        """Every worker's spans, named by host; workers that do not answer are skipped."""
        replies = await asyncio.gather(
            *(asyncio.wait_for(w.trace_spans.remote(), timeout_s) for w in self._workers),
            return_exceptions=True,
        )
        return [
            (name, spans)
            for name, spans in zip(self.process_names(), replies, strict=True)
            if not isinstance(spans, BaseException)
        ]

    async def stage(self, key: str, array: np.ndarray, indices: Sequence[Sequence[Index]]) -> None:
        """Sends every worker its pieces of `array` over the data ports, all in parallel
        (each worker's thread cuts its own pieces, so copying overlaps sending)."""

        def send(address: str, mine: Sequence[Index]) -> None:
            datalink.put(address, key, [(i, np.asarray(array[i], order="C")) for i in mine])

        await asyncio.gather(
            *(
                asyncio.to_thread(send, address, mine)
                for address, mine in zip(self.data_addresses, indices, strict=True)
            )
        )

    async def read(self, pin_id: str) -> list[Pieces]:
        """Every worker's distinct pieces of a pinned array."""
        return list(
            await asyncio.gather(
                *(
                    asyncio.to_thread(datalink.get, address, pin_id)
                    for address in self.data_addresses
                )
            )
        )

    async def drop_pin(self, pin_id: str) -> None:
        await asyncio.gather(
            *(w.drop_pin.remote(pin_id) for w in self._workers), return_exceptions=True
        )

    async def worker_stats(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(w.stats.remote() for w in self._workers)))

    # -- stop -----------------------------------------------------------------------

    async def stop(self) -> None:
        """Kills the workers and frees the slices; safe to call more than once."""
        import ray
        from ray.util.placement_group import remove_placement_group

        await self.dispatcher.close(f"gang {self.gang_id} stopped")
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        for worker in self._workers:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)
        for pg in self._placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self._workers.clear()
        self._placement_groups.clear()
        if self.state is not GangState.FAILED:
            self.state = GangState.RELEASED
