"""The control channel over real loopback sockets: the hello and its token, batches in,
pushed completions out, refusals, and a worker that goes away."""

import asyncio
import socket

import pytest

from controller.channel import ControllerEnd
from slicewise.common.framing import ChannelError
from slicewise.common.ops import DeleteOp
from worker.channel import WorkerEnd
from worker.executor import InOrderExecutor
from worker.transport import DataServer

TIMEOUT = 10.0
TOKEN = "s3cret"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


class Worker:
    """A data server whose control connections go to a WorkerEnd feeding a real executor."""

    def __init__(self, epoch=1, apply=lambda op: None, **end_kwargs):
        self.end = WorkerEnd(TOKEN, epoch, self.submit, **end_kwargs)
        self.executor = InOrderExecutor(
            apply,
            on_done=lambda op, s, f, result: self.end.completed(result),
            on_idle=self.end.flush,
        )
        self.server = DataServer("127.0.0.1", self.no_put, self.no_get, self.end.serve)
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
        channel.close()

    try:
        run(scenario())
    finally:
        w.close()


def test_operations_that_complete_back_to_back_come_back_in_one_frame(worker):
    async def scenario():
        channel = await ControllerEnd.connect(worker.server.address, TOKEN, 1, "host 0")
        await channel.send([DeleteOp(seq, ()) for seq in range(1, 21)])
        frame = await channel.receive()
        channel.close()
        return [r.seq for r in frame]

    assert run(scenario()) == list(range(1, 21))


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
