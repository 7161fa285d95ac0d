"""The controller's per-gang dispatch queue: numbers operations, streams them to every
worker of the gang, and settles each one when all workers report it complete.

Clients get their answer as soon as an operation is queued (asynchronous dispatch).
Delivery and completion travel separately: `send` puts a batch on its way to a worker,
and each worker's completions are handed to the dispatcher as they arrive (`listen`:
in the callback that read them, with no task to wake per frame). So the
pipeline to a worker stays full however long its programs run, and the bound on it is
explicit: at most `max_in_flight` operations numbered but not completed (the
back-pressure the workers' bounded executors exert). Operations get their sequence
number only when there is room: until then they wait in per-client queues (fairqueue.py),
which is where the clients of a shared gang are interleaved by weight.

The transport is injected, so this runs in unit tests without processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from controller.fairqueue import FairQueue
from slicewise.common.errors import GangBrokenError
from slicewise.common.ops import Completions, DeleteOp, Op, op_kind

log = logging.getLogger(__name__)

# Hands a batch to worker `index`; returns once it is on its way (in order).
Send = Callable[[int, list[Op]], Awaitable[None]]
# Hands the same batch to every worker (encoded once); returns once it is on its way.
Broadcast = Callable[[list[Op]], Awaitable[None]]
# Starts handing worker `index`'s completions to the first callback as they arrive, in
# the order they completed (which need not be sequence order), and the failure of its
# channel to the second, once.
Listen = Callable[[int, Callable[[Completions], None], Callable[[Exception], None]], None]
# Asks worker `index` to report operation `seq` as soon as it completes.
Hurry = Callable[[int, int], None]
# Told about every settled operation: (op kind, seq, queued_ns, settled_ns, error).
Observer = Callable[[str, int, int, int, "str | None"], None]


@dataclass
class Ticket:
    """A submitted operation: `seq` is its place in the gang's order (0 until it gets one:
    while earlier work from other clients of a shared gang goes first), `done` resolves to
    None when every worker completed it, or to the first error."""

    build: Callable[[int], Op | list[Op]]
    client: str = ""
    seq: int = 0
    queued_ns: int = 0
    ops: Op | list[Op] | None = None  # one op for every worker, or a list of one per worker
    waiting_for: set[int] = field(default_factory=set)  # workers yet to report
    error: str | None = None
    values: tuple[Any, ...] | None = None  # reported output values (ExecOp.report)
    # worker -> (started_ns, finished_ns): when the op ran there, by that worker's clock
    ran: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Called with the outcome when the op settles, before anything awaiting `done` runs
    # (a callback on `done` would cost an event-loop turn per call).
    settled: Callable[[str | None], None] | None = None
    sent: bool = False  # on its way to the workers
    hurried: bool = False  # somebody waits for it (Dispatcher.hurry)
    finished: bool = False  # settled: every worker completed it, or it failed
    outcome: str | None = None  # once finished: None, or the first error
    # `done`, made only when somebody asks: a call's outcome reaches its outputs through
    # `settled`, and a future per call cost the controller microseconds per call.
    _done: asyncio.Future[str | None] | None = field(default=None, repr=False)

    @property
    def done(self) -> asyncio.Future[str | None]:
        """Resolves to the outcome once the operation settles (made on first use, in the
        running event loop)."""
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
            if self.finished:
                self._done.set_result(self.outcome)
        return self._done

    def op_for(self, worker: int) -> Op:
        assert self.ops is not None
        # A list, not any Sequence: the ABC's isinstance costs a few us per operation.
        return self.ops[worker] if isinstance(self.ops, list) else self.ops


class Dispatcher:
    """Sequence numbering, batched delivery and completion tracking for one gang."""

    def __init__(
        self,
        send: Send,
        listen: Listen,
        num_workers: int,
        *,
        name: str = "the gang",
        max_batch: int = 128,
        max_in_flight: int = 32,
        max_sends: int = 1,
        on_broken: Callable[[str], None] | None = None,
        observer: Observer | None = None,
        broadcast: Broadcast | None = None,
        hurry: Hurry | None = None,
    ) -> None:
        self._send = send
        # For a batch whose operations are the same for every worker (nearly all are):
        # one encoding and no task per worker, the controller's cost per host per call.
        self._broadcast = broadcast
        self._listen = listen
        self._hurry = hurry
        self._hurried = 0  # hurried tickets not sent yet
        self._num_workers = num_workers
        self._name = name
        self._max_batch = max_batch
        self.max_in_flight = max_in_flight  # may change while running
        # One delivery at a time (per gang): operations that arrive while one is on its
        # way go together in the next batch, so a burst costs a few calls, not one each.
        self._max_sends = max_sends
        self._sending = 0
        self._on_broken = on_broken
        self._observer = observer
        self._next_seq = 1
        self._waiting: FairQueue[Ticket] = FairQueue()  # not yet numbered
        self._numbered: deque[Ticket] = deque()  # numbered, not yet sent
        self._in_flight: dict[int, Ticket] = {}  # numbered (sent or about to be)
        self._full = False  # the window filled up with work still waiting: refill later
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self.broken: str | None = None
        self.dispatched = 0
        self.completed = 0
        self.most_in_flight = 0

    def submit(
        self,
        build: Callable[[int], Op | list[Op]],
        *,
        client: str = "",
        ready: Callable[[], bool] | None = None,
    ) -> Ticket:
        """Queues the operation `build(seq)` will build once it is numbered.

        Operations of one client keep their order; clients of a shared gang are interleaved
        by their weights (`set_weight`). `ready` may hold an operation back until what it
        needs from other clients has been numbered. Numbering happens at once when the gang
        has room in flight, else as earlier operations complete.

        Raises:
            GangBrokenError: the gang can no longer run anything (a worker failed, or the
                gang was stopped).
        """
        if self.broken is not None:
            raise GangBrokenError(f"{self._name} cannot run more work: {self.broken}")
        ticket = Ticket(build, client, queued_ns=time.time_ns())
        self._waiting.push(client, ticket, ready)
        self.dispatched += 1
        self.start()
        self._number()
        return ticket

    def start(self) -> None:
        """Starts delivering and reading the workers' channels (at once, so that their
        heartbeats are read; else with the first submit)."""
        if not self._started:
            self._started = True
            self._spawn(self._pump())
            for w in range(self._num_workers):
                self._listen(w, functools.partial(self._completed, w), self._lost)

    def hurry(self, ticket: Ticket) -> None:
        """Somebody waits for this operation: the workers that have not reported it yet
        are asked to report it as soon as it completes (while their queue is deep they
        otherwise hold completions up to worker/channel.py's FLUSH_AFTER_DEEP_S). One
        not sent yet is hurried once it is."""
        if self._hurry is None or ticket.hurried or ticket.finished:
            return
        ticket.hurried = True
        if not ticket.sent:
            self._hurried += 1
            return
        for w in ticket.waiting_for:
            self._hurry(w, ticket.seq)

    def fail(self, reason: str) -> None:
        """The gang cannot go on (a worker stopped answering, a collective is stuck):
        fails everything not yet completed, as a dead worker would."""
        self._break(reason)

    def set_weight(self, client: str, weight: float) -> None:
        """The client's share of a shared gang, relative to the other clients' weights."""
        self._waiting.set_weight(client, weight)

    def shares(self) -> dict[str, tuple[float, int, int]]:
        """client -> (weight, operations numbered, operations waiting)."""
        return self._waiting.shares()

    def _number(self) -> None:
        """Gives sequence numbers, in fair order, to as many waiting operations as fit in
        flight; the pump sends them.

        Once the window is full it refills in batches: only when a quarter of it has
        completed. Refilled one completion frame at a time, a stream of calls would go
        to the workers in frames of an operation or two, each a wake-up of a thread on
        every worker and a turn of this event loop per host; the workers still hold
        three quarters of the window of work meanwhile."""
        if self._full:
            if len(self._in_flight) > self.max_in_flight - max(1, self.max_in_flight // 4):
                return
            self._full = False
        while len(self._in_flight) < self.max_in_flight:
            picked = self._waiting.pop()
            if picked is None:
                break
            ticket = picked[1]
            ticket.seq = self._next_seq
            self._next_seq += 1
            try:
                ticket.ops = ticket.build(ticket.seq)
            except Exception as exc:  # noqa: BLE001 - the seq is taken: fill it with nothing
                ticket.ops = DeleteOp(ticket.seq, ())
                ticket.error = f"{type(exc).__name__}: {exc}"
            ticket.waiting_for = set(range(self._num_workers))
            self._in_flight[ticket.seq] = ticket
            self._numbered.append(ticket)
            self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
        self._full = len(self._in_flight) >= self.max_in_flight and len(self._waiting) > 0
        if self._numbered:
            self._wake.set()

    @property
    def queued(self) -> int:
        return len(self._waiting) + len(self._numbered)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def close(self, reason: str) -> None:
        """Fails everything not yet completed and stops delivering."""
        self._break(reason, failure=False)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pump(self) -> None:
        while self.broken is None:
            await self._wake.wait()
            self._wake.clear()
            while self._numbered and self._sending < self._max_sends:
                batch = [
                    self._numbered.popleft()
                    for _ in range(min(self._max_batch, len(self._numbered)))
                ]
                self._sending += 1
                self._spawn(self._deliver(batch))

    async def _deliver(self, batch: list[Ticket]) -> None:
        try:
            if self._broadcast is not None and not any(
                isinstance(item.ops, list) for item in batch
            ):
                await self._broadcast([item.op_for(0) for item in batch])
            else:
                await asyncio.gather(
                    *(
                        self._send(w, [item.op_for(w) for item in batch])
                        for w in range(self._num_workers)
                    )
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a worker died or the transport broke
            self._break(f"{type(exc).__name__}: {exc}")
        else:
            for item in batch:
                item.sent = True
            if self._hurried and self._hurry is not None:
                for item in batch:
                    if item.hurried:  # somebody waits for it: the workers hear so now
                        self._hurried -= 1
                        for w in item.waiting_for:
                            self._hurry(w, item.seq)
        finally:
            self._sending -= 1
            self._wake.set()

    def _completed(self, worker: int, done: Completions) -> None:
        """Worker `worker` completed these operations (read from the frame's columns:
        no object per completion)."""
        if self.broken is not None:
            return
        full = {r.seq: r for r in done.full} if done.full else None
        in_flight = self._in_flight
        columns = zip(done.seqs, done.started_ns, done.finished_ns, strict=True)
        for seq, started_ns, finished_ns in columns:
            item = in_flight.get(seq)
            if item is None:
                continue
            item.waiting_for.discard(worker)
            if full is not None and seq in full:
                result = full[seq]
                if result.error and item.error is None:
                    item.error = result.error
                if result.values is not None:
                    item.values = result.values
            if finished_ns:
                item.ran[worker] = (started_ns, finished_ns)
            if not item.waiting_for:
                del in_flight[seq]
                self._settle(item, item.error)
                self.completed += 1
        self._number()

    def _lost(self, exc: Exception) -> None:
        """A worker's channel failed (the worker died, or the transport broke)."""
        self._break(f"{type(exc).__name__}: {exc}")

    def _settle(self, item: Ticket, error: str | None) -> None:
        if item.finished:
            return
        item.finished, item.outcome = True, error
        if item._done is not None:
            item._done.set_result(error)
        if item.settled is not None:
            try:
                item.settled(error)
            except Exception:  # noqa: BLE001 - one op's bookkeeping must not stop the rest
                log.exception("%s: settling operation %d failed", self._name, item.seq)
        if self._observer is not None and item.ops is not None:
            kind = op_kind(item.op_for(0))
            with contextlib.suppress(Exception):
                self._observer(kind, item.seq, item.queued_ns, time.time_ns(), error)

    def _break(self, reason: str, *, failure: bool = True) -> None:
        if self.broken is not None:
            return
        self.broken = reason
        for item in [*self._in_flight.values(), *self._waiting.drain()]:
            self._settle(item, reason)
        self._in_flight.clear()
        self._numbered.clear()
        self._wake.set()
        if failure:
            log.error("%s: dispatch stopped: %s", self._name, reason)
            if self._on_broken is not None:
                self._on_broken(reason)
