"""InOrderExecutor: strict sequence order, a bounded in-flight window, failures reported per op."""

import threading

import pytest

from slicewise.common.ops import DeleteOp, ExecOp
from slicewise.testing import wait_until
from worker.executor import WATCH_FROM_S, InOrderExecutor, Progress, SequenceError

TIMEOUT = 5.0  # the longest any test waits for something that should happen
QUIET = 0.05  # how long a test watches for something that must not happen


def op(seq):
    return DeleteOp(seq, ())


class Work:
    """A Pending: `wait` blocks until the test opens its gate, then maybe raises."""

    def __init__(self, device, seq, error):
        self.device, self.seq, self.error = device, seq, error
        self.gate = threading.Event()

    def wait(self):
        if not self.gate.wait(TIMEOUT):
            raise TimeoutError(f"gate of op {self.seq} was never opened")
        self.device.finished(self)
        if self.error is not None:
            raise self.error


class FakeDevice:
    """The executor's `apply`: records launches and how many launched ops are unfinished."""

    def __init__(self, *, gated=False, apply_errors=None, wait_errors=None):
        self.gated = gated
        self.apply_errors = apply_errors or {}
        self.wait_errors = wait_errors or {}
        self.launched = []
        self.work = {}
        self.running = 0
        self.most_running = 0
        self._cond = threading.Condition()

    def __call__(self, operation):
        if operation.seq in self.apply_errors:
            raise self.apply_errors[operation.seq]
        work = Work(self, operation.seq, self.wait_errors.get(operation.seq))
        if not self.gated:
            work.gate.set()
        with self._cond:
            self.launched.append(operation.seq)
            self.work[operation.seq] = work
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self._cond.notify_all()
        return work

    def finished(self, work):
        with self._cond:
            self.running -= 1

    def open(self, seq):
        self.work[seq].gate.set()

    def open_all(self):
        with self._cond:
            for work in self.work.values():
                work.gate.set()

    def wait_launched(self, seq):
        with self._cond:
            assert self._cond.wait_for(lambda: seq in self.launched, TIMEOUT), (
                f"op {seq} was never launched; launched {self.launched}"
            )

    def stays_unlaunched(self, seq):
        with self._cond:
            return not self._cond.wait_for(lambda: seq in self.launched, QUIET)


@pytest.fixture
def start():
    """Starts executors and stops them (gates opened first) when the test ends."""
    started = []

    def make(device, **kwargs):
        executor = InOrderExecutor(device, **kwargs)
        started.append((device, executor))
        return executor

    yield make
    for device, executor in started:
        device.open_all()
        executor.stop()


def results(futures):
    return [f.result(timeout=TIMEOUT) for f in futures]


def test_ops_submitted_out_of_order_are_applied_in_seq_order(start):
    device = FakeDevice()
    executor = start(device)
    futures = executor.submit([op(3)]) + executor.submit([op(1), op(4)]) + executor.submit([op(2)])
    assert [r.seq for r in results(futures)] == [3, 1, 4, 2]
    assert device.launched == [1, 2, 3, 4]
    assert executor.next_seq == 5


def test_nothing_is_applied_until_the_gap_in_the_sequence_is_filled(start):
    device = FakeDevice()
    executor = start(device)
    later = executor.submit([op(2), op(3)])
    assert device.stays_unlaunched(2)
    assert not any(f.done() for f in later)
    results(executor.submit([op(1)]) + later)
    assert device.launched == [1, 2, 3]


def test_reused_sequence_numbers_raise_sequence_error(start):
    executor = start(FakeDevice())
    executor.run([op(1), op(2)], timeout=TIMEOUT)
    with pytest.raises(SequenceError, match="operation 2 was already submitted"):
        executor.submit([op(2)])
    executor.submit([op(5)])  # queued behind the gap at 3
    with pytest.raises(SequenceError, match="operation 5"):
        executor.submit([op(5)])


def test_first_seq_sets_where_the_sequence_starts(start):
    device = FakeDevice()
    executor = start(device, first_seq=10)
    with pytest.raises(SequenceError):
        executor.submit([op(9)])
    executor.run([op(10)], timeout=TIMEOUT)
    assert device.launched == [10]


