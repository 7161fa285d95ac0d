"""The control channel over real loopback sockets: the hello and its token, batches in,
pushed completions out, refusals, a worker that goes away, and frames that are not
messages (a pickle exploit among them) on either end."""

import asyncio
import pickle
import socket
import threading

import pytest

import controller.channel
from controller.channel import ControllerEnd
from slicewise.common.codec import TO_CONTROLLER, TO_WORKER
from slicewise.common.framing import LENGTH, ChannelError, frame, hello, unframe
from slicewise.common.mesh import MeshAxis, MeshSpec
from slicewise.common.ops import DeleteOp, LoadOp, OpResult
from slicewise.testing import wait_until
from tests.unit.test_codec import Exploit
from worker import channel as worker_channel
from worker.channel import WorkerEnd
from worker.executor import InOrderExecutor
from worker.transport import DataServer

TIMEOUT = 10.0
TOKEN = "s3cret"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


class Worker:
    """A data server whose control connections go to a WorkerEnd feeding a real executor."""

    def done(self, op, launched_ns, started_ns, finished_ns, error, values):
        """As the worker's actor reports a completion: `ran` unless there is more to say."""
        if error is None and values is None:
            self.end.ran(op.seq, started_ns, finished_ns)
        else:
            self.end.completed(OpResult(op.seq, error, values, started_ns, finished_ns))

    def __init__(self, epoch=1, apply=lambda op: None, flush=True, **end_kwargs):
        self.end = WorkerEnd(TOKEN, epoch, self.submit, **end_kwargs)
        self.executor = InOrderExecutor(
            apply,
            on_done=self.done,
            on_idle=self.end.flush if flush else None,
        )
        self.server = DataServer("127.0.0.1", TOKEN, self.no_put, self.no_get, self.end.serve)
        self.batches = []

    def submit(self, ops):
        self.batches.append([op.seq for op in ops])
        self.executor.submit(ops)

    def no_put(self, *args):
        raise AssertionError("no puts here")

    def no_get(self, *args):
        raise AssertionError("no gets here")

    def close(self):
        self.server.close()
        self.executor.stop()


@pytest.fixture
def worker():
    w = Worker()
    yield w
    w.close()


async def receive_all(channel, count):
    seqs = []
    while len(seqs) < count:
        seqs.extend(r.seq for r in await channel.receive())
    return seqs


def test_batches_in_completions_out(worker):
    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        await channel.send([DeleteOp(1, ()), DeleteOp(2, ())])
        await channel.send([DeleteOp(3, ())])
        seqs = await receive_all(channel, 3)
        channel.close()
        return seqs

    assert run(scenario()) == [1, 2, 3]
    assert worker.batches == [[1, 2], [3]]


def test_errors_of_operations_come_back_with_their_completion():
    def apply(op):
        if op.seq == 2:
            raise ValueError("bad op")

    w = Worker(apply=apply)
    try:

        async def scenario():
            channel = await ControllerEnd.connect(w.server.address, TOKEN, 1, "host 0")
            await channel.send([DeleteOp(1, ()), DeleteOp(2, ())])
            results = []
            while len(results) < 2:
                results.extend(await channel.receive())
            channel.close()
            return results

        results = run(scenario())
    finally:
        w.close()
    assert [r.error for r in results] == [None, "ValueError: bad op"]


@pytest.mark.parametrize(
    "token, epoch, reason", [("wrong", 1, "token"), ("", 1, "token"), (TOKEN, 2, "stale epoch")]
)
def test_a_hello_without_the_token_or_epoch_is_refused(worker, token, epoch, reason):
    async def scenario():
        with pytest.raises(ChannelError, match=reason):
            await ControllerEnd.connect(worker.server.address, token, epoch, "host 0")

    run(scenario())
    assert worker.batches == []


def test_a_second_controller_is_refused_while_one_is_connected(worker):
    async def scenario():
        first = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        with pytest.raises(ChannelError, match="already has a controller"):
            await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        await first.send([DeleteOp(1, ())])  # the first still works
        seqs = await receive_all(first, 1)
        first.close()
        return seqs

    assert run(scenario()) == [1]


