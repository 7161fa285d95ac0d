"""The controller's state and behaviour, independent of gRPC: gangs, programs, arrays.

The servicer (servicer.py) is a thin shell that turns protobuf messages into calls
here and errors from here into gRPC status codes. Everything here runs on one asyncio
loop; anything slow (deserializing, copying large arrays, Ray's blocking calls) runs in
a thread so that one client's upload never stalls another client's dispatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from controller import metrics
from controller.admission import GangManager
from controller.arrays import ArrayRecord, ArrayTable
from controller.backend import ClusterBackend, RayBackend
from controller.dispatch import Ticket
from controller.gang import Gang
from controller.gangstate import GangState
from controller.inventory import check_can_ever_fit
from controller.journal import Journal
from controller.options import DEFAULT_OPTIONS, ControllerOptions
from controller.programs import Program, ProgramRegistry, load_program, program_id_of
from controller.scheduler import Scheduler
from controller.timelines import TimelineArchive
from slicewise.common import heap
from slicewise.common.arrays import ArraySpec, dtype_of
from slicewise.common.errors import (
    CapacityError,
    DeadlineError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    SlicewiseError,
    WorkerError,
)
from slicewise.common.framing import TransportError
from slicewise.common.mesh import MeshSpec, ShardingSpec, index_key
from slicewise.common.ops import (
    BatchOp,
    CloseCheckpointsOp,
    DeleteOp,
    ExecOp,
    HangOp,
    LoadOp,
    PeerRestoreOp,
    PinOp,
    PutOp,
    RestoreOp,
    SaveOp,
)
from slicewise.common.topology import HBM_BYTES_PER_CHIP, slice_type
from slicewise.common.trace import SpanRecorder, chrome_trace
from slicewise.common.trace import now_us as trace_now_us

log = logging.getLogger(__name__)

# How many ended gangs of an earlier run a restarted controller can still explain.
_REMEMBERED_GANGS = 10_000
ARCHIVE_WAIT_S = 30.0
# The longest a wait or fetch waits for the call-stream batch it names to be queued, and
# the most call streams tracked at once (waits for more do not wait).
STREAM_WAIT_S = 25.0  # under the client's margin over a wait's timeout (30 s)
# The most runs one streamed call may ask for (StreamCall.repeat).
MAX_REPEAT = 1_000_000
MAX_STREAMS = 100_000  # the longest a trace waits for a gang being released to be archived

VERSION = "0.1.0"


@dataclass
class PutTarget:
    """A validated upload, waiting for its bytes."""

    gang: Gang
    client: str  # the attachment that uploads (shared gangs)
    spec: ArraySpec
    sharding: ShardingSpec
    buffer: np.ndarray  # uint8, spec.nbytes long (empty for a direct put)


@dataclass(frozen=True)
class HostPlan:
    """One host's part in a direct transfer: where, with what right, which pieces."""

    process_id: int
    address: str
    capability: str
    pieces: tuple[tuple[tuple[int, int], ...], ...]  # a put's: (start, stop) per dimension


@dataclass
class DirectTransfer:
    """A direct put or fetch the controller authorized: its client moves the bytes
    to or from the workers itself, until it finishes or its capabilities expire."""

    transfer_id: str  # also the key of its pieces (put) or pin (fetch) on the workers
    op: str  # "put" or "get"
    gang: Gang
    epoch: int  # the gang's, when it began: a gang started again lost what it staged
    expires_unix_s: int
    hosts: list[HostPlan]
    target: PutTarget | None = None  # a put's
    record: ArrayRecord | None = None  # a fetch's
    began: float = 0.0  # time.perf_counter()
    timer: asyncio.TimerHandle | None = None