def test_a_rejected_batch_queues_none_of_its_ops(start):
    executor = start(FakeDevice())
    with pytest.raises(SequenceError):
        executor.submit([op(2), op(2)])
    executor.submit([op(2)])  # the rejected batch must not have taken seq 2


def test_window_below_one_is_refused():
    with pytest.raises(ValueError, match="window must be >= 1"):
        InOrderExecutor(FakeDevice(), window=0)


def test_in_flight_ops_never_exceed_the_window(start):
    device = FakeDevice()
    executor = start(device, window=3)
    executor.run([op(s) for s in range(1, 21)], timeout=TIMEOUT)
    assert device.launched == list(range(1, 21))
    assert executor.max_in_flight == 3
    assert device.most_running == 3


def test_launching_beyond_the_window_waits_for_the_oldest_op(start):
    device = FakeDevice(gated=True)
    executor = start(device, window=2)
    first, second, third = executor.submit([op(1), op(2), op(3)])
    device.wait_launched(2)
    assert device.stays_unlaunched(3)
    device.open(2)  # the newer op finishing does not make room: the oldest must
    assert device.stays_unlaunched(3)
    assert not second.done()
    device.open(1)
    device.wait_launched(3)
    assert first.result(timeout=TIMEOUT).error is None
    assert second.result(timeout=TIMEOUT).error is None
    assert not third.done()
    device.open(3)
    assert third.result(timeout=TIMEOUT).error is None
    assert device.most_running == 2


def test_on_idle_runs_when_nothing_is_left_to_launch_not_while_work_waits_for_room(start):
    events = []
    device = FakeDevice(gated=True)
    executor = start(
        device,
        window=1,
        on_done=lambda o, launched, s, f, error, values: events.append(o.seq),
        on_idle=lambda: events.append("idle"),
    )
    futures = executor.submit([op(1), op(2), op(3)])
    device.wait_launched(1)
    device.open(1)
    device.wait_launched(2)
    device.open(2)
    device.wait_launched(3)
    # Ops 2 and 3 waited for room in the window: the completions made meanwhile were
    # not flushed one by one (the executor had more to launch); only the idle call of
    # an executor that had no work yet may come first.
    # Op 3 was the last: the executor may have said it is idle since (only the devices
    # left to wait for), but not before.
    seen = list(events)
    first = seen.index(1)
    assert first <= 1 and seen[first : first + 2] == [1, 2], seen
    assert set(seen[first + 2 :]) <= {"idle"}, seen
    device.open(3)
    futures[2].result(timeout=TIMEOUT)
    # Nothing left at all: what completed is flushed before the executor waits.
    wait_until(lambda: events[-1] == "idle", timeout_s=TIMEOUT, what="the last idle call")
    assert events.count(3) == 1 and "idle" in events[events.index(3) :], events


def test_apply_raising_fails_that_op_and_calls_on_failure(start):
    failures = []
    device = FakeDevice(apply_errors={2: ValueError("bad input")})
    executor = start(device, on_failure=lambda o, message: failures.append((o, message)))
    got = executor.run([op(1), op(2), op(3)], timeout=TIMEOUT)
    assert [r.error for r in got] == [None, "ValueError: bad input", None]
    assert failures == [(op(2), "ValueError: bad input")]
    assert device.launched == [1, 3]


def test_pending_wait_raising_fails_that_op_and_calls_on_failure(start):
    failures = []
    exec_op = ExecOp(2, "prog", ("x",), ("y",))
    executor = start(
        FakeDevice(wait_errors={2: RuntimeError("device lost")}),
        on_failure=lambda o, message: failures.append((o, message)),
    )
    got = executor.run([op(1), exec_op, op(3)], timeout=TIMEOUT)
    assert [r.error for r in got] == [None, "RuntimeError: device lost", None]
    assert failures == [(exec_op, "RuntimeError: device lost")]


