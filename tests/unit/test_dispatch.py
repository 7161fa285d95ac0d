"""Dispatcher: sequence numbering, batched windowed delivery, and failure of a gang's transport."""

import asyncio

import pytest

from controller.dispatch import Dispatcher, GangBrokenError
from worker.ops import DeleteOp, OpResult

TIMEOUT = 5.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def until(condition):
    while not condition():
        await asyncio.sleep(0.001)


def delete(seq):
    return DeleteOp(seq, ())


class FakeWorkers:
    """The dispatcher's `send`: records each worker's batches; can hold, fail or err them."""

    def __init__(self, num_workers, *, errors=None, raises=None):
        self.batches = {w: [] for w in range(num_workers)}
        self.errors = errors or {}  # (worker, seq) -> error message in the reply
        self.raises = raises
        self.gate = asyncio.Event()
        self.gate.set()
        self.outstanding = dict.fromkeys(range(num_workers), 0)
        self.most_outstanding = 0

    async def send(self, worker, ops):
        self.batches[worker].append(list(ops))
        self.outstanding[worker] += 1
        self.most_outstanding = max(self.most_outstanding, self.outstanding[worker])
        try:
            await self.gate.wait()
            if self.raises is not None:
                raise self.raises
            return [OpResult(o.seq, self.errors.get((worker, o.seq))) for o in ops]
        finally:
            self.outstanding[worker] -= 1

    def seqs(self, worker):
        return [o.seq for batch in self.batches[worker] for o in batch]


def test_seq_numbers_start_at_one_and_each_op_is_built_with_its_own():
    async def scenario():
        workers = FakeWorkers(1)
        dispatcher = Dispatcher(workers.send, 1)
        submitted = [dispatcher.submit(delete) for _ in range(5)]
        await asyncio.gather(*(done for _, done in submitted))
        return [seq for seq, _ in submitted], workers.seqs(0)

    seqs, delivered = run(scenario())
    assert seqs == [1, 2, 3, 4, 5]
    assert delivered == [1, 2, 3, 4, 5]


def test_every_worker_receives_every_op_in_seq_order():
    async def scenario():
        workers = FakeWorkers(3)
        dispatcher = Dispatcher(workers.send, 3, max_batch=3, max_outstanding_batches=4)
        dones = [dispatcher.submit(delete)[1] for _ in range(10)]
        errors = await asyncio.gather(*dones)
        return workers, dispatcher, errors

    workers, dispatcher, errors = run(scenario())
    assert errors == [None] * 10
    for w in range(3):
        assert [len(batch) for batch in workers.batches[w]] == [3, 3, 3, 1]
        assert workers.seqs(w) == list(range(1, 11))
    assert dispatcher.dispatched == dispatcher.completed == 10


def test_per_worker_op_lists_go_to_their_own_worker():
    async def scenario():
        workers = FakeWorkers(3)
        dispatcher = Dispatcher(workers.send, 3)
        _, done = dispatcher.submit(lambda seq: [DeleteOp(seq, (f"w{w}",)) for w in range(3)])
        await done
        return workers

    workers = run(scenario())
    for w in range(3):
        assert workers.batches[w] == [[DeleteOp(1, (f"w{w}",))]]


def test_batches_are_bounded_and_few_are_outstanding_at_once():
    async def scenario():
        workers = FakeWorkers(2)
        workers.gate.clear()
        dispatcher = Dispatcher(workers.send, 2, max_batch=2, max_outstanding_batches=3)
        for _ in range(11):
            dispatcher.submit(delete)
        await until(lambda: all(len(b) == 3 for b in workers.batches.values()))
        await asyncio.sleep(0.01)  # time for a fourth batch to go out, if the window leaked
        queued = dispatcher.queued
        await dispatcher.close("test over")
        return workers, queued

    workers, queued = run(scenario())
    assert workers.batches[0] == [[delete(1), delete(2)], [delete(3), delete(4)],
                                  [delete(5), delete(6)]]
    assert workers.batches[1] == workers.batches[0]
    assert queued == 5
    assert workers.most_outstanding == 3


def test_queued_batches_go_out_when_outstanding_ones_complete():
    async def scenario():
        workers = FakeWorkers(1)
        dispatcher = Dispatcher(workers.send, 1, max_batch=1, max_outstanding_batches=1)
        dones = [dispatcher.submit(delete)[1] for _ in range(3)]
        return await asyncio.wait_for(asyncio.gather(*dones), 0.5)

    assert run(scenario()) == [None, None, None]


def test_a_worker_error_settles_only_that_op_with_the_first_workers_message():
    async def scenario():
        workers = FakeWorkers(3, errors={(1, 2): "boom on 1", (2, 2): "boom on 2"})
        dispatcher = Dispatcher(workers.send, 3)
        dones = [dispatcher.submit(delete)[1] for _ in range(3)]
        return dispatcher, await asyncio.gather(*dones)

    dispatcher, errors = run(scenario())
    assert errors == [None, "boom on 1", None]
    assert dispatcher.broken is None


def test_send_raising_breaks_the_gang_and_fails_everything_not_done():
    broken = []

    async def scenario():
        workers = FakeWorkers(2, raises=ConnectionError("actor died"))
        dispatcher = Dispatcher(workers.send, 2, max_batch=2, max_outstanding_batches=1,
                                on_broken=broken.append)
        dones = [dispatcher.submit(delete)[1] for _ in range(5)]
        errors = await asyncio.gather(*dones)
        with pytest.raises(GangBrokenError, match="actor died"):
            dispatcher.submit(delete)
        return workers, dispatcher, errors

    workers, dispatcher, errors = run(scenario())
    assert "ConnectionError: actor died" in dispatcher.broken
    assert broken == [dispatcher.broken]
    assert errors == [dispatcher.broken] * 5
    # the queued ops were failed, never sent: only the first batch reached the workers
    assert workers.seqs(0) == [1, 2]


def test_close_fails_pending_ops_without_calling_on_broken():
    broken = []

    async def scenario():
        workers = FakeWorkers(2)
        workers.gate.clear()
        dispatcher = Dispatcher(workers.send, 2, max_batch=1, max_outstanding_batches=1,
                                on_broken=broken.append)
        dones = [dispatcher.submit(delete)[1] for _ in range(3)]
        await until(lambda: workers.batches[1])
        await dispatcher.close("gang g1 was released")
        errors = await asyncio.gather(*dones)
        with pytest.raises(GangBrokenError, match="released"):
            dispatcher.submit(delete)
        return dispatcher, errors

    dispatcher, errors = run(scenario())
    assert errors == ["gang g1 was released"] * 3
    assert dispatcher.broken == "gang g1 was released"
    assert broken == []


def test_close_fails_a_batch_whose_delivery_has_not_started_yet():
    async def scenario():
        workers = FakeWorkers(1)
        dispatcher = Dispatcher(workers.send, 1)
        _, done = dispatcher.submit(delete)
        await asyncio.sleep(0)  # one step: the pump takes the op into a delivery task ...
        assert dispatcher.queued == 0
        assert workers.batches[0] == []  # ... which has not run yet
        await dispatcher.close("gang g1 was released")
        return await asyncio.wait_for(done, 0.5)

    assert run(scenario()) == "gang g1 was released"
