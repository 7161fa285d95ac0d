"""Dispatcher: sequence numbering, batched delivery, completion tracking, back-pressure,
and the failure of a gang's transport."""

import asyncio

import pytest

from controller.dispatch import Dispatcher
from slicewise.common.errors import WorkerError
from slicewise.common.ops import Completions, DeleteOp, OpResult

TIMEOUT = 5.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def until(condition):
    while not condition():
        await asyncio.sleep(0.001)


def delete(seq):
    return DeleteOp(seq, ())


class FakeWorkers:
    """The dispatcher's transport: `send` records batches; each op completes on its
    worker (in order) unless held back; completions go to the `listen`er in a callback
    of their own, as a channel hands over each frame it read."""

    def __init__(
        self, num_workers, *, errors=None, send_raises=None, listen_raises=None, hold=False
    ):
        self.batches = {w: [] for w in range(num_workers)}
        self.errors = errors or {}  # (worker, seq) -> error message
        self.send_raises = send_raises
        self.listen_raises = listen_raises
        self.completed = {w: [] for w in range(num_workers)}
        self.queued = {w: [] for w in range(num_workers)}
        self.hold = hold
        self.cursors = {w: 0 for w in range(num_workers)}
        self.listeners = {}

    async def send(self, worker, ops):
        await asyncio.sleep(0)
        if self.send_raises is not None:
            raise self.send_raises
        self.batches[worker].append(list(ops))
        self.queued[worker].extend(ops)
        if not self.hold:
            self.finish(worker)

    def finish(self, worker, count=None, order=None):
        """Completes the oldest `count` queued ops of a worker (all by default), in
        `order` (indices into them) if given: completions need not follow seq order."""
        count = len(self.queued[worker]) if count is None else count
        ops = self.queued[worker][:count]
        for i in order or range(len(ops)):
            self.completed[worker].append(
                OpResult(ops[i].seq, self.errors.get((worker, ops[i].seq)))
            )
        del self.queued[worker][:count]
        self.changed(worker)

    def changed(self, worker):
        """Hands what `worker` completed since to its listener, in a callback of its own."""
        asyncio.get_running_loop().call_soon(self._hand_over, worker)

    def listen(self, worker, on_results, on_error):
        self.listeners[worker] = (on_results, on_error)
        if self.listen_raises is not None:
            asyncio.get_running_loop().call_soon(on_error, self.listen_raises)
        else:
            self.changed(worker)

    def _hand_over(self, worker):
        if worker not in self.listeners or self.listen_raises is not None:
            return
        ready = self.completed[worker][self.cursors[worker] :]
        if ready:
            self.cursors[worker] += len(ready)
            self.listeners[worker][0](Completions.of(ready))

    def seqs(self, worker):
        return [o.seq for batch in self.batches[worker] for o in batch]


def test_seq_numbers_start_at_one_and_each_op_is_built_with_its_own():
    async def scenario():
        workers = FakeWorkers(1)
        dispatcher = Dispatcher(workers.send, workers.listen, 1)
        submitted = [dispatcher.submit(delete) for _ in range(5)]
        await asyncio.gather(*(t.done for t in submitted))
        await dispatcher.close("done")
        return [t.seq for t in submitted], workers.seqs(0)

    seqs, delivered = run(scenario())
    assert seqs == [1, 2, 3, 4, 5]
    assert delivered == [1, 2, 3, 4, 5]


def test_every_worker_receives_every_op_in_seq_order_in_bounded_batches():
    async def scenario():
        workers = FakeWorkers(3)
        dispatcher = Dispatcher(workers.send, workers.listen, 3, max_batch=3)
        dones = [dispatcher.submit(delete).done for _ in range(10)]
        errors = await asyncio.gather(*dones)
        await dispatcher.close("done")
        return workers, dispatcher, errors

    workers, dispatcher, errors = run(scenario())
    assert errors == [None] * 10
    for w in range(3):
        assert all(len(batch) <= 3 for batch in workers.batches[w])
        assert workers.seqs(w) == list(range(1, 11))
    assert dispatcher.dispatched == dispatcher.completed == 10


