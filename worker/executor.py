"""Runs a gang's operations strictly in sequence order, with a bounded number in flight.

Every worker of a gang must launch the same programs in the same order, or their
collectives wait on each other forever; the controller numbers the operations and this
executor applies them in exactly that order, whatever order they arrive in.

XLA dispatch is asynchronous: applying an operation may return a `Pending` whose
`wait()` blocks until the device work is done. Only `window` of those may be
outstanding at once (on XLA:CPU with gloo, dozens in flight slow down and can hang), so
the executor waits for the oldest before launching more: that is the back-pressure a
caller feels as later completions.

Each completion says when its operation ran (`OpResult.started_ns` / `finished_ns`), as
this host measured it; the controller's step times and the "execute" spans of the
timeline are these figures. For a program: from when it could start using the devices
to when its outputs were ready (see `_Flight`). A second thread, the watcher, waits for
the programs in flight one by one, so that the moment each is done is seen when it
happens, not when the executor's thread gets round to looking: launching a program can
itself block for about as long as a program runs (XLA:CPU with cross-process
collectives does), and building a batch takes time too.

The watcher costs a wake-up and a hand-over per program, which is nothing beside a
training step but not beside a 1-ms call. So it watches only programs whose last run
took WATCH_FROM_S or longer (and every program's first run, and work that is not a
program's). A shorter program's end is seen by the executor's thread itself: it waits
for the oldest program when the window is full or nothing is left to launch, waking
when the program ends, as the watcher would; and before each launch it retires the
programs already done. Only a program that ends while a launch blocks is seen late,
when the launch returns.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from slicewise.common.ops import Op, OpResult, op_kind


class Pending(Protocol):
    """Work launched but maybe not finished; `wait` raises if it failed, and returns the
    values to report with the completion (or None). It may also have `ready()`: whether
    the work is done already (then `wait` returns at once)."""

    def wait(self) -> Any: ...


Apply = Callable[[Op], "Pending | None"]
OnFailure = Callable[[Op, str], None]
# Called once per operation when it completes: (op, launched_ns, started_ns, finished_ns,
# error, values), what an OpResult holds, as they are: most operations complete with
# neither error nor values, and their completions travel as columns (ops.Completions),
# so no object is made for them. A program launched while earlier ones still ran starts
# running later than it was launched: `started_ns` says when.
OnDone = Callable[[Op, int, int, int, "str | None", Any], None]
Clock = Callable[[], int]  # wall-clock nanoseconds
# Called whenever the executor is about to wait with nothing to launch (no operations,
# or only device work to wait for): completions reported since should go out now. While
# operations are queued behind a full window it is not called: the completions of a busy
# stretch then travel together (the channel bounds how long one waits; channel.py).
# It runs on the executor's thread, holding none of the executor's locks.
OnIdle = Callable[[], None]


@dataclass(frozen=True)
class Progress:
    """Where the executor is, for the heartbeat: the oldest operation it holds and has not
    completed (seq 0 when none), and for how long it has completed nothing while holding
    work. A host stuck in a collective shows a stall that grows, at the op it is stuck in."""

    oldest_seq: int = 0
    oldest_kind: str = ""
    stalled_s: float = 0.0


# Programs whose last run on the devices took at least this long are watched (see above).
WATCH_FROM_S = 0.005


class SequenceError(RuntimeError):
    """An operation arrived with a sequence number that was already used."""


class _Flight:
    """A launched program: what the watcher learns of it, and when.

    It ran from max(its launch, the previous program's end) to when its outputs were
    ready. Programs in flight run one after another in launch order on the host's
    devices (a training step reads the previous step's outputs), so a program launched
    while up to `window - 1` others were ahead of it only starts when the one before it
    ends: counting from its launch would count their time too (about `window` times the
    step time in a steady training loop), and counting from the previous end alone
    would count the time the devices sat idle waiting for work as the program's own.
    This way each moment the devices were busy counts once, for the program that had
    them, and the intervals are exactly the "execute" spans of the timeline.
    """

    __slots__ = (
        "done",
        "error",
        "fut",
        "launched_ns",
        "op",
        "pending",
        "poll",
        "ready_ns",
        "values",
        "watched",
    )

    def __init__(
        self,
        op: Op,
        pending: Pending,
        fut: Future[OpResult] | None,
        launched_ns: int,
        watched: bool,
    ) -> None:
        self.op, self.pending, self.fut, self.launched_ns = op, pending, fut, launched_ns
        self.watched = watched  # by the watcher thread; else the executor's sees its end
        # For one not watched: whether it is done yet, if the pending work can say.
        self.poll: Callable[[], bool] | None = None if watched else getattr(pending, "ready", None)
        # Set by the watcher under the executor's `_watched` condition (one condition for
        # all flights: an Event each cost ~20 us per operation to make).
        self.done = False
        self.values: Any = None
        self.error: Exception | None = None
        self.ready_ns = 0


def _seen_done(flight: _Flight) -> bool:
    """Whether the flight's program is known to be done: the watcher said so, or, for one
    it does not watch, its outputs are ready."""
    return flight.done or (flight.poll is not None and flight.poll())


class InOrderExecutor:
    """Applies operations in sequence order on one thread, at most `window` in flight; a
    second thread watches the programs in flight finish (all but short ones)."""

    def __init__(
        self,
        apply: Apply,
        *,
        window: int = 3,
        first_seq: int = 1,
        on_failure: OnFailure | None = None,
        on_done: OnDone | None = None,
        on_idle: OnIdle | None = None,
        on_start: Callable[[], object] | None = None,
        clock: Clock = time.time_ns,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._apply = apply
        self._on_failure = on_failure
        self._on_done = on_done
        self._on_idle = on_idle or (lambda: None)
        self._on_start = on_start  # called first on the executor's thread
        self._clock = clock
        # When the outputs of the last program retired were ready: the devices were busy
        # with it until then, so a program launched earlier could not start before.
        self._devices_free_ns = 0
        # program id -> how long its last run kept the devices busy (ns): which to watch.
        self._last_run_ns: dict[str, int] = {}
        self._window = window
        self._next = first_seq
        # Queued operations by seq, with the future `submit` returned (None: `enqueue`).
        self._waiting: dict[int, tuple[Op, Future[OpResult] | None]] = {}
        self._in_flight: deque[_Flight] = deque()
        self._to_watch: queue.SimpleQueue[_Flight | None] = queue.SimpleQueue()
        self._watched = threading.Condition(threading.Lock())  # a flight's `done` set
        # The hot paths take the lock itself: `with` on a Condition is two calls in Python.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stopped = False
        self._max_in_flight = 0
        self._held = 0  # submitted and not completed (see backlog), changed under _cond
        # For `progress`: the operation being applied on the executor's thread, and when
        # the executor last completed one (or got work after having none).
        self._applying: Op | None = None
        self._retiring: _Flight | None = None  # taken off the window, being waited for
        self._progress_ns = clock()
        self._thread = threading.Thread(target=self._loop, name="in-order-executor", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="executor-watcher", daemon=True)
        self._thread.start()
        self._watcher.start()

    @property
    def next_seq(self) -> int:
        with self._cond:
            return self._next

    @property
    def window(self) -> int:
        return self._window

    def backlog(self) -> int:
        """Operations submitted and not completed yet (safe from any thread)."""
        return self._held

    @property
    def max_in_flight(self) -> int:
        """The most operations ever outstanding at once (for tests and stats)."""
        return self._max_in_flight

    def progress(self) -> Progress:
        """The oldest operation held and not completed, and how long nothing completed
        (safe to call from any thread: a racy read only ever reports an op a moment old)."""
        with self._cond:
            waiting = self._waiting.get(self._next)
        # A program whose outputs are ready is done, though the executor's thread (busy,
        # or stuck, on a later op) has not reported it yet.
        flights = [self._retiring, *list(self._in_flight)]
        running = [f.op for f in flights if f is not None and not _seen_done(f)]
        oldest = running[0] if running else self._applying
        if oldest is None and waiting is not None:
            oldest = waiting[0]
        if oldest is None:
            return Progress()
        stalled = max(0, self._clock() - self._progress_ns) / 1e9
        return Progress(oldest.seq, op_kind(oldest), stalled)

    def submit(self, ops: Sequence[Op]) -> list[Future[OpResult]]:
        """Queues operations; each future resolves once that operation has completed.

        Raises:
            SequenceError: an operation reuses a sequence number.
        """
        return self._queue(ops, with_futures=True)

    def enqueue(self, ops: Sequence[Op]) -> None:
        """Queues operations whose completions only `on_done` hears of (the control
        channel's way: no future to make and resolve per operation).

        Raises:
            SequenceError: an operation reuses a sequence number.
        """
        self._queue(ops, with_futures=False)

    def _queue(self, ops: Sequence[Op], *, with_futures: bool) -> list[Future[OpResult]]:
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
            if not self._waiting and not self._in_flight and self._applying is None:
                self._progress_ns = self._clock()  # idle until now: no stall so far
            for op in ops:
                fut: Future[OpResult] | None = None
                if with_futures:
                    fut = Future()
                    futures.append(fut)
                self._waiting[op.seq] = (op, fut)
            self._held += len(ops)
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
        self._to_watch.put(None)  # after what it is waiting for, if that ever ends

    def _loop(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            with self._lock:
                # `_idle()`, spelled out: asked once per operation.
                while not self._stopped and self._next not in self._waiting and not self._in_flight:
                    # Not under the lock: it may send (the channel's flush), and the
                    # receiver must be able to queue meanwhile.
                    self._cond.release()
                    try:
                        self._on_idle()
                    finally:
                        self._cond.acquire()
                    if self._idle():
                        self._cond.wait()
                if self._stopped:
                    self._fail_all("worker is shutting down")
                    return
                ready = self._waiting.pop(self._next, None)
                if ready is not None:
                    self._next += 1
            if ready is None or len(self._in_flight) >= self._window:
                if ready is None and self._in_flight:
                    self._on_idle()  # nothing to launch: only the devices to wait for
                self._retire_oldest()
            if ready is not None:
                # Programs already done are reported before the next launch, which may
                # block for long (or for ever, on a host stuck in a collective): the
                # channel sends what is reported within its bound whatever this thread
                # then does.
                # A call of several runs (ExecOp.repeat) keeps the window to itself: its
                # runs are launched back to back, up to `window` of them unfinished at
                # once, once the programs before it have finished. (`_seen_done` spelled
                # out: asked before every launch.)
                runs = getattr(ready[0], "repeat", 1) > 1
                while self._in_flight:
                    oldest = self._in_flight[0]
                    if not (runs or oldest.done or (oldest.poll is not None and oldest.poll())):
                        break
                    self._retire_oldest()
                self._launch(*ready)

    def _idle(self) -> bool:
        """Nothing to launch and nothing in flight (under `_cond`)."""
        return not self._stopped and self._next not in self._waiting and not self._in_flight

    def _launch(self, op: Op, fut: Future[OpResult] | None) -> None:
        launched = self._clock()
        self._applying = op
        try:
            pending = self._apply(op)
        except Exception as exc:  # noqa: BLE001 - reported to the controller, not raised
            self._finish(op, fut, launched, launched, self._clock(), exc)
            return
        finally:
            self._applying = None
        if pending is None:  # done on this thread: it ran from launch to now
            self._finish(op, fut, launched, launched, self._clock(), None)
        elif not self._in_flight and (ready := getattr(pending, "ready", None)) and ready():
            # Done by the time its launch returned (XLA:CPU may run a program with
            # collectives across processes inside the launch), with nothing before it to
            # report first: finished now, here, without a round trip through the watcher.
            ready_ns = self._clock()
            values, error = None, None
            try:
                values = pending.wait()
            except Exception as exc:  # noqa: BLE001 - reported to the controller, not raised
                error = exc
            started = max(launched, self._devices_free_ns)
            self._devices_free_ns = ready_ns
            self._ran(op, ready_ns - started)
            self._max_in_flight = max(self._max_in_flight, 1)
            self._finish(op, fut, launched, started, ready_ns, error, values)
        else:
            # Whether the watcher thread should see it end (see the module's docstring):
            # yes unless it is a program whose last run was short.
            program = getattr(op, "program_id", None)
            last = self._last_run_ns.get(program) if program is not None else None
            watched = last is None or last >= WATCH_FROM_S * 1e9
            flight = _Flight(op, pending, fut, launched, watched)
            self._in_flight.append(flight)
            if flight.watched:
                self._to_watch.put(flight)
            self._max_in_flight = max(self._max_in_flight, len(self._in_flight))

    def _watch(self) -> None:
        """The watcher thread: waits for each launched program in turn (in launch order,
        the order they run in) and notes when its outputs were ready."""
        while (flight := self._to_watch.get()) is not None:
            try:
                flight.values = flight.pending.wait()
            except Exception as exc:  # noqa: BLE001 - reported to the controller, not raised
                flight.error = exc
            flight.ready_ns = self._clock()
            with self._watched:
                flight.done = True
                self._watched.notify()

    def _ran(self, op: Op, busy_ns: int) -> None:
        """Notes how long a program's run kept the devices busy (which to watch)."""
        program = getattr(op, "program_id", None)
        if program is not None:
            self._last_run_ns[program] = busy_ns

    def _retire_oldest(self) -> None:
        """Waits until the oldest program in flight is done (seen by the watcher, or here
        when it is not watched), and reports when it ran (see `_Flight`)."""
        if not self._in_flight:
            return
        flight = self._retiring = self._in_flight.popleft()
        if flight.watched:
            with self._watched:
                while not flight.done:
                    self._watched.wait()
        else:
            try:
                flight.values = flight.pending.wait()
            except Exception as exc:  # noqa: BLE001 - reported to the controller, not raised
                flight.error = exc
            flight.ready_ns = self._clock()
            flight.done = True
        self._retiring = None
        started = max(flight.launched_ns, self._devices_free_ns)
        self._devices_free_ns = flight.ready_ns
        program = getattr(flight.op, "program_id", None)  # `_ran`, spelled out (per op)
        if program is not None:
            self._last_run_ns[program] = flight.ready_ns - started
        self._finish(
            flight.op,
            flight.fut,
            flight.launched_ns,
            started,
            flight.ready_ns,
            flight.error,
            flight.values,
        )

    def _finish(
        self,
        op: Op,
        fut: Future[OpResult] | None,
        launched_ns: int,
        started_ns: int,
        finished_ns: int,
        exc: BaseException | None,
        values: Any = None,
    ) -> None:
        message = None if exc is None else f"{type(exc).__name__}: {exc}"
        if message is not None and self._on_failure is not None:
            self._on_failure(op, message)
        self._progress_ns = self._clock()
        with self._lock:
            self._held -= 1
        if self._on_done is not None:
            self._on_done(op, launched_ns, started_ns, finished_ns, message, values)
        if fut is not None:
            fut.set_result(OpResult(op.seq, message, values, started_ns, finished_ns))

    def _fail_all(self, reason: str) -> None:
        self._held = 0  # under _cond, as _loop calls this
        for op, fut in self._waiting.values():
            if fut is not None:
                fut.set_result(OpResult(op.seq, reason))
        self._waiting.clear()
        for flight in self._in_flight:
            if flight.fut is not None:
                flight.fut.set_result(OpResult(flight.op.seq, reason))
        self._in_flight.clear()
