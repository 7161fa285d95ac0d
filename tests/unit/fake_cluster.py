"""An in-memory ClusterBackend (controller/backend.py) for unit tests: a node table the
test edits, reservations the test makes ready or fail when it likes, workers and control
channels that complete every operation at once. Every call is recorded, so a test can
check what was reserved, started, killed and removed, and that nothing is left behind."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import grpc

from controller.backend import HostBundle, Reservation, Worker, WorkerSpec
from controller.simcluster import host_labels, host_resources, slice_names
from slicewise.common.framing import ChannelError
from slicewise.common.ops import Completions, Op, OpResult
from slicewise.common.topology import SliceType, slice_type


class Clock:
    """A clock the test moves by hand (the scheduler's deadlines, grace periods)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeReservation:
    """A reservation that is ready when the test (or `FakeCluster.auto_ready`) says."""

    def __init__(self, name: str, hosts: list[HostBundle]) -> None:
        self.name = name
        self.hosts = hosts
        self.outcome: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.removed = False

    async def ready(self) -> None:
        await asyncio.shield(self.outcome)

    @property
    def slices(self) -> list[str]:
        return sorted({h.slice_name for h in self.hosts})

    def make_ready(self) -> None:
        self.outcome.set_result(None)

    def fail(self, error: Exception) -> None:
        self.outcome.set_exception(error)


class FakeWorker:
    """A worker actor that answers at once."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.killed = False
        self.epoch = 0
        self.dropped_pins: list[str] = []

    async def free_address(self, host: str) -> str:
        return f"{host}:8476"

    async def initialize(
        self,
        coordinator: str,
        epoch: int,
        *,
        partition_index: int,
        bind_address: str | None,
        timeout_s: int,
    ) -> dict[str, Any]:
        self.epoch = epoch
        return {"platform": "cpu", "pid": 100 + self.spec.process_id}

    async def data_address(self) -> str:
        return f"fake-{self.spec.name}:9000"

    async def stats(self) -> dict[str, Any]:
        return {"process_id": self.spec.process_id, "pid": 100 + self.spec.process_id}

    async def trace_spans(self, last: int = 0) -> list[Any]:
        return []

    async def drop_pin(self, pin_id: str) -> None:
        self.dropped_pins.append(pin_id)

    async def prepare_stash(self, name: str) -> None:
        return None

    async def stash_state(self, name: str, handles: list[str]) -> int:
        return 0

    async def prepare_data(self, program: str, overrides: tuple[tuple[str, str], ...]) -> None:
        return None

    async def log_tail(self, lines: int) -> str:
        return f"{self.spec.name}: started\n"


class FakeChannel:
    """A control channel whose worker completes every operation as soon as it arrives;
    `die()` makes it fail as a channel to a killed worker process does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: list[Op] = []
        self.hurried: list[int] = []  # the operations the controller said it waits for
        self.closed = False
        self.progress: dict[str, Any] = {}
        # Operations of these types stay in flight until `complete_held()`.
        self.hold: tuple[type[Op], ...] = ()
        self._held: list[OpResult] = []
        self._listener: tuple[Any, Any] | None = None
        self._pending: list[list[OpResult] | ChannelError] = []  # before anyone listened

    @property
    def heard_at(self) -> float:
        """A fake worker always answers (a dead one fails its channel instead)."""
        return time.monotonic()

    async def send(self, ops: list[Op]) -> None:
        self.write(ops, [])

    def write(self, ops: list[Op], frames: list[bytes]) -> None:
        self.sent.extend(ops)
        self._held += [OpResult(op.seq) for op in ops if isinstance(op, self.hold)]
        done = [OpResult(op.seq) for op in ops if not isinstance(op, self.hold)]
        if done:
            self._push(done)

    async def drain(self) -> None:
        return None

    def hurry(self, seq: int) -> None:
        self.hurried.append(seq)

    def complete_held(self) -> None:
        """Completes the held operations (see `hold`)."""
        if self._held:
            self._push(self._held)
            self._held = []

    def listen(self, on_results: Any, on_error: Any) -> None:
        self._listener = (on_results, on_error)
        pending, self._pending = self._pending, []
        for item in pending:
            self._push(item)

    def _push(self, item: list[OpResult] | ChannelError) -> None:
        """Hands `item` to the listener in a callback of its own, as a channel does with
        each frame it reads."""
        if self._listener is None:
            self._pending.append(item)
            return
        on_results, on_error = self._listener
        if isinstance(item, ChannelError):
            self._listener = None
            asyncio.get_running_loop().call_soon(on_error, item)
        else:
            asyncio.get_running_loop().call_soon(on_results, Completions.of(item))

    def die(self) -> None:
        self._push(
            ChannelError(
                f"{self.name} closed its control channel (the worker process died or was killed)"
            )
        )

    def close(self) -> None:
        self.closed = True


class FakeCluster:
    """Simulated v5e slices as a node table, and the backend calls made against them."""

    def __init__(self, *types: str, auto_ready: bool = True) -> None:
        self.auto_ready = auto_ready
        self.alive: dict[tuple[str, int], bool] = {}
        self.types: dict[str, SliceType] = {}
        for name, stype in zip(
            slice_names([slice_type(t) for t in types]), map(slice_type, types), strict=True
        ):
            self.types[name] = stype
            for h in range(stype.hosts):
                self.alive[(name, h)] = True
        self.reservations: list[FakeReservation] = []
        self.workers: list[FakeWorker] = []
        self.channels: list[FakeChannel] = []
        self.calls: list[tuple[str, str]] = []  # (what, name), in order
        # What `last_words` reports of any failure: a dead worker's stderr, as a test sets it.
        self.dying_words = ""

    # -- what the test does -------------------------------------------------------------

    def kill_host(self, slice_name: str, worker_id: int = 0) -> None:
        self.alive[(slice_name, worker_id)] = False

    async def reservation(self, index: int = -1, timeout_s: float = 5.0) -> FakeReservation:
        """The reservation at `index` once it exists (-1: the next one not yet removed)."""

        async def appeared() -> FakeReservation:
            while True:
                live = [r for r in self.reservations if not r.removed and not r.outcome.done()]
                if index == -1 and live:
                    return live[0]
                if index >= 0 and len(self.reservations) > index:
                    return self.reservations[index]
                await asyncio.sleep(0.001)

        return await asyncio.wait_for(appeared(), timeout_s)

    def held(self) -> list[FakeReservation]:
        """Reservations not removed."""
        return [r for r in self.reservations if not r.removed]

    def live_workers(self) -> list[FakeWorker]:
        return [w for w in self.workers if not w.killed]

    # -- ClusterBackend -----------------------------------------------------------------

    def nodes(self) -> list[dict[str, Any]]:
        return [
            {
                "NodeID": f"node-{name}-{h}",
                "NodeManagerAddress": f"10.0.{list(self.types).index(name)}.{h}",
                "Alive": alive,
                "Resources": host_resources(name, self.types[name], h),
                "Labels": host_labels(name, self.types[name], h),
            }
            for (name, h), alive in self.alive.items()
        ]

    def reserve(self, name: str, hosts: Any) -> Reservation:
        reservation = FakeReservation(name, list(hosts))
        self.reservations.append(reservation)
        self.calls.append(("reserve", name))
        if self.auto_ready:
            reservation.make_ready()
        return reservation

    def start_worker(self, reservation: Reservation, spec: WorkerSpec) -> Worker:
        assert isinstance(reservation, FakeReservation) and not reservation.removed
        worker = FakeWorker(spec)
        self.workers.append(worker)
        self.calls.append(("start", spec.name))
        return worker

    async def connect(self, address: str, token: str, epoch: int, name: str) -> FakeChannel:
        channel = FakeChannel(name)
        self.channels.append(channel)
        return channel

    def kill(self, worker: Worker) -> None:
        assert isinstance(worker, FakeWorker)
        worker.killed = True
        self.calls.append(("kill", worker.spec.name))

    def coordination_service(self, host: str, num_processes: int) -> Any:
        return SimpleNamespace(address=f"{host}:8476", stop=lambda: None)

    def drop_stash(self, name: str) -> None:
        self.calls.append(("drop_stash", name))

    def remove(self, reservation: Reservation) -> None:
        assert isinstance(reservation, FakeReservation)
        reservation.removed = True
        self.calls.append(("remove", reservation.name))

    def last_words(self, error: BaseException) -> str:
        return self.dying_words


class FakeContext:
    """What the servicer needs of a gRPC context: `abort` records and raises."""

    def __init__(self) -> None:
        self.code = None
        self.details = ""

    def peer(self) -> str:
        return "test"

    async def abort(self, code: Any, details: str) -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError()