def test_a_reused_sequence_number_is_refused_on_the_channel(worker):
    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        await channel.send([DeleteOp(1, ())])
        await receive_all(channel, 1)
        await channel.send([DeleteOp(1, ())])
        with pytest.raises(ChannelError, match="already submitted"):
            await channel.receive()
        channel.close()

    run(scenario())


def test_unreachable_worker_is_a_channel_error():
    async def scenario():
        with pytest.raises(ChannelError, match="cannot reach host 3"):
            await ControllerEnd.connect("127.0.0.1:1", TOKEN, 1, "host 3")

    run(scenario())


def test_a_worker_that_goes_away_ends_the_channel_with_a_clear_error():
    w = Worker()

    async def scenario():
        channel = await ControllerEnd.connect(w.server.address, TOKEN, 1, "host 1 of slice s")
        # The worker's side of the connection drops (as when its process dies).
        with w.end._cond:
            conn = w.end._conn
        conn.shutdown(socket.SHUT_RDWR)
        with pytest.raises(ChannelError, match="host 1 of slice s closed its control channel"):
            await channel.receive()
        # A send says why too (it may be what notices first: a job's recovery names it).
        with pytest.raises(
            ChannelError,
            match="sending to host 1 of slice s failed: host 1 of slice s closed its control",
        ):
            await channel.send([DeleteOp(1, ())])
        channel.close()

    try:
        run(scenario())
    finally:
        w.close()


class Listener:
    """What a channel's listener is handed: frames of completions, then its failure."""

    def __init__(self, channel, raises=None):
        self.frames = []
        self.errors = []
        self.raises = raises
        self.changed = asyncio.Event()
        channel.listen(self.on_results, self.on_error)

    def on_results(self, done):
        self.frames.append(list(done.seqs))
        self.changed.set()
        if self.raises is not None:
            raise self.raises

    def on_error(self, error):
        self.errors.append(error)
        self.changed.set()

    async def until(self, condition):
        while not condition():
            self.changed.clear()
            await self.changed.wait()


def test_a_listener_is_handed_each_frame_of_completions_also_those_before_it_listened(worker):
    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        await channel.send([DeleteOp(1, ())])
        await receive_all(channel, 1)  # taken before anyone listened
        await channel.send([DeleteOp(2, ())])
        while worker.end.counts["frames_out"] < 2:  # op 2's completion was sent
            await asyncio.sleep(0.01)
        listener = Listener(channel)
        await listener.until(lambda: listener.frames)
        await channel.send([DeleteOp(3, ())])
        await listener.until(lambda: sum(map(len, listener.frames)) == 2)
        channel.close()
        return listener

    listener = run(scenario())
    assert listener.frames == [[2], [3]] and listener.errors == []


def test_a_listener_hears_once_that_the_worker_went_away_and_a_later_one_too():
    w = Worker()

    async def scenario():
        channel = await ControllerEnd.connect(w.server.address, TOKEN, 1, "host 1 of slice s")
        first = Listener(channel)
        with w.end._cond:
            conn = w.end._conn
        conn.shutdown(socket.SHUT_RDWR)
        await first.until(lambda: first.errors)
        with pytest.raises(ChannelError, match="sending to host 1 of slice s failed"):
            await channel.send([DeleteOp(1, ())])
        second = Listener(channel)  # on the failed channel: told the same at once
        await second.until(lambda: second.errors)
        channel.close()
        return first, second

    try:
        first, second = run(scenario())
    finally:
        w.close()
    assert len(first.errors) == 1
    assert "host 1 of slice s closed its control channel" in str(first.errors[0])
    assert [str(e) for e in second.errors] == [str(e) for e in first.errors]


def test_a_listener_hears_of_a_refused_batch(worker):
    async def scenario():
        refused = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        listener = Listener(refused)
        await refused.send([DeleteOp(1, ())])
        await listener.until(lambda: listener.frames)
        await refused.send([DeleteOp(1, ())])  # seq 1 again: the worker refuses it
        await listener.until(lambda: listener.errors)
        refused.close()
        return listener

    listener = run(scenario())
    assert listener.frames == [[1]] and len(listener.errors) == 1
    assert "host 0 refused operations" in str(listener.errors[0])
    assert "already submitted" in str(listener.errors[0])