def test_stop_fails_queued_ops_and_refuses_new_ones():
    device = FakeDevice()
    executor = InOrderExecutor(device)
    queued = executor.submit([op(2), op(3)])
    executor.stop()
    assert [r.error for r in results(queued)] == ["worker is shutting down"] * 2
    assert device.launched == []
    with pytest.raises(RuntimeError, match="stopped"):
        executor.submit([op(1)])


MS = 1_000_000  # nanoseconds


class Clock:
    """The executor's clock, in nanoseconds; the fake device below moves it. `reads` are
    the times it told."""

    def __init__(self):
        self.now = 0
        self.reads = []

    def __call__(self):
        self.reads.append(self.now)
        return self.now


class Timed:
    """A Pending whose device work is done at `ready_ms` on the test's clock, once the
    test opens its gate (so that the clock moves when the test says), or fails then."""

    def __init__(self, clock, ready_ms, error=None):
        self.clock, self.ready_ms, self.error = clock, ready_ms, error
        self.gate = threading.Event()

    def wait(self):
        if not self.gate.wait(TIMEOUT):
            raise TimeoutError("gate never opened")
        self.clock.now = max(self.clock.now, self.ready_ms * MS)
        if self.error is not None:
            raise self.error


class TimedDevice(FakeDevice):
    """`apply` for timing tests: op `seq` takes `plan[seq] = (launch_ms, ready_ms)`: its
    launch costs `launch_ms` of host time, and its device work (None: none, the op is
    done when `apply` returns) is done at `ready_ms`, or fails then (`wait_errors`)."""

    def __init__(self, clock, plan, *, gated=True, wait_errors=None):
        super().__init__(gated=gated, wait_errors=wait_errors)
        self.clock, self.plan = clock, plan

    def __call__(self, operation):
        launch_ms, ready_ms = self.plan[operation.seq]
        self.clock.now += launch_ms * MS
        work = None
        if ready_ms is not None:
            work = self.work[operation.seq] = Timed(
                self.clock, ready_ms, self.wait_errors.get(operation.seq)
            )
            if not self.gated:
                work.gate.set()
        with self._cond:
            self.launched.append(operation.seq)
            self._cond.notify_all()
        return work


def ran_ms(result):
    return (result.started_ns / MS, result.finished_ns / MS)


def test_a_program_runs_from_the_later_of_its_launch_and_the_end_of_the_one_before(start):
    clock = Clock()
    launches = {}
    plan = {
        1: (1, 100),  # launched at 0, the devices are free: runs 0 -> 100
        2: (1, 250),  # launched at 1 behind program 1: runs 100 -> 250, not 1 -> 250
        3: (5, None),  # no device work; applied once 1 retired (window 2): 100 -> 105
        4: (1, 400),  # launched at 105 behind program 2: runs 250 -> 400
    }
    device = TimedDevice(clock, plan)
    executor = start(
        device,
        window=2,
        clock=clock,
        on_done=lambda o, launched, *_: launches.setdefault(o.seq, launched / MS),
    )
    futures = executor.submit([op(s) for s in plan])
    # The device finishes each program only once the executor has launched what it
    # launches meanwhile: that is when the clock moves to the program's end.
    device.wait_launched(2)
    device.open(1)
    device.wait_launched(4)
    device.open(2)
    device.open(4)
    got = results(futures)
    assert [ran_ms(r) for r in got] == [(0, 100), (100, 250), (100, 105), (250, 400)]
    assert [r.seconds for r in got] == [0.1, 0.15, 0.005, 0.15]
    assert launches == {1: 0, 2: 1, 3: 100, 4: 105}

    # The devices then sit idle until a new program comes: that wait is nobody's time.
    clock.now = 1000 * MS
    plan[5] = (1, 1100)
    device.gated = False
    (late,) = results(executor.submit([op(5)]))
    assert ran_ms(late) == (1000, 1100)