class Controller:
    """One controller: its gangs (admission.py), programs, and every remote array."""

    def __init__(
        self,
        *,
        backend: ClusterBackend | None = None,
        clock: Callable[[], float] = time.monotonic,
        simulated: bool = False,
        options: ControllerOptions = DEFAULT_OPTIONS,
        journal: Journal | None = None,
    ) -> None:
        """`journal`: where gangs are recorded and their ids numbered, so that a restarted
        controller knows the gangs lost with its predecessor and never reuses their ids."""
        self.simulated = simulated
        self.options = options
        # The embedded simulation's supervisor (controller/simcluster.py), when there is
        # one: fault injection removes hosts through it.
        self.simulation: Any = None
        self.started_at = time.time()
        self.programs = ProgramRegistry()
        self.arrays = ArrayTable()
        self.spans = SpanRecorder()
        self.manager = GangManager(
            backend or RayBackend(),
            clock=clock,
            options=options,
            spans=self.spans,
            on_released=self._gang_stopped,
            next_id=(lambda: journal.next_number("gang")) if journal else None,
            gone=self._lost_gangs(journal) if journal else None,
        )
        self.arrays.visible = self.manager.visible  # tenants see only their gangs' arrays
        self.journal = journal
        # Timelines of released gangs (theirs and their workers' spans), so a trace can
        # still be taken afterwards; the live recorder keeps only those of held gangs.
        self.timelines = TimelineArchive()
        # Gangs being released: set once their timelines are archived (a trace asked for
        # in between waits for that rather than finding neither the gang nor its archive).
        self._archiving: dict[str, asyncio.Event] = {}
        # Call streams by handle prefix ("<gang>/c<tag>"): how far each is queued.
        self._streams: dict[str, StreamProgress] = {}
        self._gauges: asyncio.Task[None] | None = None
        self._unpinning: set[asyncio.Task[None]] = set()  # see _unpin
        # Direct puts and fetches under way, by transfer id (see begin_direct_put).
        self._transfers: dict[str, DirectTransfer] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        self._journalled: set[str] = set()

    @property
    def scheduler(self) -> Scheduler:
        return self.manager.scheduler

    @property
    def gangs(self) -> dict[str, Gang]:
        return self.manager.gangs

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        await self.manager.start()
        self._gauges = asyncio.create_task(self._update_gauges_forever(), name="gauges")

    async def shutdown(self) -> None:
        from controller.programs import stop_reader

        if self._gauges is not None:
            self._gauges.cancel()
        await self.manager.shutdown("was stopped with the controller")
        await asyncio.to_thread(stop_reader)

    async def refresh_inventory(self) -> None:
        await self.manager.refresh_inventory()

    def _update_gauges(self) -> None:
        states = {"free": 0, "held": 0, "broken": 0}
        for s in self.scheduler.inventory.values():
            held = self.scheduler.holder(s.name) is not None
            states["held" if held else "free" if s.intact else "broken"] += 1
        for state, count in states.items():
            metrics.SLICES.labels(state).set(count)
        metrics.QUEUE_LENGTH.set(len(self.scheduler.queued()))
        metrics.GANGS.set(len(self.gangs))

    async def _update_gauges_forever(self) -> None:
        while True:
            self._update_gauges()
            await asyncio.sleep(1.0)

    # -- gangs ----------------------------------------------------------------------

    async def allocate(
        self, num_slices: int, slice_type_name: str, **kwargs: Any
    ) -> tuple[Gang, str]:
        """Admits and starts a gang; returns it and the id its caller uses (see
        GangManager.allocate for the options)."""
        result = await self.manager.allocate(num_slices, slice_type_name, **kwargs)
        gang, _ = result
        if self.journal is not None and gang.gang_id not in self._journalled:
            self._journalled.add(gang.gang_id)  # once, though a shared gang is attached to
            self.journal.add_gang(
                gang.gang_id, gang.client, (s.name for s in gang.slices), time.time()
            )
        self._update_gauges()
        return result

    async def release(
        self, gang_id: str, why: str = "was released", *, requeue: bool = False
    ) -> None:
        """Releases a gang, or detaches an attachment of a shared one (see
        GangManager.release); keeps the workers' timelines for a later trace."""
        gang, attachment = self.manager.resolve(gang_id, usable=False)
        if requeue or (attachment and len(gang.attachments) > 1):
            await self.manager.release(gang_id, why, requeue=requeue)
            self._update_gauges()
            return
        archived = self._archiving.setdefault(gang.gang_id, asyncio.Event())
        try:
            # A failed gang's lost workers never answer, and a job waits to recover. A
            # live worker answers in milliseconds, but under load 5 s was once too few
            # and its host was missing from the archived trace.
            wait = 1.0 if gang.state is GangState.FAILED else 15.0
            share = self.timelines.share(gang.shape.num_processes + 1)
            hosts = await gang.collect_spans(timeout_s=wait, last=share)
            await self.manager.release(gang_id, why, requeue=requeue)
            if hosts and gang.state is GangState.RELEASED:
                # Beside the controller's track, which `_gang_stopped` archived.
                tracks = [*(self.timelines.get(gang.gang_id) or []), *hosts]
                self.timelines.add(gang.gang_id, tracks)
        finally:
            archived.set()
            self._archiving.pop(gang.gang_id, None)
        self._update_gauges()

    def _gang_stopped(self, gang: Gang, why: str) -> None:
        dropped = self.arrays.drop_gang(gang.gang_id, why)
        log.info("gang %s %s (%d arrays freed)", gang.gang_id, why, dropped)
        if gang.state is GangState.RELEASED:
            mine = self.spans.remove(where={"gang": gang.gang_id})
            self.timelines.add(gang.gang_id, [("controller", mine)])
        if self.journal is not None and gang.state is GangState.RELEASED:
            self._journalled.discard(gang.gang_id)
            self.journal.end_gang(gang.gang_id, why, time.time())

    @staticmethod
    def _lost_gangs(journal: Journal) -> dict[str, str]:
        """Why the gang ids of an earlier controller on this journal name no gang now:
        those it left running stopped with it (Ray ends the actors of a driver that
        exits), and are recorded as ended here; the others ended before it did."""
        lost = "was lost when the controller restarted (its workers stopped with the old one)"
        gone = {
            gang_id: f"{why} (before the controller restarted)"
            for gang_id, why in journal.ended_gangs(_REMEMBERED_GANGS)
        }
        for gang_id, client in journal.running_gangs():
            log.info("gang %s of %s %s", gang_id, client or "a client", lost)
            journal.end_gang(gang_id, lost, time.time())
            gone[gang_id] = lost
        return gone

    def check_can_ever_fit(self, num_slices: int, slice_type_name: str) -> None:
        """Raises CapacityError (or InvalidRequestError) unless some day this cluster could
        hold `num_slices` slices of the type: a job's, when it is submitted."""
        check_can_ever_fit(self.scheduler.inventory, num_slices, slice_type(slice_type_name))

    def get_gang(self, gang_id: str, *, usable: bool = True) -> Gang:
        return self.manager.get(gang_id, usable=usable)

    def _submit(
        self,
        gang: Gang,
        client: str,
        build: Callable[[int], Any],
        needs: Sequence[ArrayRecord | Ticket] = (),
    ) -> Ticket:
        """Queues an operation for `client` of the gang, numbered only after everything in
        `needs` (the records it reads, the program load it runs) has been numbered: on a
        shared gang another client's upload may still wait behind this client's work.

        Raises:
            FailedPreconditionError: the gang cannot run work now (and why).
        """
        self.manager.check_usable(gang)
        # What this client's own earlier calls make is numbered before this operation
        # anyway (one client's operations keep their order): only the rest is waited for.
        waiting = [n for n in needs if not _numbered(n) and not _made_by(n, client)]
        ready = (lambda: all(_numbered(n) for n in waiting)) if waiting else None
        ticket = gang.dispatcher.submit(build, client=client, ready=ready)
        for n in needs:
            if isinstance(n, ArrayRecord):
                if n.readers:
                    n.readers = [t for t in n.readers if t.seq == 0]
                if ticket.seq == 0:
                    n.readers.append(ticket)
        return ticket

    # -- programs -------------------------------------------------------------------

    async def register_program(
        self, gang_id: str, name: str, mesh: MeshSpec, serialized: bytes, *, ahead: bool = True
    ) -> Program:
        """Loads a program on the gang's workers (once per gang); with `ahead` they begin
        compiling it at once, in the background, else at its first call (for a program
        that may never be called)."""
        gang, client = self.manager.resolve(gang_id)
        mesh.check_fits(gang.shape)
        program_id = program_id_of(serialized, mesh)
        try:
            program = self.programs.get(program_id)
        except NotFoundError:
            program = await asyncio.to_thread(load_program, serialized, name, mesh)
            # Reading a program loaded jax for good (slicewise/common/heap.py).
            heap.settle("the first program")
        program.check_fits(gang.shape, gang.platform, gang_id)
        self.programs.add(program)
        self._ensure_loaded(gang, client, program, ahead=ahead)
        return program

    def _ensure_loaded(
        self, gang: Gang, client: str, program: Program, *, ahead: bool = True
    ) -> Ticket:
        ticket = gang.loaded_programs.get(program.program_id)
        if ticket is None:
            ticket = gang.loaded_programs[program.program_id] = self._submit(
                gang,
                client,
                lambda seq: LoadOp(
                    seq, program.program_id, program.serialized, program.mesh, program.name, ahead
                ),
            )
        return ticket

    def execute(
        self, gang_id: str, program_id: str, inputs: Sequence[str]
    ) -> tuple[int, list[ArrayRecord]]:
        """Queues a program call; returns its sequence number and pending outputs."""
        return self.execute_batch(gang_id, [(program_id, inputs)])[0]

    def execute_batch(
        self, gang_id: str, calls: Sequence[tuple[str, Sequence[str]]]
    ) -> list[tuple[int, list[ArrayRecord]]]:
        """Queues several calls; an input "@K:I" is output I of call K of this batch.

        Every call is checked before any is queued, so a bad call queues nothing.
        """
        gang, client = self.manager.resolve(gang_id)
        plan: list[tuple[Program, list[str]]] = []
        for k, (program_id, inputs) in enumerate(calls):
            where = f"call {k}: " if len(calls) > 1 else ""
            try:
                program = self.programs.get(program_id)
                program.check_fits(gang.shape, gang.platform, gang_id)
                specs = [self._input_spec(h, gang.gang_id, plan) for h in inputs]
                program.check_inputs(specs, list(inputs))
            except SlicewiseError as exc:
                raise type(exc)(where + str(exc)) from None
            plan.append((program, list(inputs)))
        results: list[tuple[int, list[ArrayRecord]]] = []
        for program, inputs in plan:
            handles = tuple(self._resolve(h, results) for h in inputs)
            ticket, outputs = self._queue_call(gang, client, program, handles)
            results.append((ticket.seq, outputs))
        return results

    def stream_calls(
        self, gang_id: str, calls: Sequence[tuple[Any, ...]]
    ) -> list[tuple[int, SlicewiseError]]:
        """Queues the calls of one call-stream batch, each (program id, input handles,
        output handles the client chose[, runs]), in order; returns the calls refused,
        by their place in the batch, with why. A call of several runs (a chain: each run
        on the previous run's outputs) is one operation for the workers, which launch
        the runs back to back; its outputs are the last run's. Unlike a batch of
        `execute_batch`, a refused call
        leaves the others queued (as separate calls would): its outputs, when the client
        named them properly, are recorded as failed with its error, so a later call,
        wait or fetch of them says what went wrong where.

        Raises:
            NotFoundError, FailedPreconditionError: no usable gang `gang_id` (for every
                call of the batch).
        """
        gang, client = self.manager.resolve(gang_id)
        base = gang.gang_id
        gang.stream_batches += 1
        gang.streamed_calls += len(calls)
        refused: list[tuple[int, SlicewiseError]] = []
        # A batch is usually many calls of a few programs: each program is looked up and
        # checked against the gang once per batch, not once per call.
        fitting: dict[str, Program] = {}
        for k, call in enumerate(calls):
            program_id, inputs, outputs = call[:3]
            repeat = max(1, call[3]) if len(call) > 3 else 1
            try:
                program = fitting.get(program_id)
                if program is None:
                    program = self.programs.get(program_id)
                    program.check_fits(gang.shape, gang.platform, gang_id)
                    fitting[program_id] = program
                records = [self._usable_array(h, base) for h in inputs]
                program.check_inputs([r.spec for r in records], inputs)
                self.arrays.check_new(base, outputs, len(program.outputs))
                if repeat > 1:
                    _check_repeat(program, repeat)
            except SlicewiseError as exc:
                refused.append((k, exc))
                self._fail_outputs(base, outputs, f"its call was refused: {exc}")
                continue
            self._queue_call(
                gang,
                client,
                program,
                tuple(inputs),
                names=tuple(outputs),
                repeat=repeat,
                records=records,
            )
        return refused

    def stream_opened(self, prefix: str) -> StreamProgress:
        """Registers a call stream by its handle prefix (waits may name its batches)."""
        progress = self._streams.setdefault(prefix, StreamProgress())
        progress.open = True
        return progress

    def stream_closed(self, prefix: str) -> None:
        progress = self._streams.pop(prefix, None)
        if progress is not None:
            progress.close()

    async def after_stream(self, handles: Sequence[str], batch: int) -> None:
        """Returns once the call stream these handles come from has queued batch `batch`
        (at most STREAM_WAIT_S, and not at all for handles of no stream): a client's wait
        or fetch may overtake the calls it waits for, which travel on the stream. The
        wait's or fetch's own timeout does not bound this: it is for the computation (a
        wait of 1 ms for an array still on its way must not answer that it is unknown)."""
        if not batch:
            return
        for prefix in {h.rpartition(".")[0] for h in handles if "/c" in h}:
            progress = self._streams.get(prefix)
            if progress is None:  # its first batch is still on the way
                if len(self._streams) >= MAX_STREAMS:
                    continue
                progress = self._streams[prefix] = StreamProgress()
            progress.waiters += 1
            try:
                await progress.reach(batch, STREAM_WAIT_S)
            finally:
                progress.waiters -= 1
                gone = not progress.open and not progress.waiters
                if gone and self._streams.get(prefix) is progress:
                    del self._streams[prefix]

    def _fail_outputs(self, gang_id: str, handles: Sequence[str], error: str) -> None:
        """Records the outputs of a refused call as failed, those of them that are new
        handles the client may name (a wait or fetch of them then gives `error`)."""
        for h in dict.fromkeys(handles):
            with contextlib.suppress(InvalidRequestError):
                self.arrays.check_new(gang_id, [h], 1)
                self.arrays.new(gang_id, ArraySpec((), "float32"), handle=h).settle(error)

    def delete_quietly(self, handles: Sequence[str]) -> int:
        """Deletes the arrays of those handles that name one (a call stream's deletes:
        the client dropped them, and one already gone needs nothing); returns how many."""
        known = [h for h in dict.fromkeys(handles) if self.arrays.find(h) is not None]
        return self.delete(known) if known else 0

    def inject_hang(self, gang_id: str, process: int, seconds: float) -> Ticket:
        """Fault injection: queues a HangOp for `process` and an empty op for the other
        workers, in the gang's order behind what is queued (see controller/chaos.py)."""
        gang, client = self.manager.resolve(gang_id)
        n = gang.shape.num_processes
        return self._submit(
            gang,
            client,
            lambda seq: [
                HangOp(seq, seconds) if w == process else DeleteOp(seq, ()) for w in range(n)
            ],
        )

    def call(
        self, gang_id: str, program_id: str, inputs: Sequence[str], report: Sequence[int] = ()
    ) -> tuple[Ticket, list[ArrayRecord]]:
        """Queues one call from inside the controller (e.g. a job's step); the values of
        the outputs at `report` (small, replicated) come back on the ticket when it is
        done, with no fetch."""
        gang, client = self.manager.resolve(gang_id)
        program = self.programs.get(program_id)
        return self._queue_call(gang, client, program, tuple(inputs), tuple(report))

    def _queue_call(
        self,
        gang: Gang,
        client: str,
        program: Program,
        handles: tuple[str, ...],
        report: tuple[int, ...] = (),
        names: tuple[str, ...] = (),
        repeat: int = 1,
        records: Sequence[ArrayRecord] = (),
    ) -> tuple[Ticket, list[ArrayRecord]]:
        """Queues one call whose inputs were checked (`repeat` runs of it, checked by
        `_check_repeat`); its outputs get `names` (checked new handles the client chose)
        or new handles. `records` are the inputs' records when the caller has them."""
        loaded = self._ensure_loaded(gang, client, program)
        outputs = [
            self.arrays.new(gang.gang_id, spec, handle=name)
            for spec, name in zip(
                program.outputs, names or ("",) * len(program.outputs), strict=True
            )
        ]
        ticket = self._submit(
            gang,
            client,
            _marking(
                outputs,
                lambda seq: ExecOp(
                    seq,
                    program.program_id,
                    handles,
                    tuple(r.handle for r in outputs),
                    report,
                    repeat,
                ),
            ),
            needs=[loaded, *(records or [self.arrays.get(h) for h in handles])],
        )
        ticket.settled = functools.partial(self._executed, gang, client, outputs)
        hurry = functools.partial(gang.dispatcher.hurry, ticket)
        for r in outputs:
            r.hurry = hurry
            r.made_by = client
        return ticket, outputs

    @staticmethod
    def _executed(gang: Gang, client: str, outputs: list[ArrayRecord], error: str | None) -> None:
        for r in outputs:
            r.settle(error)
        if error is None:
            gang.programs_run[client] += 1

    def _input_spec(
        self, handle: str, gang_id: str, plan: list[tuple[Program, list[str]]]
    ) -> ArraySpec:
        if not handle.startswith("@"):
            return self._usable_array(handle, gang_id).spec
        k, i = _batch_ref(handle)
        # Negative numbers would index from the end (of an empty plan: IndexError).
        if not (0 <= k < len(plan) and 0 <= i < len(plan[k][0].outputs)):
            raise InvalidRequestError(
                f"input {handle!r} refers to output {i} of call {k}, which comes later in the "
                "batch or does not exist; refer only to earlier calls"
            )
        return plan[k][0].outputs[i]

    @staticmethod
    def _resolve(handle: str, results: list[tuple[int, list[ArrayRecord]]]) -> str:
        if not handle.startswith("@"):
            return handle
        k, i = _batch_ref(handle)
        return results[k][1][i].handle

    def _usable_array(self, handle: str, gang_id: str) -> ArrayRecord:
        record = self.arrays.on_gang(handle, gang_id)
        record.require_usable()
        return record

    # -- arrays ---------------------------------------------------------------------

    def begin_put(self, gang_id: str, spec: ArraySpec, sharding: ShardingSpec) -> PutTarget:
        """Validates an upload's header before any of its bytes arrive, and makes room
        for them.

        Raises:
            CapacityError: each chip's piece of the array would not fit in a chip's HBM,
                or the controller cannot hold the whole array to split it.
        """
        gang, client = self._check_put(gang_id, spec, sharding)
        try:
            buffer = np.empty(spec.nbytes, dtype=np.uint8)
        except MemoryError:
            raise CapacityError(
                f"the controller cannot hold a {spec} array ({_size(spec.nbytes)}) in memory "
                "to split it over the gang; upload it as smaller arrays"
            ) from None
        return PutTarget(gang, client, spec, sharding, buffer)

    def _check_put(self, gang_id: str, spec: ArraySpec, sharding: ShardingSpec) -> tuple[Gang, str]:
        """The gang (and attachment) an upload goes to, if it may.

        Raises:
            NotFoundError, FailedPreconditionError: no usable gang `gang_id`.
            InvalidRequestError: the sharding does not fit the gang or the array.
            CapacityError: each chip's piece of the array would not fit in a chip's HBM,
                or the upload would take the tenant past its cap on bytes.
        """
        gang, client = self.manager.resolve(gang_id)
        sharding.mesh.check_fits(gang.shape)
        sharding.check(spec.shape)
        per_chip = math.prod(sharding.shard_shape(spec.shape)) * dtype_of(spec.dtype).itemsize
        if per_chip > HBM_BYTES_PER_CHIP:
            chips = gang.shape.num_devices
            how = f"split as {sharding.partition_spec()}" if any(sharding.dims) else "replicated"
            raise CapacityError(
                f"a {spec} array ({_size(spec.nbytes)}) {how} puts {_size(per_chip)} on each "
                f"chip, more than the {_size(HBM_BYTES_PER_CHIP)} of HBM a v5e chip has "
                f"(gang {gang_id}: {chips} chips, "
                f"{_size(chips * HBM_BYTES_PER_CHIP)} in all); split it over more mesh axes, "
                "or upload it as smaller arrays"
            )
        self._check_bytes_cap(gang, spec)
        return gang, client

    def _check_bytes_cap(self, gang: Gang, spec: ArraySpec) -> None:
        """Raises CapacityError if the upload would take the gang's tenant past its cap on
        bytes of arrays on its gangs (controller/auth.py)."""
        caps = self.manager.caps.get(gang.tenant)
        if caps is None or caps.max_bytes is None:
            return
        gangs = {g.gang_id for g in self.gangs.values() if g.tenant == gang.tenant}
        used = self.arrays.nbytes(gangs)
        if used + spec.nbytes > caps.max_bytes:
            raise CapacityError(
                f"tenant {gang.tenant!r} has {_size(used)} of arrays on its gangs, of its cap "
                f"of {_size(caps.max_bytes)}; this upload adds {_size(spec.nbytes)}: delete "
                "arrays first"
            )

    async def finish_put(self, target: PutTarget) -> ArrayRecord:
        """Splits a received array into per-host pieces and queues it to the workers."""
        gang, spec = target.gang, target.spec
        self.manager.check_usable(gang)  # it may have stopped while the bytes came in
        array = target.buffer.view(dtype_of(spec.dtype)).reshape(spec.shape)
        started = time.perf_counter()
        indices = target.sharding.process_pieces(spec.shape, gang.shape)
        key = uuid.uuid4().hex
        staging = asyncio.ensure_future(
            gang.stage(key, array, [indices[p] for p in range(gang.shape.num_processes)])
        )
        try:
            await asyncio.shield(staging)
            log.debug(
                "put %s: sent to %d workers in %.3f s",
                spec,
                gang.shape.num_processes,
                time.perf_counter() - started,
            )
        except TransportError as exc:
            raise WorkerError(f"uploading to gang {gang.gang_id} failed: {exc}") from exc
        except asyncio.CancelledError:
            # The client went away while its pieces were on their way to the workers,
            # where they would stay until a PutOp takes them: once they are there, one
            # goes ahead, for an array deleted at once.
            staging.add_done_callback(functools.partial(self._abandon_put, target, key))
            raise
        metrics.BYTES.labels("put").inc(spec.nbytes)
        self.spans.record(
            "send pieces",
            "transfer",
            started_us(started),
            trace_now_us(),
            thread=f"gang {gang.gang_id}",
            gang=gang.gang_id,
            bytes=spec.nbytes,
        )
        return self._queue_put(target, key)

    def _queue_put(self, target: PutTarget, key: str) -> ArrayRecord:
        """Queues the PutOp that makes an array of the pieces staged under `key`."""
        spec = target.spec
        record = self.arrays.new(target.gang.gang_id, spec, target.sharding)
        ticket = self._submit(
            target.gang,
            target.client,
            _marking(
                [record],
                lambda seq: PutOp(seq, record.handle, spec.shape, spec.dtype, target.sharding, key),
            ),
        )
        ticket.done.add_done_callback(lambda f: record.settle(f.result()))
        return record

    def _abandon_put(self, target: PutTarget, key: str, staging: asyncio.Future[None]) -> None:
        """Takes the staged pieces of a put whose client went away off the workers."""
        if staging.cancelled() or staging.exception() is not None:
            return
        # A gang stopped meanwhile took the pieces with its workers.
        with contextlib.suppress(SlicewiseError):
            self.delete([self._queue_put(target, key).handle])

    async def put_array(
        self, gang_id: str, array: np.ndarray, sharding: ShardingSpec
    ) -> ArrayRecord:
        """Uploads an array from inside the controller (e.g. a job's PRNG key)."""
        array = np.require(array, requirements="C")
        target = self.begin_put(gang_id, ArraySpec.of(array.shape, array.dtype), sharding)
        target.buffer[:] = array.reshape(-1).view(np.uint8)
        return await self.finish_put(target)

    # -- direct transfers -----------------------------------------------------------

    def begin_direct_put(
        self, gang_id: str, spec: ArraySpec, sharding: ShardingSpec
    ) -> DirectTransfer:
        """Validates an upload like `begin_put`, then authorizes its client to send each
        host its pieces itself (see slicewise/common/capability.py) until the transfer
        expires; `finish_direct_put` then makes the array. Pieces of a put not finished
        by then are dropped from the workers.

        Raises:
            as `_check_put`.
        """
        gang, client = self._check_put(gang_id, spec, sharding)
        key = uuid.uuid4().hex
        expires = self._expiry()
        itemsize = dtype_of(spec.dtype).itemsize
        hosts = []
        indices = sharding.process_pieces(spec.shape, gang.shape)
        for p in range(gang.shape.num_processes):
            pieces = tuple(index_key(i, spec.shape) for i in indices[p])
            nbytes = sum(math.prod(b - a for a, b in piece) * itemsize for piece in pieces)
            capability = gang.capability("put", key, expires, nbytes)
            hosts.append(HostPlan(p, gang.data_addresses[p], capability, pieces))
        target = PutTarget(gang, client, spec, sharding, np.empty(0, np.uint8))
        transfer = DirectTransfer(key, "put", gang, gang.epoch, expires, hosts, target=target)
        return self._authorized(transfer)

    def finish_direct_put(self, transfer_id: str) -> ArrayRecord:
        """Queues the array made of the pieces a direct put's client has sent.

        Raises:
            NotFoundError: no direct put `transfer_id` is under way (unknown, another
                tenant's, finished, abandoned or expired).
            FailedPreconditionError: its gang stopped or started again meanwhile (its
                pieces went with the workers).
        """
        transfer = self._end_transfer(transfer_id, "put")
        gang, target = transfer.gang, transfer.target
        assert target is not None
        try:
            self.manager.check_usable(gang)
            if gang.epoch != transfer.epoch:
                raise FailedPreconditionError(
                    f"gang {gang.gang_id} started again on new workers since direct put "
                    f"{transfer_id} began; its pieces are gone: put the array again"
                )
        except FailedPreconditionError:
            self._clean_up(transfer)
            raise
        metrics.BYTES.labels("put").inc(target.spec.nbytes)
        # From the authorization to the finish: the client sent the pieces meanwhile.
        self._record_transfer("client sends pieces", gang, transfer.began, target.spec.nbytes)
        return self._queue_put(target, transfer_id)

    async def begin_direct_fetch(self, handle: str, timeout_s: float = 0) -> DirectTransfer:
        """Waits for an array like `fetch` and pins it on its workers, then authorizes
        the client to read each host's pieces itself, once, until the transfer expires;
        an array whose pieces are not read by then is unpinned.

        Raises:
            as `fetch`.
        """
        timeout_s = timeout_s or self.options.fetch_timeout_s
        record = self.arrays.get(handle)
        gang = self.get_gang(record.gang_id)
        record.require_usable()
        pin_id = uuid.uuid4().hex
        started = time.perf_counter()
        ticket = self._submit(gang, "", lambda seq: PinOp(seq, handle, pin_id), needs=[record])
        gang.dispatcher.hurry(ticket)
        try:
            error = await asyncio.wait_for(asyncio.shield(ticket.done), timeout_s)
        except TimeoutError:
            self._unpin(gang, ticket, pin_id)
            raise DeadlineError(
                f"array {handle} was not ready within {timeout_s:g} s; fetch again with a "
                "longer timeout"
            ) from None
        except asyncio.CancelledError:  # the client went away
            self._unpin(gang, ticket, pin_id)
            raise
        if error:
            raise FailedPreconditionError(f"array {handle} is unavailable: {error}")
        expires = self._expiry()
        hosts = [
            HostPlan(p, address, gang.capability("get", pin_id, expires), ())
            for p, address in enumerate(gang.data_addresses)
        ]
        metrics.BYTES.labels("fetch").inc(record.spec.nbytes)
        self._record_transfer("pin for the client", gang, started, record.spec.nbytes)
        transfer = DirectTransfer(pin_id, "get", gang, gang.epoch, expires, hosts, record=record)
        return self._authorized(transfer)

    def abandon_direct(self, transfer_id: str) -> None:
        """Ends a direct transfer its client gives up on: its staged pieces or its pin
        leave the workers now.

        Raises:
            NotFoundError: no direct transfer `transfer_id` is under way.
        """
        self._clean_up(self._end_transfer(transfer_id))

    def _expiry(self) -> int:
        return math.ceil(time.time() + self.options.direct_transfer_ttl_s)

    def _authorized(self, transfer: DirectTransfer) -> DirectTransfer:
        """Registers a transfer and schedules its clean-up at its expiry."""
        transfer.began = time.perf_counter()
        self._transfers[transfer.transfer_id] = transfer
        # Up to a second before the capabilities (whole seconds) expire: pieces a client
        # still sends until then are dropped as they arrive (see JaxRuntime.stage).
        transfer.timer = asyncio.get_running_loop().call_later(
            self.options.direct_transfer_ttl_s, self._expire, transfer.transfer_id
        )
        return transfer

    def _end_transfer(self, transfer_id: str, op: str = "") -> DirectTransfer:
        """Takes a transfer under way off the table (and its expiry off the clock).

        Raises:
            NotFoundError: none is, of that op, that the caller may see.
        """
        transfer = self._transfers.get(transfer_id)
        if (
            transfer is None
            or (op and transfer.op != op)
            or not self.manager.visible(transfer.gang.gang_id)
        ):
            what = {"put": "direct put", "get": "direct fetch"}.get(op, "direct transfer")
            raise NotFoundError(
                f"no {what} {transfer_id!r} is under way: unknown, finished, abandoned or "
                f"expired (they expire {self.options.direct_transfer_ttl_s:g} s after they "
                "begin)"
            )
        del self._transfers[transfer_id]
        if transfer.timer is not None:
            transfer.timer.cancel()
        return transfer

    def _expire(self, transfer_id: str) -> None:
        transfer = self._transfers.pop(transfer_id, None)
        if transfer is None:
            return
        # A fetch has no finish: its pins are dropped whether or not they were read (a
        # read one is gone already), which is routine; an unfinished put is not.
        level = logging.INFO if transfer.op == "put" else logging.DEBUG
        log.log(level, "direct %s %s expired: cleaning up", transfer.op, transfer_id)
        self._clean_up(transfer)

    def _clean_up(self, transfer: DirectTransfer) -> None:
        """Drops what an unfinished transfer left on its workers (nothing is left on a
        gang that stopped or started again: its workers took it with them)."""
        gang, key = transfer.gang, transfer.transfer_id

        async def clean_up() -> None:
            if not gang.state.usable or gang.epoch != transfer.epoch:
                return
            if transfer.op == "put":
                await gang.drop_staged(key, transfer.expires_unix_s)
            else:
                await gang.drop_pin(key)

        task = asyncio.create_task(clean_up(), name=f"clean up {key}")
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def _record_transfer(self, name: str, gang: Gang, began: float, nbytes: int) -> None:
        self.spans.record(
            name,
            "transfer",
            started_us(began),
            trace_now_us(),
            thread=f"gang {gang.gang_id}",
            gang=gang.gang_id,
            bytes=nbytes,
        )

    def load_batch(
        self,
        gang_id: str,
        program: str,
        overrides: tuple[tuple[str, str], ...],
        step: int,
        sharding: ShardingSpec,
        specs: Sequence[ArraySpec],
    ) -> list[str]:
        """Queues "build your rows of the batch of `step`" on every worker of the gang;
        returns the handles of the batch fields (in sorted field order)."""
        gang, client = self.manager.resolve(gang_id)
        records = [self.arrays.new(gang.gang_id, spec, sharding) for spec in specs]
        handles = tuple(r.handle for r in records)
        ticket = self._submit(
            gang,
            client,
            _marking(
                records, lambda seq: BatchOp(seq, program, overrides, step, sharding, handles)
            ),
        )

        def settle(done: asyncio.Future[str | None]) -> None:
            for r in records:
                r.settle(done.result())

        ticket.done.add_done_callback(settle)
        return list(handles)

    # -- checkpoints ----------------------------------------------------------------

    def save_checkpoint(
        self,
        gang_id: str,
        handles: Sequence[str],
        directory: str,
        step: int,
        meta: str,
        barrier_prefix: str = "",
        *,
        max_to_keep: int = 0,
        keep_steps: Sequence[int] = (),
    ) -> Ticket:
        """Queues an asynchronous checkpoint of arrays at `step` (see SaveOp): the ticket
        is done when the workers have queued the save, not when the step is committed
        (that is a marker in storage, see controller/checkpoints.py)."""
        gang, client = self.manager.resolve(gang_id)
        records = [self.arrays.get(h) for h in handles]
        keep = tuple(sorted(keep_steps))
        return self._submit(
            gang,
            client,
            lambda seq: SaveOp(
                seq, directory, step, tuple(handles), meta, barrier_prefix, max_to_keep, keep
            ),
            needs=records,
        )

    def restore_checkpoint(
        self,
        gang_id: str,
        directory: str,
        step: int,
        specs: Sequence[ArraySpec],
        shardings: Sequence[ShardingSpec],
        expect: Sequence[tuple[str, Any]] = (),
        barrier_prefix: str = "",
    ) -> tuple[Ticket, list[ArrayRecord]]:
        """Queues the reading of committed checkpoint `step` into new arrays of these
        shapes and shardings (see RestoreOp); returns them, pending."""
        return self._new_arrays(
            gang_id,
            specs,
            shardings,
            lambda seq, handles: RestoreOp(
                seq,
                directory,
                step,
                handles,
                tuple(s.shape for s in specs),
                tuple(s.dtype for s in specs),
                tuple(shardings),
                tuple(expect),
                barrier_prefix,
            ),
        )

    def peer_restore(
        self,
        gang_id: str,
        sources: Sequence[str],
        specs: Sequence[ArraySpec],
        shardings: Sequence[ShardingSpec],
        stashes: Sequence[str],
    ) -> tuple[Ticket, list[ArrayRecord]]:
        """Queues the building of new arrays from the pieces of `sources` that a failed
        gang's surviving workers stashed (see PeerRestoreOp); returns them, pending."""
        return self._new_arrays(
            gang_id,
            specs,
            shardings,
            lambda seq, handles: PeerRestoreOp(
                seq,
                handles,
                tuple(sources),
                tuple(s.shape for s in specs),
                tuple(s.dtype for s in specs),
                tuple(shardings),
                tuple(stashes),
            ),
        )

    def _new_arrays(
        self,
        gang_id: str,
        specs: Sequence[ArraySpec],
        shardings: Sequence[ShardingSpec],
        build: Callable[[int, tuple[str, ...]], Any],
    ) -> tuple[Ticket, list[ArrayRecord]]:
        """Queues the operation `build(seq, handles)` that creates arrays of these specs
        and shardings; returns its ticket and the arrays, pending until it completes."""
        gang, client = self.manager.resolve(gang_id)
        records = [
            self.arrays.new(gang.gang_id, spec, sharding)
            for spec, sharding in zip(specs, shardings, strict=True)
        ]
        handles = tuple(r.handle for r in records)
        ticket = self._submit(gang, client, _marking(records, lambda seq: build(seq, handles)))
        ticket.done.add_done_callback(functools.partial(_settle_records, records))
        return ticket, records

    def close_checkpoints(self, gang_id: str, directory: str, barrier_prefix: str = "") -> Ticket:
        """Queues "wait for the save in flight to commit, then let go of the directory";
        the ticket's error is the failed save's, if one failed."""
        gang, client = self.manager.resolve(gang_id)
        return self._submit(
            gang, client, lambda seq: CloseCheckpointsOp(seq, directory, barrier_prefix)
        )

    async def fetch(self, handle: str, timeout_s: float = 0) -> tuple[ArrayRecord, np.ndarray]:
        """Waits for an array and gathers its pieces from every worker."""
        timeout_s = timeout_s or self.options.fetch_timeout_s
        record = self.arrays.get(handle)
        gang = self.get_gang(record.gang_id)
        record.require_usable()
        pin_id = uuid.uuid4().hex
        ticket = self._submit(gang, "", lambda seq: PinOp(seq, handle, pin_id), needs=[record])
        gang.dispatcher.hurry(ticket)
        started = time.perf_counter()
        unpinned = False  # reading takes the pieces (and the pin) off the workers
        try:
            # Shielded: the pin goes ahead in the gang's order whatever becomes of the
            # fetch, so that `_unpin` can tell when it has happened.
            error = await asyncio.wait_for(asyncio.shield(ticket.done), timeout_s)
            if error:
                raise FailedPreconditionError(f"array {handle} is unavailable: {error}")
            pinned = time.perf_counter()
            pieces = await asyncio.wait_for(gang.read(pin_id), timeout_s)
            unpinned = True
            read = time.perf_counter()
        except TransportError as exc:
            raise WorkerError(f"reading {handle} from gang {gang.gang_id} failed: {exc}") from exc
        except TimeoutError:
            raise DeadlineError(
                f"array {handle} was not ready within {timeout_s:g} s; fetch again with a "
                "longer timeout"
            ) from None
        finally:
            if not unpinned:  # failed, timed out or cancelled (the client went away)
                self._unpin(gang, ticket, pin_id)
        result = await asyncio.to_thread(_assemble, record.spec, pieces)
        metrics.BYTES.labels("fetch").inc(record.spec.nbytes)
        self.spans.record(
            "gather pieces",
            "transfer",
            started_us(pinned),
            trace_now_us(),
            thread=f"gang {gang.gang_id}",
            gang=gang.gang_id,
            bytes=record.spec.nbytes,
        )
        log.debug(
            "fetch %s (%s): pin %.3f s, read %.3f s, assemble %.3f s",
            handle,
            record.spec,
            pinned - started,
            read - pinned,
            time.perf_counter() - read,
        )
        return record, result

    async def wait(self, handles: Sequence[str], timeout_s: float) -> list[ArrayRecord]:
        """Waits until the arrays settle or `timeout_s` passes; returns them either way."""
        records = [self.arrays.get(h) for h in handles]
        pending = [
            asyncio.ensure_future(r.settled.wait()) for r in records if not r.settled.is_set()
        ]
        for r in records:
            if r.hurry is not None:
                r.hurry()
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s or None)
            for task in still:
                task.cancel()
        return records

    def _unpin(self, gang: Gang, ticket: Ticket, pin_id: str) -> None:
        """Drops a fetch's pin from the workers once its PinOp has run there (a drop
        sent earlier would arrive first and leave the array pinned, held in device
        memory even after it is deleted)."""

        async def unpin() -> None:
            await ticket.done
            if gang.state.usable:
                await gang.drop_pin(pin_id)

        task = asyncio.create_task(unpin(), name=f"unpin {pin_id}")
        self._unpinning.add(task)
        task.add_done_callback(self._unpinning.discard)

    def delete(self, handles: Sequence[str]) -> int:
        """Deletes arrays, all or none; a handle given twice counts once. Returns how many
        were deleted."""
        handles = list(dict.fromkeys(handles))
        records = {h: self.arrays.get(h) for h in handles}  # all or none: check first
        by_gang: dict[str, list[str]] = {}
        for h, record in records.items():
            by_gang.setdefault(self.arrays.remove(record).gang_id, []).append(h)
        for gang_id, group in by_gang.items():
            gang = self.gangs.get(gang_id)
            if gang is not None and gang.state.usable:
                needs = [n for h in group for n in (records[h], *records[h].readers)]
                build = functools.partial(DeleteOp, handles=tuple(group))
                self._submit(gang, "", build, needs=needs)
        return len(handles)

    # -- status ---------------------------------------------------------------------

    async def trace(self, gang_id: str) -> dict[str, Any]:
        """The gang's timeline as Chrome trace JSON: the controller's dispatch and transfer
        spans and every worker's execute and transfer spans (also after release)."""
        gang_id = gang_id.partition("@")[0]
        gang = self.gangs.get(gang_id)
        if gang is not None:
            hosts = await gang.collect_spans()
            return chrome_trace([("controller", self.spans.spans(where={"gang": gang_id})), *hosts])
        releasing = self._archiving.get(gang_id)
        if releasing is not None and self.manager.visible(gang_id):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(releasing.wait(), timeout=ARCHIVE_WAIT_S)
        archived = self.timelines.get(gang_id) if self.manager.visible(gang_id) else None
        if archived is None:
            self.get_gang(gang_id)  # raises the right error for unknown or released gangs
        return chrome_trace(archived or [])