def test_per_worker_ops_go_to_their_own_worker():
    async def scenario():
        workers = FakeWorkers(2)
        dispatcher = Dispatcher(workers.send, workers.listen, 2)
        ticket = dispatcher.submit(lambda seq: [DeleteOp(seq, ("a",)), DeleteOp(seq, ("b",))])
        await ticket.done
        await dispatcher.close("done")
        return workers

    workers = run(scenario())
    assert workers.batches[0][0][0].handles == ("a",)
    assert workers.batches[1][0][0].handles == ("b",)


def test_a_batch_the_same_for_every_worker_is_broadcast_once_and_per_worker_ops_are_not():
    async def scenario():
        workers = FakeWorkers(2)
        broadcasts = []

        async def broadcast(ops):
            broadcasts.append([o.seq for o in ops])
            for w in range(2):
                await workers.send(w, ops)

        dispatcher = Dispatcher(workers.send, workers.listen, 2, broadcast=broadcast)
        await dispatcher.submit(delete).done
        await dispatcher.submit(lambda seq: [DeleteOp(seq, ("a",)), DeleteOp(seq, ("b",))]).done
        await dispatcher.close("done")
        return workers, broadcasts

    workers, broadcasts = run(scenario())
    assert broadcasts == [[1]]
    assert workers.seqs(0) == workers.seqs(1) == [1, 2]
    assert workers.batches[0][1][0].handles == ("a",)
    assert workers.batches[1][1][0].handles == ("b",)


def test_an_op_settles_only_when_every_worker_reported_it():
    async def scenario():
        workers = FakeWorkers(2, hold=True)
        dispatcher = Dispatcher(workers.send, workers.listen, 2)
        done = dispatcher.submit(delete).done
        await until(lambda: workers.queued[0] and workers.queued[1])
        workers.finish(0)
        await asyncio.sleep(0.01)
        early = done.done()
        workers.finish(1)
        result = await done
        await dispatcher.close("done")
        return early, result

    early, result = run(scenario())
    assert early is False
    assert result is None


def test_done_asked_for_only_after_the_op_settled_holds_its_outcome():
    """`Ticket.done` is made on first use: asked for after settling, it is already
    resolved, to the error the op failed with."""

    async def scenario():
        workers = FakeWorkers(1, errors={(0, 1): "boom"})
        dispatcher = Dispatcher(workers.send, workers.listen, 1)
        ticket = dispatcher.submit(delete)
        await until(lambda: ticket.finished)
        done = ticket.done
        resolved = done.done()
        await dispatcher.close("done")
        return resolved, done.result()

    resolved, outcome = run(scenario())
    assert resolved is True
    assert "boom" in outcome


def test_each_ops_settled_hook_hears_its_outcome_before_anyone_awaiting_it_runs():
    """`Ticket.settled` runs inside the settling (no event-loop turn per call); one that
    raises is logged and the other operations still settle."""

    async def scenario():
        workers = FakeWorkers(2, errors={(0, 2): "boom"})
        dispatcher = Dispatcher(workers.send, workers.listen, 2)
        heard = []
        tickets = [dispatcher.submit(delete) for _ in range(3)]

        def hook(k):
            def settled(error):
                heard.append((k, error))
                if k == 0:
                    raise RuntimeError("a broken hook")

            return settled

        for k, ticket in enumerate(tickets):
            ticket.settled = hook(k)

        async def awaiting(k):
            error = await tickets[k].done
            return (k, error) in heard, error

        results = await asyncio.gather(*(awaiting(k) for k in range(3)))
        await dispatcher.close("done")
        return heard, results

    heard, results = run(scenario())
    assert sorted(heard) == [(0, None), (1, "boom"), (2, None)]
    assert results == [(True, None), (True, "boom"), (True, None)]