def test_a_programs_end_is_seen_when_it_happens_even_while_a_launch_blocks(start):
    """Launching a program can block for about as long as a program runs (XLA:CPU with
    cross-process collectives): the end of the program before it is still seen on time."""
    clock = Clock()
    unblock = threading.Event()

    class BlockingLaunch(TimedDevice):
        def __call__(self, operation):
            work = super().__call__(operation)
            if operation.seq == 2:
                assert unblock.wait(TIMEOUT)
            return work

    device = BlockingLaunch(clock, {1: (0, 100), 2: (0, 400)})
    futures = start(device, clock=clock).submit([op(1), op(2)])
    device.wait_launched(2)  # and stuck in that launch
    device.open(1)
    wait_until(lambda: 100 * MS in clock.reads, timeout_s=TIMEOUT, what="program 1's end")
    clock.now = 300 * MS  # when the blocked launch returns
    unblock.set()
    device.open(2)
    first, second = results(futures)
    assert ran_ms(first) == (0, 100)
    assert ran_ms(second) == (100, 400)


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_only_a_long_programs_end_is_watched_once_its_first_run_is_known(start, long):
    """The watcher thread waits for every program's first run; later runs of a program
    shorter than WATCH_FROM_S are waited for on the executor's own thread (no hand-over
    per call), with the same times reported; a long program's stay with the watcher."""
    clock = Clock()
    waited_by = {}

    class Recording(TimedDevice):
        def __call__(self, operation):
            work = super().__call__(operation)
            wait = work.wait

            def recorded_wait():
                waited_by[operation.seq] = threading.current_thread().name
                return wait()

            work.wait = recorded_wait
            return work

    run_ms = 2 * WATCH_FROM_S * 1e3 if long else WATCH_FROM_S * 1e3 / 2
    plan = {s: (0, s * run_ms) for s in (1, 2, 3)}  # back to back on the devices
    device = Recording(clock, plan, gated=False)
    executor = start(device, window=3, clock=clock)
    (first,) = results(executor.submit([ExecOp(1, "prog", ("x",), ("y",))]))
    later = results(executor.submit([ExecOp(s, "prog", ("x",), ("y",)) for s in (2, 3)]))
    assert waited_by[1] == "executor-watcher"
    seen_by = "executor-watcher" if long else "in-order-executor"
    assert waited_by[2] == waited_by[3] == seen_by
    assert [ran_ms(r) for r in [first, *later]] == [
        (0, run_ms),
        (run_ms, 2 * run_ms),
        (2 * run_ms, 3 * run_ms),
    ]


def test_a_failed_program_still_reports_when_it_ran(start):
    clock = Clock()
    device = TimedDevice(
        clock, {1: (1, 50)}, gated=False, wait_errors={1: RuntimeError("device lost")}
    )
    (failed,) = results(start(device, clock=clock).submit([op(1)]))
    assert failed.error == "RuntimeError: device lost"
    assert ran_ms(failed) == (0, 50)


def test_ops_that_never_ran_report_no_time():
    executor = InOrderExecutor(FakeDevice())
    queued = executor.submit([op(2)])
    executor.stop()
    (result,) = results(queued)
    assert (result.started_ns, result.finished_ns, result.seconds) == (0, 0, 0.0)


class FakeClock:
    def __init__(self):
        self.now_ns = 1_000_000_000

    def __call__(self):
        return self.now_ns


def test_progress_names_the_oldest_unfinished_op_and_how_long_nothing_completed(start):
    clock = FakeClock()
    device = FakeDevice(gated=True)
    executor = start(device, window=2, clock=clock)
    assert executor.progress() == Progress()  # idle: nothing held, no stall
    clock.now_ns += 5_000_000_000  # idle time is not a stall
    executor.submit([op(1), op(2)])
    device.wait_launched(2)
    clock.now_ns += 3_000_000_000
    assert executor.progress() == Progress(1, "delete", 3.0)
    device.open(1)
    wait_until(lambda: executor.progress().oldest_seq == 2, timeout_s=TIMEOUT, what="op 1 done")
    device.open(2)
    wait_until(lambda: executor.progress() == Progress(), timeout_s=TIMEOUT, what="all done")