class StreamProgress:
    """How far the controller has queued one call stream's batches: what a wait or fetch
    that names the batch making its array (`after_batch`) waits for."""

    def __init__(self) -> None:
        self.batch = 0
        self.open = False  # its stream is being read
        self.waiters = 0
        self._changed = asyncio.Event()

    def advance(self, batch: int) -> None:
        self.batch = batch
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        self.open = False
        self._changed.set()

    async def reach(self, batch: int, timeout_s: float) -> None:
        """Returns once batch `batch` is queued, the stream ended, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.batch < batch:
            changed, left = self._changed, deadline - time.monotonic()
            if left <= 0 or (self.batch and not self.open):
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)


def _check_repeat(program: Program, repeat: int) -> None:
    """Raises unless `program` can run `repeat` times in a row, each run on the outputs
    of the one before."""
    if repeat > MAX_REPEAT:
        raise InvalidRequestError(
            f"a call may repeat at most {MAX_REPEAT:,} times, not {repeat:,}; split the chain"
        )
    if list(program.outputs) != list(program.inputs):
        raise InvalidRequestError(
            f"program {program.name} ({program.program_id[:12]}) cannot repeat: each run "
            "takes the previous run's outputs, and its outputs "
            f"{[str(s) for s in program.outputs]} do not match its inputs "
            f"{[str(s) for s in program.inputs]}"
        )


def _numbered(need: ArrayRecord | Ticket) -> bool:
    return need.numbered if isinstance(need, ArrayRecord) else need.seq > 0


def _made_by(need: ArrayRecord | Ticket, client: str) -> bool:
    """Whether `need` is an array a call of `client` queued makes (see ArrayRecord)."""
    return isinstance(need, ArrayRecord) and need.made_by == client


def _marking(records: Sequence[ArrayRecord], build: Callable[[int], Any]) -> Callable[[int], Any]:
    """`build`, also marking the records it produces as numbered when it runs (which is
    when the operation gets its place in the gang's order)."""

    def numbered_build(seq: int) -> Any:
        for r in records:
            r.numbered = True
        return build(seq)

    return numbered_build


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.3g} GiB)"


