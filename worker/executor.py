"""Runs a gang's operations strictly in sequence order, with a bounded number in flight.

Every worker of a gang must launch the same programs in the same order, or their
collectives wait on each other forever; the controller numbers the operations and this
executor applies them in exactly that order, whatever order they arrive in.

XLA dispatch is asynchronous: applying an operation may return a `Pending` whose
`wait()` blocks until the device work is done. Only `window` of those may be
outstanding at once (on XLA:CPU with gloo, dozens in flight slow down and can hang), so
the executor waits for the oldest before launching more: that is the back-pressure a
caller feels as later completions.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from slicewise.common.ops import Op, OpResult


class Pending(Protocol):
    """Work launched but maybe not finished; `wait` raises if it failed, and returns the
    values to report with the completion (or None)."""

    def wait(self) -> Any: ...


Apply = Callable[[Op], "Pending | None"]
OnFailure = Callable[[Op, str], None]
# Called once per operation when it completes: (op, started_ns, finished_ns, result).
OnDone = Callable[[Op, int, int, OpResult], None]
# Called whenever the executor is about to wait (for operations, or for device work):
# completions reported since can go out together now without delaying anything.
OnIdle = Callable[[], None]


class SequenceError(RuntimeError):
    """An operation arrived with a sequence number that was already used."""


class InOrderExecutor:
    """Applies operations in sequence order on one thread, at most `window` in flight."""

    def __init__(
        self,
        apply: Apply,
        *,
        window: int = 3,
        first_seq: int = 1,
        on_failure: OnFailure | None = None,
        on_done: OnDone | None = None,
        on_idle: OnIdle | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._apply = apply
        self._on_failure = on_failure
        self._on_done = on_done
        self._on_idle = on_idle or (lambda: None)
        self._window = window
        self._next = first_seq
        self._waiting: dict[int, tuple[Op, Future[OpResult]]] = {}
        self._in_flight: deque[tuple[Op, Pending, Future[OpResult], int]] = deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._max_in_flight = 0
        self._thread = threading.Thread(target=self._loop, name="in-order-executor", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        with self._cond:
            return self._next

    @property
    def window(self) -> int:
        return self._window

    @property
    def max_in_flight(self) -> int:
        """The most operations ever outstanding at once (for tests and stats)."""
        return self._max_in_flight

    def submit(self, ops: Sequence[Op]) -> list[Future[OpResult]]:
        """Queues operations; each future resolves once that operation has completed.

        Raises:
            SequenceError: an operation reuses a sequence number.
        """
        futures: list[Future[OpResult]] = []
        with self._cond:
            if self._stopped:
                raise RuntimeError("executor is stopped")
            seen: set[int] = set()
            for op in ops:  # all or nothing: check the whole batch before queueing any
                if op.seq < self._next or op.seq in self._waiting or op.seq in seen:
                    raise SequenceError(
                        f"operation {op.seq} was already submitted (next expected {self._next})"
                    )
                seen.add(op.seq)
            for op in ops:
                fut: Future[OpResult] = Future()
                self._waiting[op.seq] = (op, fut)
                futures.append(fut)
            self._cond.notify_all()
        return futures

    def run(self, ops: Sequence[Op], timeout: float | None = None) -> list[OpResult]:
        """Submits operations and blocks until all of them have completed."""
        return [f.result(timeout) for f in self.submit(ops)]

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and self._next not in self._waiting and not self._in_flight:
                    self._on_idle()
                    self._cond.wait()
                if self._stopped:
                    self._fail_all("worker is shutting down")
                    return
                ready = self._waiting.pop(self._next, None)
                if ready is not None:
                    self._next += 1
            if ready is None or len(self._in_flight) >= self._window:
                if self._in_flight:
                    self._on_idle()
                self._retire_oldest()
            if ready is not None:
                self._launch(*ready)

    def _launch(self, op: Op, fut: Future[OpResult]) -> None:
        started = time.time_ns()
        try:
            pending = self._apply(op)
        except Exception as exc:  # noqa: BLE001 - reported to the controller, not raised
            self._finish(op, fut, started, exc)
            return
        if pending is None:
            self._finish(op, fut, started, None)
        else:
            self._in_flight.append((op, pending, fut, started))
            self._max_in_flight = max(self._max_in_flight, len(self._in_flight))

    def _retire_oldest(self) -> None:
        if not self._in_flight:
            return
        op, pending, fut, started = self._in_flight.popleft()
        try:
            values = pending.wait()
        except Exception as exc:  # noqa: BLE001
            self._finish(op, fut, started, exc)
            return
        self._finish(op, fut, started, None, values)

    def _finish(
        self,
        op: Op,
        fut: Future[OpResult],
        started_ns: int,
        exc: BaseException | None,
        values: Any = None,
    ) -> None:
        message = None if exc is None else f"{type(exc).__name__}: {exc}"
        if message is not None and self._on_failure is not None:
            self._on_failure(op, message)
        result = OpResult(op.seq, message, values)
        if self._on_done is not None:
            self._on_done(op, started_ns, time.time_ns(), result)
        fut.set_result(result)

    def _fail_all(self, reason: str) -> None:
        for op, fut in self._waiting.values():
            fut.set_result(OpResult(op.seq, reason))
        self._waiting.clear()
        for op, _, fut, _ in self._in_flight:
            fut.set_result(OpResult(op.seq, reason))
        self._in_flight.clear()