def test_backlog_counts_what_is_held_until_it_completes(start):
    device = FakeDevice(gated=True)
    executor = start(device, window=2)
    assert executor.backlog() == 0
    futures = executor.submit([op(seq) for seq in range(1, 6)])
    device.wait_launched(2)
    assert executor.backlog() == 5  # two in flight, three queued behind them
    device.open(1)
    futures[0].result(timeout=TIMEOUT)
    assert executor.backlog() == 4
    for seq in range(2, 6):
        device.wait_launched(seq)
        device.open(seq)
    results(futures)
    assert executor.backlog() == 0


def test_progress_skips_programs_whose_outputs_are_ready_while_a_later_op_blocks(start):
    clock = FakeClock()
    blocked = threading.Event()
    release = threading.Event()
    device = FakeDevice()

    def apply(operation):
        if operation.seq == 2:  # a hung host: the executor's thread stops here
            blocked.set()
            release.wait(TIMEOUT)
            return None
        return device(operation)

    apply.open_all = release.set  # for the fixture's teardown
    executor = start(apply, window=3, clock=clock)
    executor.submit([op(1), op(2)])
    assert blocked.wait(TIMEOUT)
    # Op 1's work is done (ungated) but unreported: the thread that reports it is stuck.
    wait_until(lambda: device.running == 0, timeout_s=TIMEOUT, what="op 1's work done")
    assert executor.progress().oldest_seq == 2
    release.set()


class DoneAtLaunch(Timed):
    """A Pending whose work was done when its launch returned (XLA:CPU with collectives
    across processes); `waited_on` names the threads that waited for it."""

    def __init__(self, clock, ready_ms):
        super().__init__(clock, ready_ms)
        self.gate.set()
        self.waited_on = []

    def ready(self):
        return True

    def wait(self):
        self.waited_on.append(threading.current_thread().name)
        return super().wait()


def test_work_done_at_launch_is_finished_on_the_executor_thread_in_order(start):
    """No round trip through the watcher thread for it, unless programs launched before
    it are still to be reported (they go first)."""
    clock = Clock()
    pendings = {}

    def apply(operation):
        if operation.seq == 2:  # a program still running when 3 is launched
            work = pendings[2] = Timed(clock, 50)
        else:
            clock.now += 10 * MS
            work = pendings[operation.seq] = DoneAtLaunch(clock, clock.now // MS)
        return work

    apply.open_all = lambda: [p.gate.set() for p in pendings.values()]
    executor = start(apply, window=3, clock=clock)
    futures = executor.submit([op(1)])
    first = results(futures)
    futures = executor.submit([op(2), op(3)])
    wait_until(lambda: 3 in pendings, timeout_s=TIMEOUT, what="op 3 to be launched")
    pendings[2].gate.set()
    second, third = results(futures)
    assert pendings[1].waited_on == ["in-order-executor"]
    assert pendings[3].waited_on == ["executor-watcher"]  # behind 2, which was in flight
    assert ran_ms(first[0]) == (0, 10)
    assert ran_ms(second) == (10, 50) and ran_ms(third)[1] == 50
    assert executor.max_in_flight == 2


def test_a_call_of_several_runs_launches_once_the_programs_before_it_finished(start):
    """Its runs go back to back with the window to themselves (worker/runtime.py)."""
    device = FakeDevice(gated=True)
    executor = start(device, window=3)
    futures = executor.submit([op(1), ExecOp(2, "prog", ("x",), ("y",), repeat=4), op(3)])
    device.wait_launched(1)
    assert device.stays_unlaunched(2)  # a window of 3, but op 1 is still running
    device.open(1)
    device.wait_launched(2)
    device.open(2)
    device.wait_launched(3)  # an ordinary op after it goes as usual
    device.open(3)
    assert [f.result(timeout=TIMEOUT).error for f in futures] == [None, None, None]


def test_on_start_runs_on_the_executors_thread_before_any_operation(start):
    """How a simulated host puts its executor under its scheduling policy (worker/sched.py)."""
    seen = []
    device = FakeDevice()
    executor = start(
        device, on_start=lambda: seen.append((threading.get_native_id(), list(device.launched)))
    )
    assert [r.error for r in executor.run([op(1)], timeout=TIMEOUT)] == [None]
    assert seen == [(executor._thread.native_id, [])]
