"""The controller's per-gang dispatch queue: numbers operations and streams them to the
gang's workers in batches, with a bounded number of batches outstanding.

Clients get their answer as soon as an operation is queued (asynchronous dispatch);
the pump sends queued operations to every worker of the gang in sequence order, and
each operation's future settles when every worker has completed it. The transport to
the workers is injected (`send`), so this runs in unit tests without processes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from worker.ops import Op, OpResult

log = logging.getLogger(__name__)

# Sends one batch to worker `index`; resolves when the worker has completed all of it.
Send = Callable[[int, list[Op]], Awaitable[list[OpResult]]]
# Told about every settled operation: (op kind, seq, queued_ns, settled_ns, error).
Observer = Callable[[str, int, int, int, "str | None"], None]


@dataclass
class _Item:
    ops: Op | Sequence[Op]  # one op for every worker, or one per worker
    done: asyncio.Future[str | None]
    seq: int = 0
    queued_ns: int = 0

    def op_for(self, worker: int) -> Op:
        return self.ops if not isinstance(self.ops, Sequence) else self.ops[worker]


class GangBrokenError(RuntimeError):
    """A worker of the gang failed; nothing more can run on it."""


class Dispatcher:
    """Sequence numbering and batched, windowed delivery to a gang's workers."""

    def __init__(self, send: Send, num_workers: int, *, max_batch: int = 128,
                 max_outstanding_batches: int = 4,
                 on_broken: Callable[[str], None] | None = None,
                 observer: Observer | None = None) -> None:
        self._send = send
        self._num_workers = num_workers
        self._max_batch = max_batch
        self._max_outstanding = max_outstanding_batches
        self._on_broken = on_broken
        self._observer = observer
        self._next_seq = 1
        self._queue: deque[_Item] = deque()
        self._outstanding: dict[asyncio.Task[None], list[_Item]] = {}
        self._wake = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None
        self.broken: str | None = None
        self.dispatched = 0
        self.completed = 0

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
        if self._pump_task is None:
            self._pump_task = asyncio.create_task(self._pump(), name="dispatch-pump")
        self._wake.set()
        return seq, done

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def close(self, reason: str) -> None:
        """Fails everything not yet completed and stops the pump."""
        self._break(reason, failure=False)
        if self._pump_task is not None:
            self._pump_task.cancel()
        outstanding = dict(self._outstanding)
        for task, batch in outstanding.items():
            task.cancel()
            # A task cancelled before its first step never runs its own clean-up.
            self._fail(batch, reason)
        await asyncio.gather(*outstanding, return_exceptions=True)

    async def _pump(self) -> None:
        while self.broken is None:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and len(self._outstanding) < self._max_outstanding:
                batch = [self._queue.popleft()
                         for _ in range(min(self._max_batch, len(self._queue)))]
                task = asyncio.create_task(self._deliver(batch))
                self._outstanding[task] = batch

    async def _deliver(self, batch: list[_Item]) -> None:
        try:
            replies = await asyncio.gather(*(
                self._send(w, [item.op_for(w) for item in batch])
                for w in range(self._num_workers)
            ))
        except asyncio.CancelledError:
            self._fail(batch, self.broken or "cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - a worker died or the transport broke
            self._break(f"{type(exc).__name__}: {exc}")
            self._fail(batch, self.broken or str(exc))
            return
        finally:
            # Leave the window before waking the pump, or it would still see it full.
            self._outstanding.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._wake.set()
        for i, item in enumerate(batch):
            errors = [r[i].error for r in replies if r[i].error]
            self._settle(item, errors[0] if errors else None)
            self.completed += 1

    def _settle(self, item: _Item, error: str | None) -> None:
        if item.done.done():
            return
        item.done.set_result(error)
        if self._observer is not None:
            kind = type(item.op_for(0)).__name__.removesuffix("Op").lower()
            self._observer(kind, item.seq, item.queued_ns, time.time_ns(), error)

    def _fail(self, items: Sequence[_Item], reason: str) -> None:
        for item in items:
            self._settle(item, reason)

    def _break(self, reason: str, *, failure: bool = True) -> None:
        if self.broken is not None:
            return
        self.broken = reason
        self._fail(list(self._queue), reason)
        self._queue.clear()
        self._wake.set()
        if failure:
            log.error("gang dispatch stopped: %s", reason)
            if self._on_broken is not None:
                self._on_broken(reason)
