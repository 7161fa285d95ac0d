"""The controller's per-gang dispatch queue: numbers operations, streams them to every
worker of the gang, and settles each one when all workers report it complete.

Clients get their answer as soon as an operation is queued (asynchronous dispatch).
Delivery and completion travel separately: `send` hands a batch to a worker and returns
once the worker has queued it, and one long poll per worker (`poll`) brings back
completions as they happen. So the pipeline to a worker stays full however long its
programs run, and the bound on it is explicit: at most `max_in_flight` operations sent
but not completed (the back-pressure the workers' bounded executors exert).

The transport is injected, so this runs in unit tests without processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from worker.ops import Op, OpResult

log = logging.getLogger(__name__)

# Hands a batch to worker `index`; returns once the worker has queued it.
Send = Callable[[int, list[Op]], Awaitable[None]]
# Worker `index`'s completions from position `cursor` of its completion log on (in the
# order they completed, which need not be sequence order); may wait a while for one.
Poll = Callable[[int, int], Awaitable[list[OpResult]]]
# Told about every settled operation: (op kind, seq, queued_ns, settled_ns, error).
Observer = Callable[[str, int, int, int, "str | None"], None]


@dataclass
class _Item:
    ops: Op | Sequence[Op]  # one op for every worker, or one per worker
    done: asyncio.Future[str | None]
    seq: int = 0
    queued_ns: int = 0
    waiting_for: set[int] = field(default_factory=set)  # workers yet to report
    error: str | None = None

    def op_for(self, worker: int) -> Op:
        return self.ops if not isinstance(self.ops, Sequence) else self.ops[worker]


class GangBrokenError(RuntimeError):
    """A worker of the gang failed; nothing more can run on it."""


class Dispatcher:
    """Sequence numbering, batched delivery and completion tracking for one gang."""

    def __init__(self, send: Send, poll: Poll, num_workers: int, *, max_batch: int = 128,
                 max_in_flight: int = 256, max_sends: int = 1,
                 on_broken: Callable[[str], None] | None = None,
                 observer: Observer | None = None) -> None:
        self._send = send
        self._poll = poll
        self._num_workers = num_workers
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        # One delivery at a time (per gang): operations that arrive while one is on its
        # way go together in the next batch, so a burst costs a few calls, not one each.
        self._max_sends = max_sends
        self._sending = 0
        self._on_broken = on_broken
        self._observer = observer
        self._next_seq = 1
        self._queue: deque[_Item] = deque()
        self._in_flight: dict[int, _Item] = {}
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self.broken: str | None = None
        self.dispatched = 0
        self.completed = 0
        self.most_in_flight = 0

    def submit(self, build: Callable[[int], Op | Sequence[Op]]) -> tuple[int, asyncio.Future[str | None]]:
        """Queues the operation `build(seq)` builds; returns (seq, future of its error).

        The future resolves to None when every worker completed the operation, or to the
        first worker's error message.

        Raises:
            GangBrokenError: the gang can no longer run anything.
        """
        if self.broken is not None:
            raise GangBrokenError(self.broken)
        seq = self._next_seq
        ops = build(seq)
        self._next_seq += 1
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._queue.append(_Item(ops, done, seq, time.time_ns()))
        self.dispatched += 1
        if not self._started:
            self._started = True
            self._spawn(self._pump())
            for w in range(self._num_workers):
                self._spawn(self._collect(w))
        self._wake.set()
        return seq, done

    @property
    def queued(self) -> int:
        return len(self._queue)

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
            while (self._queue and len(self._in_flight) < self._max_in_flight
                   and self._sending < self._max_sends):
                room = self._max_in_flight - len(self._in_flight)
                batch = [self._queue.popleft()
                         for _ in range(min(self._max_batch, room, len(self._queue)))]
                for item in batch:
                    item.waiting_for = set(range(self._num_workers))
                    self._in_flight[item.seq] = item
                self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
                self._sending += 1
                self._spawn(self._deliver(batch))

    async def _deliver(self, batch: list[_Item]) -> None:
        try:
            await asyncio.gather(*(self._send(w, [item.op_for(w) for item in batch])
                                   for w in range(self._num_workers)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a worker died or the transport broke
            self._break(f"{type(exc).__name__}: {exc}")
        finally:
            self._sending -= 1
            self._wake.set()

    async def _collect(self, worker: int) -> None:
        cursor = 0
        while self.broken is None:
            try:
                results = await self._poll(worker, cursor)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._break(f"{type(exc).__name__}: {exc}")
                return
            cursor += len(results)
            for result in results:
                item = self._in_flight.get(result.seq)
                if item is None:
                    continue
                item.waiting_for.discard(worker)
                if result.error and item.error is None:
                    item.error = result.error
                if not item.waiting_for:
                    del self._in_flight[result.seq]
                    self._settle(item, item.error)
                    self.completed += 1
                    self._wake.set()

    def _settle(self, item: _Item, error: str | None) -> None:
        if item.done.done():
            return
        item.done.set_result(error)
        if self._observer is not None:
            kind = type(item.op_for(0)).__name__.removesuffix("Op").lower()
            with contextlib.suppress(Exception):
                self._observer(kind, item.seq, item.queued_ns, time.time_ns(), error)

    def _break(self, reason: str, *, failure: bool = True) -> None:
        if self.broken is not None:
            return
        self.broken = reason
        for item in [*self._in_flight.values(), *self._queue]:
            self._settle(item, reason)
        self._in_flight.clear()
        self._queue.clear()
        self._wake.set()
        if failure:
            log.error("gang dispatch stopped: %s", reason)
            if self._on_broken is not None:
                self._on_broken(reason)