def test_a_listener_that_raises_fails_the_channel_with_why():
    w = Worker()

    async def scenario():
        channel = await ControllerEnd.connect(w.server.address, TOKEN, 1, "host 0")
        listener = Listener(channel, raises=KeyError("a bug"))
        await channel.send([DeleteOp(1, ())])
        await listener.until(lambda: listener.errors)
        channel.close()
        return listener

    try:
        listener = run(scenario())
    finally:
        w.close()
    assert listener.frames == [[1]]
    assert [str(e) for e in listener.errors] == ["handling completions from host 0 failed: 'a bug'"]


def test_operations_that_complete_back_to_back_come_back_in_one_frame(worker):
    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        await channel.send([DeleteOp(seq, ()) for seq in range(1, 21)])
        frame = await channel.receive()
        channel.close()
        return [r.seq for r in frame]

    assert run(scenario()) == list(range(1, 21))


def send_three_unflushed(worker):
    """Sends ops 1-3 to a worker whose executor never flushes; the seqs that came back."""

    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        await channel.send([DeleteOp(seq, ()) for seq in range(1, 4)])
        seqs = await receive_all(channel, 3)
        channel.close()
        return seqs

    return run(scenario())


def test_completions_go_out_unflushed_also_while_the_backlog_is_deep():
    """With a deep backlog the bound is longer (FLUSH_AFTER_DEEP_S), never unbounded."""
    worker = Worker(flush=False, backlog=lambda: 10_000)
    try:
        assert send_three_unflushed(worker) == [1, 2, 3]
        # The worker counts a frame once it is sent, which may be after it arrived here.
        wait_until(
            lambda: worker.end.counts["completions_out"] == 3,
            timeout_s=TIMEOUT,
            what="the worker to count the completions it sent",
            interval_s=0.01,
        )
        assert worker.end.counts == {
            "frames_in": 1,
            "ops_in": 3,
            "frames_out": worker.end.counts["frames_out"],
            "completions_out": 3,
        }
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("backlog", "deep"),
    [
        (8, True),
        (10_000, True),
        (7, False),
        (5, False),  # a job's runner: 4 steps ahead of the one it reads, however long
        (0, False),
    ],
)
def test_the_queue_is_deep_from_LONG_BACKLOG_operations(backlog, deep):
    """Completions are held longer (FLUSH_AFTER_DEEP_S) while LONG_BACKLOG operations or
    more are queued here; what somebody waits for is hurried (see the hurry tests)."""
    end = WorkerEnd(TOKEN, 1, lambda ops: None, backlog=lambda: backlog)
    with end._cond:
        assert end._deep() is deep


def test_completions_go_out_unflushed_within_the_bound():
    """An executor that never says it is idle (busy for ever, say) still has its
    completions sent: the channel sends them FLUSH_AFTER_S after the first."""
    worker = Worker(flush=False)
    try:
        assert send_three_unflushed(worker) == [1, 2, 3]
    finally:
        worker.close()