def test_in_flight_operations_are_bounded_and_the_rest_follow_as_they_complete():
    async def scenario():
        workers = FakeWorkers(2, hold=True)
        dispatcher = Dispatcher(workers.send, workers.listen, 2, max_batch=2, max_in_flight=4)
        dones = [dispatcher.submit(delete).done for _ in range(11)]
        await until(lambda: len(workers.queued[0]) == 4 and len(workers.queued[1]) == 4)
        await asyncio.sleep(0.01)
        first_wave = (workers.seqs(0), dispatcher.in_flight, dispatcher.queued)
        while not all(d.done() for d in dones):  # complete one at a time, like slow programs
            for w in range(2):
                workers.finish(w, 1)
            await asyncio.sleep(0.001)
        await dispatcher.close("done")
        return first_wave, dispatcher, workers

    (delivered, in_flight, queued), dispatcher, workers = run(scenario())
    assert delivered == [1, 2, 3, 4] and in_flight == 4 and queued == 7
    assert dispatcher.most_in_flight == 4
    assert workers.seqs(0) == workers.seqs(1) == list(range(1, 12))
    assert dispatcher.completed == 11


def test_a_worker_error_fails_that_op_only():
    async def scenario():
        workers = FakeWorkers(2, errors={(1, 2): "boom on worker 1"})
        dispatcher = Dispatcher(workers.send, workers.listen, 2)
        dones = [dispatcher.submit(delete).done for _ in range(3)]
        results = await asyncio.gather(*dones)
        await dispatcher.close("done")
        return results, dispatcher.broken

    results, broken = run(scenario())
    assert results == [None, "boom on worker 1", None]
    assert broken == "done"


@pytest.mark.parametrize("where", ["send", "listen"])
def test_a_broken_transport_fails_everything_and_refuses_more(where):
    broken_calls = []

    async def scenario():
        error = ConnectionError("worker 0 died")
        workers = FakeWorkers(2, hold=True, **{f"{where}_raises": error})
        dispatcher = Dispatcher(
            workers.send,
            workers.listen,
            2,
            name="gang g7",
            max_in_flight=2,
            on_broken=broken_calls.append,
        )
        dones = [dispatcher.submit(delete).done for _ in range(5)]
        results = await asyncio.gather(*dones)
        # A WorkerError: the client gets UNAVAILABLE naming what died, never INTERNAL.
        with pytest.raises(WorkerError, match="gang g7 cannot run more work: .*worker 0 died"):
            dispatcher.submit(delete)
        await dispatcher.close("released")
        return results, dispatcher.broken

    results, broken = run(scenario())
    assert all("worker 0 died" in r for r in results)
    assert "worker 0 died" in broken
    assert len(broken_calls) == 1


def test_close_fails_pending_work_without_calling_it_broken():
    broken_calls = []

    async def scenario():
        workers = FakeWorkers(1, hold=True)
        dispatcher = Dispatcher(
            workers.send, workers.listen, 1, max_in_flight=1, on_broken=broken_calls.append
        )
        dones = [dispatcher.submit(delete).done for _ in range(3)]
        await until(lambda: workers.queued[0])
        await dispatcher.close("gang g1 was released")
        return await asyncio.gather(*dones)

    assert run(scenario()) == ["gang g1 was released"] * 3
    assert broken_calls == []


def test_observer_hears_every_settled_op_with_its_kind_and_timing():
    seen = []

    async def scenario():
        workers = FakeWorkers(1, errors={(0, 2): "bad"})
        dispatcher = Dispatcher(
            workers.send, workers.listen, 1, observer=lambda *args: seen.append(args)
        )
        await asyncio.gather(*(dispatcher.submit(delete).done for _ in range(2)))
        await dispatcher.close("done")

    run(scenario())
    assert [(kind, seq, error) for kind, seq, _, _, error in seen] == [
        ("delete", 1, None),
        ("delete", 2, "bad"),
    ]
    assert all(settled >= queued for _, _, queued, settled, _ in seen)


