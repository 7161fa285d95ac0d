"""The gang manager against an in-memory cluster and a hand-moved clock (no Ray, no
processes): all-or-nothing admission, reservations rolled back when a slice loses a host,
the shared-gang attach race, callers that give up while queued, preemption and requeue,
and the status a client gets from a gang that is being preempted or has broken."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from controller.admission import GangManager
from controller.core import Controller
from controller.gang import SliceLostError
from controller.gangstate import GangState
from controller.options import ControllerOptions
from controller.servicer import ControllerServicer, status_code_for
from protos import controller_pb2 as pb
from slicewise.common.errors import (
    DeadlineError,
    FailedPreconditionError,
    GangBrokenError,
    WorkerError,
)
from slicewise.common.ops import DeleteOp
from tests.unit.fake_cluster import Clock, FakeCluster, FakeContext

TIMEOUT = 10.0
V4 = "v5litepod-4"  # one host of 4 chips: a slice is a host


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def until(condition):
    while not condition():
        await asyncio.sleep(0.001)


async def manager_for(cluster, clock=None, grace_s: float = 30.0) -> GangManager:
    manager = GangManager(
        cluster,
        clock=clock or Clock(),
        options=ControllerOptions(preemption_grace_s=grace_s),
        lost_poll_s=0.002,
    )
    await manager.refresh_inventory()
    return manager


def numbered(manager, number: int) -> str:
    """The id of the manager's gang or queued request numbered `number` (`g2-<suffix>`): a
    test knows which gang comes when, never the random part of its id."""
    ids = [*manager.gangs, *(r.request_id for r in manager.scheduler.queued())]
    (found,) = [i for i in ids if i.startswith(f"g{number}-")]
    return found


def holders(manager) -> dict[str, str]:
    return {
        name: holder
        for name in manager.scheduler.inventory
        if (holder := manager.scheduler.holder(name)) is not None
    }


# -- (a) admission ---------------------------------------------------------------------


def test_a_gang_starts_only_on_whole_free_slices_and_the_next_request_waits_its_turn():
    async def scenario():
        cluster = FakeCluster(V4, V4, V4, V4)
        manager = await manager_for(cluster)
        first, first_id = await manager.allocate(3, V4, client="a")
        second = asyncio.create_task(manager.allocate(3, V4, client="b"))
        await asyncio.sleep(0.01)
        waiting = (
            second.done(),
            manager.scheduler.position(numbered(manager, 2)),
            len(cluster.reservations),
            sorted(set(holders(manager).values())),
        )
        await manager.release(first_id)
        gang, _ = await second
        return cluster, first, gang, waiting

    cluster, first, second, waiting = run(scenario())
    assert first.state is GangState.RELEASED and second.state is GangState.READY
    done, position, reservations, held_by = waiting
    assert (done, position, reservations, held_by) == (False, 0, 1, [first.gang_id])
    one, two = cluster.reservations
    assert len(one.hosts) == len(two.hosts) == 3  # one bundle per host, all at once
    # The second gang was reserved only after the first one's hosts were freed.
    assert cluster.calls.index(("remove", one.name)) < cluster.calls.index(("reserve", two.name))
    assert len(cluster.live_workers()) == 3 and cluster.held() == [two]


def test_a_multi_host_slice_is_reserved_whole_with_its_head_on_host_0():
    async def scenario():
        cluster = FakeCluster("v5litepod-16", "v5litepod-16")
        manager = await manager_for(cluster)
        gang, _ = await manager.allocate(1, "v5litepod-16")
        return cluster, gang

    cluster, gang = run(scenario())
    (reservation,) = cluster.reservations
    assert [(h.worker_id, h.chips) for h in reservation.hosts] == [(h, 4) for h in range(4)]
    assert {h.slice_name for h in reservation.hosts} == {gang.slices[0].name}
    assert [bool(h.head_resource) for h in reservation.hosts] == [True, False, False, False]
    assert [w.spec.process_id for w in cluster.workers] == [0, 1, 2, 3]
    assert gang.state is GangState.READY and gang.epoch == 1


# -- (b) reservation rollback ----------------------------------------------------------


def test_a_slice_that_loses_a_host_mid_reservation_is_rolled_back_and_retried_in_place():
    async def scenario():
        clock = Clock()
        cluster = FakeCluster(V4, V4, V4, V4, auto_ready=False)
        manager = await manager_for(cluster, clock)
        first = asyncio.create_task(manager.allocate(3, V4, client="a"))
        reservation = await cluster.reservation()
        clock.advance(1)
        # Queued behind: it would fit on what the first leaves free, if it went first.
        behind = asyncio.create_task(manager.allocate(2, V4, client="b"))
        await asyncio.sleep(0.01)
        lost = reservation.slices[1]
        cluster.kill_host(lost)
        await manager.refresh_inventory()
        await until(lambda: reservation.removed)
        retry = await cluster.reservation()
        state_while_retrying = (reservation.removed, behind.done())
        retry.make_ready()
        gang, _ = await first
        position = manager.scheduler.position(numbered(manager, 2))
        behind.cancel()
        return cluster, gang, lost, reservation, retry, state_while_retrying, position

    cluster, gang, lost, reservation, retry, (removed, behind_done), position = run(scenario())
    assert removed and not behind_done
    assert not [w for w in cluster.workers if w.spec.name.endswith("e1-p0")]  # never formed
    assert lost not in retry.slices and len(retry.slices) == 3
    assert [s.name for s in gang.slices] == retry.slices
    assert gang.state is GangState.READY and gang.epoch == 2
    assert position == 0  # the later request still waits: the retry kept its place
    assert cluster.held() == [retry]


def test_a_reservation_that_keeps_losing_hosts_fails_after_its_attempts_leaving_nothing():
    async def scenario():
        cluster = FakeCluster(V4, V4, V4, V4, auto_ready=False)
        manager = await manager_for(cluster)
        allocating = asyncio.create_task(manager.allocate(1, V4))
        for _ in range(ControllerOptions().reserve_attempts):
            reservation = await cluster.reservation()
            cluster.kill_host(reservation.slices[0])
            await manager.refresh_inventory()
            await until(lambda r=reservation: r.removed)
        with pytest.raises(SliceLostError, match="lost a host"):
            await allocating
        return cluster, manager

    cluster, manager = run(scenario())
    assert len(cluster.reservations) == ControllerOptions().reserve_attempts
    assert cluster.held() == [] and cluster.live_workers() == []
    assert manager.gangs == {} and holders(manager) == {} and manager.scheduler.queued() == []
    assert status_code_for(SliceLostError("x")) is grpc.StatusCode.UNAVAILABLE


# -- (c) the shared-gang attach race ---------------------------------------------------


def test_two_clients_allocating_one_shared_name_at_once_attach_to_one_gang():
    async def scenario():
        cluster = FakeCluster(V4, V4, auto_ready=False)
        manager = await manager_for(cluster)
        both = asyncio.gather(
            manager.allocate(2, V4, client="x", shared="team", weight=1.0),
            manager.allocate(2, V4, client="y", shared="team", weight=2.0),
        )
        (await cluster.reservation()).make_ready()
        return cluster, manager, await both

    cluster, manager, ((gx, idx), (gy, idy)) = run(scenario())
    assert gx is gy and len(cluster.reservations) == 1 and list(manager.gangs) == [gx.gang_id]
    assert gx.gang_id.startswith("g1-")
    assert idx.split("@")[0] == idy.split("@")[0] == gx.gang_id and idx != idy
    assert sorted(gx.attachments.values()) == [("x", 1.0), ("y", 2.0)]


def test_when_a_shared_gang_cannot_be_created_both_clients_get_the_error_and_the_name_is_free():
    async def scenario():
        cluster = FakeCluster(V4, V4, auto_ready=False)
        manager = await manager_for(cluster)
        both = asyncio.gather(
            manager.allocate(2, V4, client="x", shared="team"),
            manager.allocate(2, V4, client="y", shared="team"),
            return_exceptions=True,
        )
        (await cluster.reservation()).fail(RuntimeError("no room on the hosts"))
        errors = await both
        cluster.auto_ready = True
        again, again_id = await manager.allocate(2, V4, client="z", shared="team")
        return cluster, errors, again, again_id

    cluster, errors, again, again_id = run(scenario())
    assert [type(e) for e in errors] == [WorkerError, WorkerError]
    assert all("no room on the hosts" in str(e) for e in errors)
    assert again.gang_id.startswith("g2-") and again_id.startswith(f"{again.gang_id}@")
    assert again.state is GangState.READY
    assert cluster.held() == [cluster.reservations[1]]


# -- (d) callers that give up ----------------------------------------------------------


def test_a_queued_caller_that_is_cancelled_or_times_out_leaves_nothing_behind():
    async def scenario():
        cluster = FakeCluster(V4, V4)
        manager = await manager_for(cluster)
        first, _ = await manager.allocate(2, V4)
        cancelled = asyncio.create_task(manager.allocate(2, V4))
        await asyncio.sleep(0.01)
        queued_before = [r.request_id for r in manager.scheduler.queued()]
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        with pytest.raises(DeadlineError, match="could be admitted in time: needs 2 free"):
            await manager.allocate(2, V4, timeout_s=0.02)
        return cluster, manager, first, queued_before

    cluster, manager, first, queued_before = run(scenario())
    assert [q.partition("-")[0] for q in queued_before] == ["g2"]
    assert manager.scheduler.queued() == [] and manager._waiters == {}
    assert list(manager.gangs) == [first.gang_id] and len(cluster.reservations) == 1


def test_a_caller_cancelled_just_as_it_is_admitted_gives_the_slices_back():
    async def scenario():
        cluster = FakeCluster(V4, V4)
        manager = await manager_for(cluster)
        _, first = await manager.allocate(2, V4)
        waiting = asyncio.create_task(manager.allocate(2, V4))
        await asyncio.sleep(0.01)
        await manager.release(first)  # admits the waiter before it runs again
        admitted = dict(holders(manager))
        waiting.cancel()
        results = await asyncio.gather(waiting, return_exceptions=True)
        return cluster, manager, admitted, results

    cluster, manager, admitted, results = run(scenario())
    assert [a.partition("-")[0] for a in set(admitted.values())] == ["g2"]
    assert isinstance(results[0], asyncio.CancelledError)
    assert holders(manager) == {} and manager.scheduler.queued() == []
    assert len(cluster.reservations) == 1 and manager.gangs == {}


def test_a_request_whose_max_wait_passes_gets_the_schedulers_reason():
    async def scenario():
        clock = Clock()
        cluster = FakeCluster(V4)
        manager = await manager_for(cluster, clock)
        await manager.allocate(1, V4)
        waiting = asyncio.create_task(manager.allocate(1, V4, max_wait_s=30))
        # Queued (its deadline taken) before the clock moves; a 10-ms sleep stood in for
        # this and under the suite's load the clock sometimes moved first.
        await until(lambda: len(manager.scheduler.queued()) == 1)
        clock.advance(31)
        manager.decide()
        with pytest.raises(DeadlineError, match="longer than its max wait of 30 s"):
            await waiting

    run(scenario())


# -- preemption and requeue ------------------------------------------------------------


def test_a_yielding_gang_stops_goes_preempted_and_resumes_when_admitted_again():
    async def scenario():
        clock = Clock()
        cluster = FakeCluster(V4, V4)
        manager = await manager_for(cluster, clock, grace_s=5.0)
        low, low_id = await manager.allocate(2, V4, client="low")
        events = low.watch()
        high_task = asyncio.create_task(manager.allocate(2, V4, client="high", priority=10))
        await until(lambda: low.state is GangState.PREEMPTING)
        await manager.release(low_id, requeue=True)
        yielded = (low.state, low.epoch, cluster.held())
        high, high_id = await high_task
        await manager.release(high_id)
        clock.advance(6)  # the backoff of a preempted gang
        manager.decide()
        await until(lambda: low.state is GangState.READY)
        kinds = [events.get_nowait()[0] for _ in range(events.qsize())]
        return cluster, low, yielded, kinds

    cluster, low, (state, epoch, held), kinds = run(scenario())
    assert state is GangState.PREEMPTED and epoch == 1 and held == []
    assert low.epoch == 2 and kinds == ["preempt", "preempted", "resumed"]
    assert [w.spec.name for w in cluster.live_workers()] == [
        f"slicewise-{low.gang_id}-e2-p0",
        f"slicewise-{low.gang_id}-e2-p1",
    ]
    assert len(cluster.held()) == 1


def test_a_preemption_that_comes_while_a_gang_starts_is_carried_out_once_it_is_up():
    async def scenario():
        clock = Clock()
        cluster = FakeCluster(V4, auto_ready=False)
        manager = await manager_for(cluster, clock, grace_s=5.0)
        low_task = asyncio.create_task(manager.allocate(1, V4, client="low"))
        reservation = await cluster.reservation()
        high_task = asyncio.create_task(manager.allocate(1, V4, priority=10))
        await asyncio.sleep(0.01)
        state_while_starting = manager.gangs[numbered(manager, 1)].state
        reservation.make_ready()
        low, _ = await low_task
        return state_while_starting, low.state, low.preempted_by, numbered(manager, 2), high_task

    starting, state, by, high_id, high_task = run(scenario())
    assert starting is GangState.STARTING
    assert state is GangState.PREEMPTING and by == high_id
    high_task.cancel()


# -- what a client of a gang being preempted (or broken) is told -----------------------


async def execute(servicer, gang_id):
    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        await servicer.Execute(pb.ExecuteRequest(gang_id=gang_id, program_id="p1"), context)
    return context.code, context.details


def test_execute_on_a_gang_being_preempted_gets_failed_precondition_with_the_reason():
    async def scenario():
        clock = Clock()
        cluster = FakeCluster(V4, V4)
        controller = Controller(
            backend=cluster,
            clock=clock,
            options=ControllerOptions(preemption_grace_s=5.0),
            simulated=True,
        )
        await controller.refresh_inventory()
        servicer = ControllerServicer(controller, jobs=None)
        low, low_id = await controller.allocate(2, V4, client="low")
        high_task = asyncio.create_task(controller.allocate(2, V4, client="high", priority=10))
        await until(lambda: low.state is GangState.PREEMPTING)
        in_grace = await execute(servicer, low_id)  # usable: the program is unknown
        clock.advance(6)  # the grace period is over: its slices are taken back
        controller.manager.decide()
        stopping_state = low.state
        stopping = await execute(servicer, low_id)
        await low.wait_stopped()
        preempted = await execute(servicer, low_id)
        high, _ = await high_task
        return in_grace, stopping_state, stopping, preempted, low.gang_id, high.gang_id

    in_grace, stopping_state, stopping, preempted, low, high = run(scenario())
    assert in_grace[0] is grpc.StatusCode.NOT_FOUND
    assert stopping_state is GangState.STOPPING
    code, details = stopping
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert f"gang {low} is being preempted by {high}" in details and "queued to resume" in details
    code, details = preempted
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert f"gang {low} was preempted by {high} and is queued to resume" in details


def test_a_gang_whose_worker_died_names_the_host_and_never_reports_internal():
    async def scenario():
        cluster = FakeCluster(V4, V4)
        controller = Controller(backend=cluster, clock=Clock(), simulated=True)
        await controller.refresh_inventory()
        servicer = ControllerServicer(controller, jobs=None)
        gang, gang_id = await controller.allocate(2, V4)
        dispatcher = gang.dispatcher
        ticket = dispatcher.submit(lambda seq: DeleteOp(seq, ()))
        await ticket.done
        cluster.channels[1].die()
        await until(lambda: gang.state is GangState.FAILED)
        with pytest.raises(GangBrokenError) as broken:
            dispatcher.submit(lambda seq: DeleteOp(seq, ()))
        return broken.value, await execute(servicer, gang_id), gang_id

    broken, (code, details), gang_id = run(scenario())
    host = "host 0 of slice sim-1-v5litepod-4"
    assert status_code_for(broken) is grpc.StatusCode.UNAVAILABLE and host in str(broken)
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert f"gang {gang_id} failed (WorkerError: {host} closed" in details
    assert "release it and allocate a new one" in details


def test_release_while_a_preemption_stop_is_under_way_follows_it_to_released():
    async def scenario():
        clock = Clock()
        cluster = FakeCluster(V4)
        manager = await manager_for(cluster, clock, grace_s=1.0)
        low, low_id = await manager.allocate(1, V4)
        high_task = asyncio.create_task(manager.allocate(1, V4, priority=10))
        await until(lambda: low.state is GangState.PREEMPTING)
        clock.advance(2)
        manager.decide()
        assert low.state is GangState.STOPPING
        await manager.release(low_id)
        high, _ = await high_task
        with pytest.raises(FailedPreconditionError, match=f"gang {low_id} was released"):
            manager.resolve(low_id)
        return low, high, manager

    low, high, manager = run(scenario())
    assert low.state is GangState.RELEASED
    assert manager.scheduler.queued() == [] and list(manager.gangs) == [high.gang_id]


def test_every_error_class_names_a_status_that_the_errors_docstring_documents():
    from slicewise.common import errors

    classes = [
        c
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.SlicewiseError)
    ]
    table = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in errors.__doc__.splitlines()
        if line.startswith("| ") and line.split("|")[1].strip()
    }
    for cls in classes:
        if cls is errors.SlicewiseError:
            continue
        assert table[cls.__name__] == cls.status, cls
        assert status_code_for(cls("x")) is grpc.StatusCode[cls.status]
    assert status_code_for(errors.InvalidTransitionError("bug")) is grpc.StatusCode.INTERNAL
    assert table["anything else"] == "INTERNAL"


@pytest.mark.parametrize(
    "bad",
    [
        {"worker_window": 0},
        {"reserve_attempts": 0},
        {"preemption_grace_s": -1.0},
        {"gang_start_timeout_s": 0.0},
        {"fetch_timeout_s": float("nan")},
    ],
)
def test_controller_options_refuse_values_that_cannot_work(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ControllerOptions(**bad)


# -- (f) a restart on the same journal ---------------------------------------------------


def test_a_restarted_controller_numbers_gangs_after_the_old_ones_and_says_what_became_of_them(
    tmp_path,
):
    from controller.journal import Journal

    async def scenario():
        journal = Journal(tmp_path / "journal.sqlite")
        old = Controller(backend=FakeCluster(V4, V4), journal=journal)
        await old.refresh_inventory()
        kept, _ = await old.allocate(1, V4, client="a")
        ended, _ = await old.allocate(1, V4, client="b")
        await old.release(ended.gang_id)
        # The old controller dies here with `kept` running; a new one opens the journal.
        new = Controller(backend=FakeCluster(V4, V4), journal=journal)
        await new.refresh_inventory()
        fresh, _ = await new.allocate(1, V4, client="c")
        errors = {}
        for gang_id in (kept.gang_id, ended.gang_id):
            with pytest.raises(FailedPreconditionError) as caught:
                new.get_gang(gang_id)
            errors[gang_id] = str(caught.value)
        return kept.gang_id, ended.gang_id, fresh.gang_id, errors, journal.running_gangs()

    kept, ended, fresh, errors, running = run(scenario())
    # An old id never names a new gang: the numbers go on counting.
    assert [i.partition("-")[0] for i in (kept, ended, fresh)] == ["g1", "g2", "g3"]
    assert "lost when the controller restarted" in errors[kept]
    assert "was released (before the controller restarted)" in errors[ended]
    assert running == [(fresh, "c")]


def test_stashes_started_on_a_gang_go_with_it_unless_handed_over():
    """A peer-recovering job starts a stash actor per host ahead of a failure; those the
    recovery hands to the next gang outlive this one, the rest are dropped with it."""

    async def scenario():
        cluster = FakeCluster(V4, V4)
        manager = await manager_for(cluster)
        gang, gang_id = await manager.allocate(2, V4, client="a")
        await gang.prepare_stashes(["s-p0", "s-p1"])
        gang.hand_over_stashes(["s-p1"])
        await manager.release(gang_id)
        return cluster

    cluster = run(scenario())
    assert [c for c in cluster.calls if c[0] == "drop_stash"] == [("drop_stash", "s-p0")]


def test_stashes_still_starting_when_the_gang_stops_are_dropped_once_the_workers_answer():
    """A job starts its stash actors beside its first steps; a worker that started its
    stash after the gang's stop dropped the gang's stashes must not leave it running
    (a stash is detached), unless a recovery handed it to the next gang."""

    async def scenario():
        cluster = FakeCluster(V4, V4)
        manager = await manager_for(cluster)
        gang, gang_id = await manager.allocate(2, V4, client="a")
        answer = asyncio.Event()

        async def slow_prepare(name):
            await answer.wait()

        for worker in cluster.workers:
            worker.prepare_stash = slow_prepare
        preparing = asyncio.ensure_future(gang.prepare_stashes(["s-p0", "s-p1"]))
        await asyncio.sleep(0)
        gang.hand_over_stashes(["s-p1"])
        await manager.release(gang_id)
        dropped_at_stop = [c for c in cluster.calls if c[0] == "drop_stash"]
        answer.set()
        await preparing
        return dropped_at_stop, [c for c in cluster.calls if c[0] == "drop_stash"]

    at_stop, in_all = run(scenario())
    assert at_stop == [("drop_stash", "s-p0")]
    assert in_all == [("drop_stash", "s-p0"), ("drop_stash", "s-p0")]