def _assemble(
    spec: ArraySpec, pieces: list[list[tuple[tuple[slice, ...], np.ndarray]]]
) -> np.ndarray:
    out = np.empty(spec.shape, dtype=dtype_of(spec.dtype))
    covered = 0
    for worker_pieces in pieces:
        for index, data in worker_pieces:
            out[index] = data
            covered += data.size
    if covered != out.size:
        raise WorkerError(
            f"workers returned {covered} of {out.size} elements of a {spec} array; "
            "the gang's workers disagree on its sharding"
        )
    return out


def _batch_ref(text: str) -> tuple[int, int]:
    try:
        k, i = text[1:].split(":")
        return int(k), int(i)
    except ValueError:
        raise InvalidRequestError(
            f"batch reference {text!r} is not of the form '@CALL:OUTPUT', e.g. '@0:0'"
        ) from None


def started_us(perf_counter_s: float) -> int:
    """Wall-clock microseconds of a past `time.perf_counter()` reading."""
    return trace_now_us() - int((time.perf_counter() - perf_counter_s) * 1e6)


def _settle_records(records: Sequence[ArrayRecord], done: asyncio.Future[str | None]) -> None:
    """Settles the arrays an operation creates when it completes (with its error)."""
    for r in records:
        r.settle(done.result())