def test_completions_out_of_sequence_order_are_all_counted():
    """An upload completes at once while earlier programs still run: the later seq is
    reported first, and the earlier ones must still settle."""

    async def scenario():
        workers = FakeWorkers(2, hold=True)
        dispatcher = Dispatcher(workers.send, workers.listen, 2)
        dones = [dispatcher.submit(delete).done for _ in range(3)]
        await until(lambda: len(workers.queued[0]) == 3 and len(workers.queued[1]) == 3)
        workers.finish(0, order=[2, 0, 1])
        workers.finish(1, order=[2, 1, 0])
        results = await asyncio.gather(*dones)
        await dispatcher.close("done")
        return results, dispatcher.completed

    results, completed = run(scenario())
    assert results == [None, None, None]
    assert completed == 3


def test_ops_beyond_the_in_flight_bound_wait_unnumbered_and_follow_in_order():
    async def scenario():
        workers = FakeWorkers(1, hold=True)
        dispatcher = Dispatcher(workers.send, workers.listen, 1, max_in_flight=2)
        tickets = [dispatcher.submit(delete) for _ in range(5)]
        numbered_at_once = [t.seq for t in tickets]
        while not all(t.done.done() for t in tickets):
            workers.finish(0, 1)
            await asyncio.sleep(0.001)
        await dispatcher.close("done")
        return numbered_at_once, [t.seq for t in tickets], workers.seqs(0)

    at_once, final, delivered = run(scenario())
    assert at_once == [1, 2, 0, 0, 0]
    assert final == [1, 2, 3, 4, 5] and delivered == [1, 2, 3, 4, 5]


def test_clients_of_a_shared_gang_are_interleaved_by_weight():
    async def scenario():
        workers = FakeWorkers(1, hold=True)
        dispatcher = Dispatcher(workers.send, workers.listen, 1, max_in_flight=1)
        dispatcher.set_weight("a", 1.0)
        dispatcher.set_weight("b", 2.0)
        order = []
        blocker = dispatcher.submit(delete)  # holds the single slot while both queue up

        def tagged(client):
            return lambda seq: (order.append(client), DeleteOp(seq, ()))[1]

        tickets = [dispatcher.submit(tagged(c), client=c) for c in ["a"] * 10 + ["b"] * 20]
        while not all(t.done.done() for t in [blocker, *tickets]):
            workers.finish(0, 1)
            await asyncio.sleep(0.001)
        await dispatcher.close("done")
        return order

    order = run(scenario())
    first = order[:15]
    assert first.count("b") == 10 and first.count("a") == 5  # 1:2 while both wait
    assert sorted(order) == ["a"] * 10 + ["b"] * 20


def test_an_op_waits_until_what_it_needs_is_numbered():
    async def scenario():
        workers = FakeWorkers(1)
        dispatcher = Dispatcher(workers.send, workers.listen, 1)
        gate = {"open": False}
        held = dispatcher.submit(delete, client="b", ready=lambda: gate["open"])
        free = dispatcher.submit(delete, client="a")
        await free.done
        before = held.seq
        gate["open"] = True
        dispatcher.submit(delete, client="a")  # any later event numbers what is ready
        await held.done
        await dispatcher.close("done")
        return before, free.seq, held.seq

    before, free_seq, held_seq = run(scenario())
    assert before == 0 and free_seq == 1 and held_seq == 2


def test_a_build_that_fails_still_uses_its_seq_and_reports_the_error():
    async def scenario():
        workers = FakeWorkers(1)
        dispatcher = Dispatcher(workers.send, workers.listen, 1)

        def broken(seq):
            raise ValueError("cannot build")

        bad = dispatcher.submit(broken)
        good = dispatcher.submit(delete)
        results = [await bad.done, await good.done]
        await dispatcher.close("done")
        return results, workers.seqs(0)

    results, delivered = run(scenario())
    assert results == ["ValueError: cannot build", None]
    assert delivered == [1, 2]  # the worker's order has no hole


def test_each_workers_report_of_when_it_ran_an_op_lands_on_the_ticket():
    async def scenario():
        workers = FakeWorkers(2, hold=True)
        dispatcher = Dispatcher(workers.send, workers.listen, 2)
        ticket = dispatcher.submit(delete)
        await until(lambda: workers.queued[0] and workers.queued[1])
        for worker, (started, finished) in enumerate([(10, 30), (5, 45)]):
            workers.completed[worker].append(OpResult(ticket.seq, None, None, started, finished))
            workers.changed(worker)
        await ticket.done
        await dispatcher.close("done")
        return ticket

    assert run(scenario()).ran == {0: (10, 30), 1: (5, 45)}