def test_a_completion_after_a_flush_keeps_its_bound_while_the_sender_timed_a_longer_one(
    monkeypatch,
):
    """The sender is woken by a first completion only when it would look too late: here
    it times a deep queue's bound (made longer than the test waits) for a completion the
    executor then flushes itself; the queue is shallow when the next one completes, which
    must go out within the short bound, not when the sender would have looked again."""
    monkeypatch.setattr(worker_channel, "FLUSH_AFTER_DEEP_S", 10 * TIMEOUT)
    backlog = {"n": 10_000}
    worker = Worker(flush=False, backlog=lambda: backlog["n"])

    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        await channel.send([DeleteOp(1, ())])
        wait_until(
            lambda: worker.end._seqs == [1],
            timeout_s=TIMEOUT,
            what="op 1's completion to be queued",
            interval_s=0.01,
        )
        worker.end.flush()  # as an executor that went idle would
        first = await asyncio.wait_for(receive_all(channel, 1), TIMEOUT)
        backlog["n"] = 0
        await channel.send([DeleteOp(2, ())])
        second = await asyncio.wait_for(receive_all(channel, 1), TIMEOUT)
        channel.close()
        return first, second

    try:
        assert run(scenario()) == ([1], [2])
    finally:
        worker.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_hurried_completion_goes_out_at_once_though_the_queue_is_deep(when, monkeypatch):
    """The controller says it waits for an operation (a client's wait or fetch): its
    completion goes out as soon as it is made ("before"), or at once if it was made and
    is still held ("after"), though the deep queue's bound is longer than the test waits
    and the executor never says it is idle."""
    monkeypatch.setattr(worker_channel, "FLUSH_AFTER_DEEP_S", 10 * TIMEOUT)
    worker = Worker(flush=False, backlog=lambda: 10_000)

    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        if when == "before":
            channel.hurry(2)
        await channel.send([DeleteOp(seq, ()) for seq in (1, 2)])
        if when == "after":
            wait_until(
                lambda: worker.end._seqs == [1, 2],
                timeout_s=TIMEOUT,
                what="the completions to be held",
                interval_s=0.01,
            )
            channel.hurry(1)
        seqs = await asyncio.wait_for(receive_all(channel, 2), TIMEOUT)
        channel.close()
        return seqs

    try:
        assert run(scenario()) == [1, 2]
    finally:
        worker.close()


@pytest.mark.parametrize("flush", [True, False], ids=["flushed", "unflushed"])
def test_a_flush_sends_on_the_executors_thread_and_the_bound_on_the_senders(flush, monkeypatch):
    """An idle executor's flush sends its completions itself (no thread woken for it);
    those it never flushes go out from the sender thread within the bound."""
    if flush:  # so that only the flush can send them while the test waits
        monkeypatch.setattr(worker_channel, "FLUSH_AFTER_S", 10 * TIMEOUT)
    sent_by = []
    worker = Worker(
        flush=flush,
        on_sent=lambda batch, started, finished: sent_by.append(threading.current_thread().name),
    )
    try:
        assert send_three_unflushed(worker) == [1, 2, 3]
        # A frame is reported after it is sent: the controller may have read it first.
        wait_until(
            lambda: sent_by and len(sent_by) == worker.end.counts["frames_out"],
            timeout_s=TIMEOUT,
            what="every frame sent to be reported",
            interval_s=0.01,
        )
    finally:
        worker.close()
    assert set(sent_by) == {"in-order-executor" if flush else "control-sender"}


def test_a_worker_end_without_a_token_cannot_be_made():
    with pytest.raises(ValueError, match="needs a token"):
        WorkerEnd("", 1, lambda ops: None)


def test_heartbeats_carry_the_workers_progress_and_never_come_out_as_completions():
    beats = []

    def progress():
        beats.append(None)
        return {"oldest_seq": 7, "oldest_kind": "exec", "stalled_s": 1.5, "compiling": ""}

    worker = Worker(progress=progress, beat_s=0.01)

    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        connected = channel.heard_at
        # Beats only: a receive would wait for ever, so it is given until beats came.
        receiving = asyncio.ensure_future(channel.receive())
        while len(beats) < 3:
            await asyncio.sleep(0.01)
        while not channel.progress:
            await asyncio.sleep(0.01)
        assert not receiving.done()
        await channel.send([DeleteOp(1, ())])
        done = await receiving
        channel.close()
        return connected, channel, done

    try:
        connected, channel, done = run(scenario())
    finally:
        worker.close()
    assert [r.seq for r in done] == [1]
    assert channel.progress["oldest_seq"] == 7 and channel.progress["stalled_s"] == 1.5
    assert channel.heard_at > connected


# -- frames that are not messages ------------------------------------------------------


