"""A gang: whole slices reserved all at once, one worker per host, all joined into one
jax.distributed cluster, fed by one dispatch queue. Its life cycle is gangstate.py's
table; `Gang.transition` is the one place its state changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from controller import datalink, metrics
from controller.auth import current_identity
from controller.backend import (
    Channel,
    ClusterBackend,
    Coordination,
    HostBundle,
    Reservation,
    Worker,
    WorkerSpec,
)
from controller.channel import encode_batch
from controller.dispatch import Dispatcher, Ticket
from controller.gangstate import TRANSITIONS, GangState
from controller.health import WATCH_PERIOD_S, HostReport, diagnose
from controller.hostenv import HostPlacement, simulated_host_env, tpu_host_env
from controller.inventory import Slice
from controller.options import DEFAULT_OPTIONS, ControllerOptions
from slicewise.common import capability
from slicewise.common.errors import InvalidTransitionError, WorkerError
from slicewise.common.failpoints import failpoint, worker_env
from slicewise.common.framing import Pieces
from slicewise.common.mesh import GangShape, Index
from slicewise.common.ops import Completions, Op
from slicewise.common.topology import SliceType
from slicewise.common.trace import Span, SpanRecorder

log = logging.getLogger(__name__)


class SliceLostError(WorkerError):
    """A slice being reserved lost a host: the reservation was rolled back."""


# How often a start checks whether one of its slices lost a host meanwhile.
LOST_POLL_S = 0.25


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
        num_slices: int,
        *,
        backend: ClusterBackend,
        options: ControllerOptions = DEFAULT_OPTIONS,
        spans: SpanRecorder | None = None,
        lost_poll_s: float = LOST_POLL_S,
    ) -> None:
        self.gang_id = gang_id
        self.client = client
        # The tenant that allocated it (controller/auth.py); only it and admins see it.
        self.tenant = current_identity().tenant
        self.slice_type = stype
        self.slices: list[Slice] = []
        self.shape = GangShape(num_slices, stype.hosts, stype.chips_per_host)
        self.platform = ""
        self.state = GangState.QUEUED
        # Why the gang is in its state, in words that follow "gang g3 ...": the failure
        # of a FAILED gang, what a STOPPING gang is stopped for.
        self.why = ""
        self.epoch = 0
        self.preempted_by = ""  # the request this gang was last preempted for
        self.preempt_deadline = 0.0  # the end of its grace period (scheduler clock)
        self.priority = 0
        self.loaded_programs: dict[str, Ticket] = {}
        self.data_addresses: list[str] = []
        self.spans = spans or SpanRecorder()
        self._dispatch_spans = self.spans.describer(_dispatch_span)
        # Shared gangs: attachment id -> (client name, weight); programs run per attachment.
        self.shared_name = ""
        self.attachments: dict[str, tuple[str, float]] = {}
        self.programs_run: Counter[str] = Counter()
        # Calls that came on call streams, and the stream messages they came in.
        self.streamed_calls = 0
        self.stream_batches = 0
        # A stall this long on a worker fails the gang (controller/health.py); the job
        # that runs on the gang sets it from its step times. None: stalls are not judged.
        self.step_deadline_s: float | None = None
        self.lag_deadline_s: float | None = None  # see controller/health.py
        # When it last failed (time.time()), and when the fault behind that began, where
        # the heartbeats tell (a stall's start; 0: unknown).
        self.failed_at = 0.0
        self.fault_at = 0.0
        self.pids: list[int] = []  # its workers' process ids
        self._backend = backend
        self.options = options
        self._lost_poll_s = lost_poll_s
        self._reservation: Reservation | None = None
        self._token = ""  # the secret every worker connection shows (made in _form)
        self._workers: list[Worker] = []
        self._channels: list[Channel] = []
        # Stash actors started on the gang's hosts (a peer-recovering job's), dropped when
        # the gang stops unless handed over to the next gang (`hand_over_stashes`).
        self._stashes: set[str] = set()
        self._handed_over: set[str] = set()
        self._stopping: asyncio.Future[None] | None = None
        self._stopping_to: GangState | None = None
        self._watchers: set[asyncio.Queue[tuple[str, str]]] = set()
        self._health: asyncio.Task[None] | None = None
        self._coordination: Coordination | None = None
        self.dispatcher = self._new_dispatcher()

    # -- the life cycle -----------------------------------------------------------------

    def transition(self, new: GangState, *, why: str = "", epoch: int | None = None) -> bool:
        """The one place a gang's state changes; `why` says why, for messages. Entering
        STARTING bumps the epoch. A change from an older epoch (a start that has since
        been superseded) is ignored: returns False.

        Raises:
            InvalidTransitionError: the table does not allow it.
        """
        if epoch is not None and epoch != self.epoch:
            log.info(
                "gang %s: ignoring %s from epoch %d (now %d)",
                self.gang_id,
                new.value,
                epoch,
                self.epoch,
            )
            return False
        if new not in TRANSITIONS[self.state]:
            raise InvalidTransitionError(
                f"gang {self.gang_id}: {self.state.value} -> {new.value} is not allowed"
            )
        if new is GangState.STARTING:
            self.epoch += 1
        log.debug("gang %s: %s -> %s %s", self.gang_id, self.state.value, new.value, why)
        self.state = new
        self.why = why
        return True

    def _new_dispatcher(self) -> Dispatcher:
        dispatcher = Dispatcher(
            self._send,
            self._listen,
            self.shape.num_processes,
            name=f"gang {self.gang_id}",
            max_in_flight=(
                self.options.shared_in_flight
                if self.shared_name
                else self.options.exclusive_in_flight
            ),
            on_broken=functools.partial(self._on_broken, epoch=self.epoch),
            observer=self._observe,
            broadcast=self._broadcast,
            hurry=self._hurry,
        )
        for attachment, (_, weight) in self.attachments.items():
            dispatcher.set_weight(attachment, weight)
        return dispatcher

    def share(self, name: str) -> None:
        """Makes this the shared gang `name` that several clients attach to."""
        self.shared_name = name
        self.dispatcher.max_in_flight = self.options.shared_in_flight

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

    async def start(
        self,
        slices: Sequence[Slice],
        timeout_s: float,
        lost: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Reserves `slices`, starts the workers and forms the jax.distributed cluster
        (from QUEUED, or from PREEMPTED to resume on new workers: arrays are gone, and
        programs load again on first use).

        All or nothing: on any failure every reservation and worker created so far is
        removed (STOPPING, then QUEUED) before the error propagates. `lost()` names a
        slice of the gang that lost a host meanwhile; the start is then rolled back at once.

        Raises:
            SliceLostError: a slice lost a host while it was being reserved.
            WorkerError: reservation, worker start or formation failed or timed out.
        """
        started = time.monotonic()
        self.transition(GangState.STARTING)
        epoch = self.epoch
        self.failed_at = self.fault_at = 0.0
        self.slices = list(slices)
        self.platform = "cpu" if self.simulated else "tpu"
        self.dispatcher = self._new_dispatcher()
        self.loaded_programs.clear()
        try:
            await asyncio.wait_for(self._watched(self._reserve(), lost), timeout_s)
            await asyncio.wait_for(
                self._watched(self._form(), lost),
                max(30.0, timeout_s - (time.monotonic() - started)),
            )
        except BaseException as exc:
            await self.stop(GangState.QUEUED, f"could not start: {exc}")
            if isinstance(exc, TimeoutError):
                raise WorkerError(
                    f"gang {self.gang_id} did not start within {timeout_s:.0f} s "
                    f"(slices {[s.name for s in self.slices]}); the hosts may be overloaded "
                    "or gone"
                ) from None
            if isinstance(exc, Exception) and not isinstance(exc, SliceLostError):
                words = self._backend.last_words(exc)
                raise WorkerError(
                    f"gang {self.gang_id} failed to start: {type(exc).__name__}: {exc}"
                    + (f"\nThe worker's last output (stderr):\n{words}" if words else "")
                ) from exc
            raise
        # The workers' heartbeats are read from now on, whether or not work is sent.
        self.dispatcher.start()
        self.transition(GangState.READY, epoch=epoch)
        self._health = asyncio.ensure_future(self._watch_health(epoch))
        log.info(
            "gang %s ready: %d slice(s) %s, %d workers, in %.1f s",
            self.gang_id,
            len(self.slices),
            [s.name for s in self.slices],
            len(self._workers),
            time.monotonic() - started,
        )

    @property
    def simulated(self) -> bool:
        """Whether the gang's slices are simulated hosts (CPU devices)."""
        return bool(self.slices) and all(s.simulated for s in self.slices)

    async def _watched(self, work: Any, lost: Callable[[], str | None]) -> None:
        """Runs `work`, giving up as soon as a slice of the gang is lost."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self._lost_poll_s)
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

    async def _reserve(self) -> None:
        """One reservation for the whole gang, one bundle per host (all or nothing)."""
        hosts = [
            HostBundle(s.name, h, s.type.chips_per_host, s.type.head_resource if h == 0 else "")
            for s in self.slices
            for h in range(s.type.hosts)
        ]
        delay = failpoint("reserve_delay_s")
        if delay:
            # Tests wait for this line to know the reservation is paused here.
            log.info("gang %s: failpoint: pausing %g s before reserving", self.gang_id, delay)
            await asyncio.sleep(delay)
        self._reservation = self._backend.reserve(f"slicewise-{self.gang_id}-e{self.epoch}", hosts)
        await self._reservation.ready()

    async def _form(self) -> None:
        """Starts a worker per host and joins them into one jax.distributed cluster."""
        assert self._reservation is not None
        token = self._token = secrets.token_hex(16)
        head = self.slices[0].host(0)
        for s_index, s in enumerate(self.slices):
            for h in range(s.type.hosts):
                placement = HostPlacement(
                    s_index, h, len(self.slices), s.type.hosts, s.type.chips_per_host
                )
                env = (
                    simulated_host_env(placement)
                    if self.simulated
                    else tpu_host_env(placement, head.address)
                ) | worker_env()
                if self.options.compilation_cache_dir:
                    env["JAX_COMPILATION_CACHE_DIR"] = self.options.compilation_cache_dir
                spec = WorkerSpec(
                    worker_name(self.gang_id, self.epoch, placement.process_id),
                    self.gang_id,
                    self.shape,
                    placement.process_id,
                    s.type.chips_per_host,
                    env,
                    self.options.worker_window,
                    token,
                )
                self._workers.append(self._backend.start_worker(self._reservation, spec))
        self._coordination = await asyncio.to_thread(
            self._backend.coordination_service,
            self._controller_address(),
            self.shape.num_processes,
        )
        # Process 0 starts a service of its own (see coordination.py): a port nobody uses.
        unused = await self._workers[0].free_address(head.address)
        infos = await asyncio.gather(
            *(
                w.initialize(
                    self._coordination.address,
                    self.epoch,
                    partition_index=i // self.shape.hosts_per_slice,
                    bind_address=unused,
                    timeout_s=120,
                )
                for i, w in enumerate(self._workers)
            )
        )
        self.platform = infos[0]["platform"]
        self.pids = [int(info["pid"]) for info in infos]
        self.data_addresses = list(await asyncio.gather(*(w.data_address() for w in self._workers)))
        self._channels = list(
            await asyncio.gather(
                *(
                    self._backend.connect(address, token, self.epoch, self.describe_process(p))
                    for p, address in enumerate(self.data_addresses)
                )
            )
        )

    def _controller_address(self) -> str:
        """Where this controller is reachable from the gang's hosts."""
        if self.simulated:
            return "127.0.0.1"
        import ray

        return str(ray.util.get_node_ip_address())

    # -- running --------------------------------------------------------------------

    def _hurry(self, worker: int, seq: int) -> None:
        self._channels[worker].hurry(seq)

    async def _send(self, worker: int, ops: list[Op]) -> None:
        await self._channels[worker].send(ops)

    async def _broadcast(self, ops: list[Op]) -> None:
        """The same batch to every worker: encoded once, written to every channel, then
        waited for (a drain returns at once unless that worker's socket is full)."""
        frames = encode_batch(ops)
        channels = list(self._channels)
        for channel in channels:
            channel.write(ops, frames)
        for channel in channels:
            await channel.drain()

    def _listen(
        self,
        worker: int,
        on_results: Callable[[Completions], None],
        on_error: Callable[[Exception], None],
    ) -> None:
        self._channels[worker].listen(on_results, lambda exc: on_error(WorkerError(str(exc))))

    def describe_process(self, process_id: int) -> str:
        """`host 1 of slice sim-2-v5litepod-16` for a jax.distributed process id."""
        s, h = divmod(process_id, self.shape.hosts_per_slice)
        return f"host {h} of slice {self.slices[s].name}"

    def host_reports(self, since_compile_s: float = float("inf")) -> list[HostReport]:
        """What each worker's channel last said (controller/health.py), a stall counted
        from `since_compile_s` ago at most."""
        now = time.monotonic()
        return [
            HostReport(
                self.describe_process(p),
                now - channel.heard_at,
                int(channel.progress.get("oldest_seq", 0)),
                str(channel.progress.get("oldest_kind", "")),
                min(float(channel.progress.get("stalled_s", 0.0)), since_compile_s),
                str(channel.progress.get("compiling", "")),
            )
            for p, channel in enumerate(list(self._channels))
        ]

    async def _watch_health(self, epoch: int) -> None:
        """Fails the gang when a worker stops answering or a collective is stuck (see
        controller/health.py); ends when the gang stops or starts again."""
        compiled_at = time.monotonic()  # when a host was last seen compiling
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            if self.epoch != epoch or not self.state.usable:
                return
            now = time.monotonic()
            if any(c.progress.get("compiling") for c in self._channels):
                compiled_at = now
            # Time spent waiting for a host that compiled is no stall: the others wait
            # for it in the program's first collective, and it completes nothing meanwhile.
            reports = self.host_reports(now - compiled_at)
            reason = diagnose(
                reports,
                heartbeat_timeout_s=self.options.heartbeat_timeout_s,
                step_deadline_s=self.step_deadline_s,
                lag_deadline_s=self.lag_deadline_s,
            )
            if reason is not None:
                quiet = max(max(r.stalled_s, r.silent_s) for r in reports)
                self.fault_at = time.time() - quiet
                self.dispatcher.fail(reason)
                return

    def _on_broken(self, reason: str, epoch: int) -> None:
        """The dispatcher of `epoch` lost a worker: the gang fails, if it was running."""
        metrics.FAILURES.labels("worker").inc()
        if self.state.usable and self.transition(GangState.FAILED, why=reason, epoch=epoch):
            self.failed_at = time.time()
            self.publish("failed", reason)

    async def prepare_stashes(self, names: Sequence[str]) -> None:
        """Starts stash actor `names[p]` on the host of worker p, for every worker.

        It may still run when the gang stops (a job starts them beside its first steps):
        a worker may then have started its stash after the stop dropped the gang's
        stashes, so once every worker has answered or died, those not handed over to the
        next gang are dropped again (a stash is detached: nothing else would end it)."""
        self._stashes.update(names)
        try:
            await asyncio.gather(
                *(w.prepare_stash(name) for w, name in zip(self._workers, names, strict=True))
            )
        finally:
            if not self._workers:  # stopped meanwhile
                for name in set(names) - self._handed_over:
                    with contextlib.suppress(Exception):
                        self._backend.drop_stash(name)

    async def log_tails(self, lines: int, timeout_s: float = 10.0) -> list[tuple[str, str]]:
        """(host, the last `lines` lines of its worker's stderr) per worker; what could
        not be read says why instead."""

        async def tail(worker: Worker) -> str:
            try:
                return await asyncio.wait_for(worker.log_tail(lines), timeout_s)
            except Exception as exc:  # noqa: BLE001 - the other hosts' tails still count
                return f"(its stderr could not be read: {type(exc).__name__}: {exc})\n"

        tails = await asyncio.gather(*(tail(w) for w in list(self._workers)))
        return [(self.describe_process(p), text) for p, text in enumerate(tails)]

    async def prepare_data(self, program: str, overrides: tuple[tuple[str, str], ...]) -> None:
        """Has every worker begin loading the data of the program's batches."""
        await asyncio.gather(*(w.prepare_data(program, overrides) for w in self._workers))

    async def stash_state(self, process_id: int, name: str, handles: list[str]) -> int:
        """Has one worker copy its pieces of the arrays into a stash on its host."""
        self._stashes.add(name)
        return await self._workers[process_id].stash_state(name, handles)

    def hand_over_stashes(self, names: Sequence[str]) -> None:
        """The stashes `names` outlive this gang (a recovery reads them on the next one)."""
        self._stashes.difference_update(names)
        self._handed_over.update(names)

    def drop_stash(self, name: str) -> None:
        self._stashes.discard(name)
        self._backend.drop_stash(name)

    def kill_worker(self, process_id: int) -> None:
        """Fault injection: SIGKILL for one worker's process (through Ray when the host is
        not this machine's simulation)."""
        if self.simulated:
            os.kill(self.pids[process_id], signal.SIGKILL)
        else:
            self._backend.kill(self._workers[process_id])

    def _observe(
        self, kind: str, seq: int, queued_ns: int, settled_ns: int, error: str | None
    ) -> None:
        metrics.OPERATIONS.tally(kind).observe((settled_ns - queued_ns) / 1e9)
        if error:
            metrics.FAILURES.labels("operation").inc()
        self.spans.record_later(
            queued_ns // 1000,
            settled_ns // 1000,
            self._dispatch_spans,
            self.gang_id,
            kind,
            seq,
            error,
        )

    def process_names(self) -> list[str]:
        return [
            f"{self.describe_process(p)} (process {p})" for p in range(self.shape.num_processes)
        ]

    async def collect_spans(
        self, timeout_s: float = 10.0, *, last: int = 0
    ) -> list[tuple[str, list[Span]]]:
        """Every worker's spans (with `last`, its most recent `last`), named by host;
        workers that do not answer are skipped."""
        if not self._workers:
            return []
        replies = await asyncio.gather(
            *(asyncio.wait_for(w.trace_spans(last=last), timeout_s) for w in self._workers),
            return_exceptions=True,
        )
        collected = []
        for name, spans in zip(self.process_names(), replies, strict=True):
            if isinstance(spans, BaseException):
                # Its track is missing from the timeline: say which, and why.
                log.warning(
                    "gang %s: no spans from %s (%s: %s)",
                    self.gang_id,
                    name,
                    type(spans).__name__,
                    str(spans) or f"no answer in {timeout_s:g} s",
                )
            else:
                collected.append((name, spans))
        return collected

    async def stage(self, key: str, array: np.ndarray, indices: Sequence[Sequence[Index]]) -> None:
        """Sends every worker its pieces of `array` over the data ports, all in parallel
        (each worker's thread cuts its own pieces, so copying overlaps sending)."""

        def send(address: str, mine: Sequence[Index]) -> None:
            datalink.put(
                address, self._token, key, [(i, np.asarray(array[i], order="C")) for i in mine]
            )

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
                    asyncio.to_thread(datalink.get, address, self._token, pin_id)
                    for address in self.data_addresses
                )
            )
        )

    def capability(self, op: str, key: str, expires_unix_s: int, nbytes: int = 0) -> str:
        """A client's right to `op` ("put" or "get") `key` at this gang's data ports
        until `expires_unix_s` (slicewise/common/capability.py)."""
        return capability.issue(self._token, op, key, expires_unix_s, nbytes)

    async def drop_staged(self, key: str, expires_unix_s: int) -> None:
        """Drops the pieces of an abandoned direct put from every worker (also those
        still on their way); workers that do not answer are skipped."""
        await asyncio.gather(
            *(
                asyncio.to_thread(datalink.drop, address, self._token, key, expires_unix_s)
                for address in self.data_addresses
            ),
            return_exceptions=True,
        )

    async def drop_pin(self, pin_id: str) -> None:
        await asyncio.gather(*(w.drop_pin(pin_id) for w in self._workers), return_exceptions=True)

    async def worker_stats(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(w.stats() for w in self._workers)))

    async def compiled_text(self, program_id: str) -> str:
        """The compiled HLO of a loaded program, from the worker of process 0 (every
        process compiles the same partitioned module)."""
        return await self._workers[0].compiled_text(program_id)

    # -- stop -----------------------------------------------------------------------

    def stop(self, then: GangState, why: str) -> asyncio.Future[None]:
        """Closes the dispatcher, stops the workers and frees the reservation, passing
        through STOPPING to `then` (QUEUED, PREEMPTED, FAILED or RELEASED); resolves when
        done. The gang is STOPPING (unusable) as soon as this returns, unless a stop is
        already under way: this one then follows it. Cancelling a waiter does not cancel
        the stop.

        Raises:
            InvalidTransitionError: the gang cannot be stopped from its state.
        """
        if self._stopping is not None:
            return asyncio.ensure_future(self._stop_later(then, why))
        self.transition(GangState.STOPPING, why=why)
        self._stopping_to = then
        self._stopping = asyncio.ensure_future(self._stop_then(then, why))
        return asyncio.shield(self._stopping)

    async def _stop_later(self, then: GangState, why: str) -> None:
        await self.wait_stopped()
        await self.stop(then, why)

    async def wait_stopped(self) -> None:
        """Returns once no stop is under way."""
        while self._stopping is not None:
            await asyncio.shield(self._stopping)

    @property
    def stopping_to(self) -> GangState | None:
        """The state a stop under way leads to (None when none is)."""
        return self._stopping_to

    async def _stop_then(self, then: GangState, why: str) -> None:
        if self._health is not None:
            self._health.cancel()
            self._health = None
        try:
            await self.dispatcher.close(f"gang {self.gang_id} {why}")
            for channel in self._channels:
                channel.close()
            for worker in self._workers:
                with contextlib.suppress(Exception):
                    self._backend.kill(worker)
            for name in sorted(self._stashes):
                with contextlib.suppress(Exception):
                    self.drop_stash(name)
            if self._reservation is not None:
                with contextlib.suppress(Exception):
                    self._backend.remove(self._reservation)
            if self._coordination is not None:
                await asyncio.to_thread(self._coordination.stop)
                self._coordination = None
            self._channels.clear()
            self._workers.clear()
            self._reservation = None
        finally:
            self._stopping = None
            self._stopping_to = None
            self.transition(then, why=why)


def _dispatch_span(
    gang_id: str, kind: str, seq: int, error: str | None
) -> tuple[str, str, str, dict[str, Any]]:
    """How an operation's "dispatch" span is described (Gang._observe)."""
    args: dict[str, Any] = {"gang": gang_id, "seq": seq}
    if error:
        args["error"] = error
    return f"dispatch {kind}", "dispatch", f"gang {gang_id}", args