def test_a_frame_of_plain_failed_and_reporting_completions_settles_each_in_its_order():
    async def scenario():
        workers = FakeWorkers(1, hold=True)
        dispatcher = Dispatcher(workers.send, workers.listen, 1)
        tickets = [dispatcher.submit(delete) for _ in range(4)]
        settled = []
        for t in tickets:
            t.settled = lambda error, seq=t.seq: settled.append(seq)
        await until(lambda: len(workers.queued[0]) == 4)
        seqs = [t.seq for t in tickets]
        # One frame, in the order they completed: plain, failed, reporting, plain.
        workers.completed[0] += [
            OpResult(seqs[2], None, None, 1, 2),
            OpResult(seqs[0], "ValueError: bad", None, 3, 4),
            OpResult(seqs[3], None, (1.5, "x"), 5, 6),
            OpResult(seqs[1], None, None, 7, 8),
        ]
        workers.changed(0)
        outcomes = [await t.done for t in tickets]
        await dispatcher.close("done")
        return tickets, outcomes, settled, seqs

    tickets, outcomes, settled, seqs = run(scenario())
    assert outcomes == ["ValueError: bad", None, None, None]
    assert settled == [seqs[2], seqs[0], seqs[3], seqs[1]]
    assert [t.values for t in tickets] == [None, None, None, (1.5, "x")]
    assert [t.ran for t in tickets] == [{0: (3, 4)}, {0: (7, 8)}, {0: (1, 2)}, {0: (5, 6)}]


def test_a_hurried_operation_is_hurried_on_the_workers_that_have_not_reported_it():
    """Somebody waits for an operation: each worker still running it is asked to report
    it at once; one that reported it already is not, nor is an operation that settled."""

    async def scenario():
        workers = FakeWorkers(2, hold=True)
        hurried = []
        dispatcher = Dispatcher(
            workers.send, workers.listen, 2, hurry=lambda w, seq: hurried.append((w, seq))
        )
        tickets = [dispatcher.submit(delete) for _ in range(3)]
        await until(lambda: len(workers.queued[1]) == 3)
        workers.finish(0, 2)  # worker 0 reported ops 1 and 2
        await until(lambda: 0 not in tickets[1].waiting_for)
        dispatcher.hurry(tickets[1])
        dispatcher.hurry(tickets[1])  # once is enough
        workers.finish(0)
        workers.finish(1)
        await asyncio.gather(*(t.done for t in tickets))
        dispatcher.hurry(tickets[2])  # settled: nobody to ask
        await dispatcher.close("done")
        return hurried

    assert run(scenario()) == [(1, 2)]


def test_an_operation_hurried_before_it_was_sent_is_hurried_once_it_is():
    async def scenario():
        workers = FakeWorkers(2, hold=True)
        hurried = []
        dispatcher = Dispatcher(
            workers.send,
            workers.listen,
            2,
            max_in_flight=1,
            hurry=lambda w, seq: hurried.append((w, seq, workers.seqs(w)[-1])),
        )
        first = dispatcher.submit(delete)
        second = dispatcher.submit(delete)  # waits for room: not numbered, not sent
        assert second.seq == 0
        dispatcher.hurry(second)
        await until(lambda: len(workers.queued[0]) == len(workers.queued[1]) == 1)
        assert hurried == []
        workers.finish(0)
        workers.finish(1)
        await first.done
        await until(lambda: len(hurried) == 2)  # within run()'s timeout
        snapshot = list(hurried)
        workers.finish(0)
        workers.finish(1)
        await second.done
        await dispatcher.close("done")
        return snapshot

    # Each worker was asked once the operation had been sent to it, and not before.
    assert run(scenario()) == [(0, 2, 2), (1, 2, 2)]