def raw_controller(address):
    """A connection to a worker that has said hello and read the worker's "ready"."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sock.sendall(hello(TOKEN, 1))
    (length,) = LENGTH.unpack(sock.recv(LENGTH.size, socket.MSG_WAITALL))
    assert unframe(sock.recv(length, socket.MSG_WAITALL), TO_CONTROLLER) == ("ready", None)
    return sock


def dropped(sock):
    """Whether the worker closed the connection (beats may come first)."""
    with sock:
        while True:
            head = sock.recv(LENGTH.size, socket.MSG_WAITALL)
            if not head:
                return True
            (length,) = LENGTH.unpack(head)
            assert unframe(sock.recv(length, socket.MSG_WAITALL), TO_CONTROLLER)[0] == "beat"


@pytest.mark.parametrize(
    "garbage",
    [
        "pickle",
        LENGTH.pack(2**62),  # a length no frame may have: nothing is allocated for it
        frame("done", [OpResult(1)]),  # a message for the controller, not for a worker
        LENGTH.pack(3) + b"\x92\xa6s",  # not msgpack
    ],
    ids=["pickle-exploit", "huge-length", "wrong-direction", "truncated"],
)
def test_a_worker_drops_a_connection_that_sends_garbage_and_serves_the_next(
    worker, tmp_path, garbage
):
    marker = tmp_path / "pwned"
    if garbage == "pickle":
        body = pickle.dumps(("submit", [Exploit(marker)]))
        garbage = LENGTH.pack(len(body)) + body
    sock = raw_controller(worker.server.address)
    sock.sendall(garbage)
    assert dropped(sock)
    assert not marker.exists() and worker.batches == []

    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        await channel.send([DeleteOp(1, ())])
        seqs = await receive_all(channel, 1)
        channel.close()
        return seqs

    assert run(scenario()) == [1]


class FakeWorker:
    """A socket that answers the controller's hello with "ready", then sends `garbage`."""

    def __init__(self, garbage):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.garbage = garbage
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        conn, _ = self.server.accept()
        with conn:
            conn.settimeout(TIMEOUT)
            (length,) = LENGTH.unpack(conn.recv(LENGTH.size, socket.MSG_WAITALL))
            conn.recv(length, socket.MSG_WAITALL)  # the hello
            conn.sendall(frame("ready", None) + self.garbage)
            conn.recv(1)  # until the controller hangs up

    def close(self):
        self.server.close()
        self.thread.join(TIMEOUT)


@pytest.mark.parametrize(
    "garbage, reason",
    [
        ("pickle", "malformed control frame"),
        (LENGTH.pack(2**62), "frame of 4611686018427387904 bytes announced"),
        (frame("submit", [DeleteOp(1, ())]), "unknown message 'submit'"),
        (LENGTH.pack(2) + b"{]", "Expecting property name"),  # nor JSON of a refusal
    ],
    ids=["pickle-exploit", "huge-length", "wrong-direction", "bad-json"],
)
def test_the_controller_refuses_a_worker_that_sends_garbage(tmp_path, garbage, reason):
    marker = tmp_path / "pwned"
    if garbage == "pickle":
        body = pickle.dumps(("done", [Exploit(marker)]))
        garbage = LENGTH.pack(len(body)) + body
    fake = FakeWorker(garbage)

    async def scenario():
        channel = await ControllerEnd.connect(fake.address, TOKEN, 1, "host 2")
        with pytest.raises(ChannelError, match=f"host 2 sent a bad frame: .*{reason}"):
            await channel.receive()
        channel.close()

    try:
        run(scenario())
    finally:
        fake.close()
    assert not marker.exists()


def test_a_batch_too_large_for_one_frame_travels_as_several_in_order(worker, monkeypatch):
    monkeypatch.setattr(controller.channel, "MAX_FRAME_BYTES", 300)
    ops = [LoadOp(seq, "p" * 64, bytes(200), MeshSpec((MeshAxis("x"),))) for seq in (1, 2, 3)]
    frames = controller.channel.encode_batch([*ops, DeleteOp(4, ())])
    assert len(frames) == 4
    decoded = [unframe(f[LENGTH.size :], TO_WORKER)[1] for f in frames]
    assert [op for batch in decoded for op in batch] == [*ops, DeleteOp(4, ())]
