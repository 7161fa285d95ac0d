"""Gang scheduling on a real simulated cluster of four v5litepod-4 slices: all-or-nothing
admission checked against Ray's own placement-group table, reservations that lose a host,
shared gangs with weighted shares, and preemption of a lower-priority gang."""

from __future__ import annotations

import json
import re
import threading

import jax
import numpy as np
import pytest

import slicewise
from controller.simcluster import SimulationProcess
from programs.microbench import allreduce_add
from protos import controller_pb2 as pb
from slicewise.testing import wait_until
from tests.integration.conftest import controller_log, start_controller

pytestmark = pytest.mark.integration

# Seconds a gang being preempted is given to save its state and release.
GRACE_S = 10


@pytest.fixture(scope="module")
def cluster():
    sim = SimulationProcess("4xv5litepod-4")
    try:
        yield sim
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def failpoints(tmp_path_factory):
    path = tmp_path_factory.mktemp("failpoints") / "failpoints.json"
    path.write_text("{}")
    return path


@pytest.fixture(scope="module")
def sched_controller(tmp_path_factory, cluster, failpoints):
    controller = start_controller(
        tmp_path_factory,
        "scheduling",
        ray_address=cluster.address,
        env={"SLICEWISE_FAILPOINTS": str(failpoints)} | cluster.ray_env(),
        extra_args=("--preemption-grace", str(GRACE_S)),
    )
    try:
        yield controller
    finally:
        controller.stop()


@pytest.fixture(scope="module")
def ray_table(sched_controller):
    """Ray's placement-group table, read by a second driver of the same cluster."""
    from benchmarks.common import attached_to_ray

    with slicewise.connect(sched_controller.address) as client, attached_to_ray(client):
        import ray

        def table():
            return {
                pg["name"]: pg
                for pg in ray.util.placement_group_table().values()
                if pg["name"].startswith("slicewise-")
            }

        yield table


def partial_groups(table) -> list[str]:
    """Placement groups that hold some but not all of their bundles (a created group must
    hold all of them)."""
    bad = []
    for name, pg in table.items():
        placed = len(pg.get("bundles_to_node_id") or {})
        total = len(pg["bundles"])
        if 0 < placed < total or (pg["state"] == "CREATED" and placed != total):
            bad.append(f"{name}: {pg['state']} with {placed}/{total} bundles placed")
    return bad


def sampling(ray_table, seen: list[str], condition):
    """`condition` for `wait_until`, that also adds the partial placement groups of each
    look at Ray's table to `seen`."""

    def check():
        seen.extend(partial_groups(ray_table()))
        return condition()

    return check


def test_two_clients_ask_for_three_of_four_slices_at_once(sched_controller, ray_table):
    order: list[tuple[str, str]] = []  # ("allocated" | "releasing", client), as they happen
    results: dict[str, object] = {}
    release = threading.Event()

    def client_run(name):
        try:
            with slicewise.connect(sched_controller.address, name=name) as c:
                gang = c.allocate(slices=3, slice_type="v5litepod-4", timeout=240)
                order.append(("allocated", name))
                mesh = gang.mesh()
                x = gang.put(np.ones(12, np.float32), mesh.sharding(("slice", "chip")))
                results[name] = gang.compile(jax.jit(lambda a: a * 2), x)(x).fetch().tolist()
                if not release.wait(timeout=240):
                    results[name] = "not released in time"
                order.append(("releasing", name))
                gang.release()
        except Exception as exc:  # noqa: BLE001 - reported by the assertions below
            results[name] = exc

    def first_given():
        failed = {n: r for n, r in results.items() if isinstance(r, Exception)}
        assert not failed, failed  # fail now rather than wait for the other in vain
        return order and order[0][1]

    threads = [threading.Thread(target=client_run, args=(n,), daemon=True) for n in "ab"]
    for t in threads:
        t.start()
    seen_partial: list[str] = []
    first = wait_until(
        sampling(ray_table, seen_partial, first_given),
        timeout_s=240,
        interval_s=0.1,
        what="one of the two clients to be given three slices",
    )
    second = "b" if first == "a" else "a"
    # One is admitted; the other waits in the queue with a reason, however often we look.
    with slicewise.connect(sched_controller.address) as observer:

        def queued():
            info = observer.cluster_info()
            return info if info.queue else None

        snapshots = [
            wait_until(
                sampling(ray_table, seen_partial, queued),
                timeout_s=120,
                interval_s=0.1,
                what=f"client {second}'s request to show in the queue",
            )
        ]
        for _ in range(10):
            seen_partial += partial_groups(ray_table())
            snapshots.append(observer.cluster_info())
    assert ("allocated", second) not in order, order
    for info in snapshots:
        assert [(q.client, q.num_slices, q.position) for q in info.queue] == [(second, 3, 0)]
        assert "free" in info.queue[0].reason, info.queue[0]
        # Never more than one gang's slices, never a part of a gang.
        assert sum(s.state == pb.SLICE_STATE_HELD for s in info.slices) == 3, info.slices
    release.set()
    wait_until(
        sampling(ray_table, seen_partial, lambda: not any(t.is_alive() for t in threads)),
        timeout_s=240,
        interval_s=0.1,
        what="both clients to finish",
    )
    assert not seen_partial, seen_partial
    assert results == {"a": [2.0] * 12, "b": [2.0] * 12}  # both ran, correctly
    # The second was given its slices only once the first was giving them back.
    assert order.index(("releasing", first)) < order.index(("allocated", second)), order
    assert not [pg for pg in ray_table().values() if pg["state"] != "REMOVED"]


# Programs counted while both clients of the shared gang have calls waiting: enough that
# the calls in flight at either end of the count (the gang numbers up to 32 ahead) cannot
# move the ratio by more than a few percent.
SHARED_PROGRAMS = 2000
# Calls per burst (each on the one before: a call each, not a chain, which would be one
# operation), and bursts a client keeps unfinished: far more work queued than
# the gang can run, with a deep reserve so that the client thread, on a busy 2-core
# machine, is never the one that runs dry (its share is then its weight's, not its
# submission rate's).
CHAIN_CALLS = 16
RESERVE = 8


def test_a_shared_gang_interleaves_two_clients_by_weight(sched_controller):
    """Weights 1:2, both clients keep more work queued than the gang has room for."""
    stop = threading.Event()
    out: dict[str, dict] = {}
    ready = threading.Barrier(3)

    def client_run(name, weight):
        with slicewise.connect(sched_controller.address, name=name) as c:
            gang = c.allocate(
                slices=2, slice_type="v5litepod-4", shared="team", weight=weight, timeout=240
            )
            mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
            y = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
            step = gang.compile(allreduce_add(mesh.abstract, ("slice", "chip")), y)
            out[name] = {"gang": gang, "calls": 0}
            ready.wait(timeout=240)
            outstanding = [y]
            while not stop.is_set():
                for _ in range(CHAIN_CALLS):  # back to back: they travel together
                    y = step(y)
                out[name]["calls"] += CHAIN_CALLS
                outstanding.append(y)
                if len(outstanding) > 2 * RESERVE:
                    # Tops up again once only RESERVE requests are left unfinished.
                    done = len(outstanding) - RESERVE - 1
                    outstanding[done].block_until_ready(timeout=120)
                    slicewise.delete(outstanding[:done])
                    del outstanding[:done]
            out[name]["value"] = y.fetch(timeout=120).tolist()
            gang.release()

    threads = [
        threading.Thread(target=client_run, args=(n, w), daemon=True)
        for n, w in [("light", 1.0), ("heavy", 2.0)]
    ]
    for t in threads:
        t.start()
    ready.wait(timeout=240)
    gang = out["light"]["gang"]
    assert gang.id.split("@")[0] == out["heavy"]["gang"].id.split("@")[0]  # one gang

    def run_since(shares, start) -> dict[str, int]:
        return {c: shares[c].programs_run - start[c].programs_run for c in shares}

    start: dict = {}

    def counted():
        """The shares at the start and at the end of a count of SHARED_PROGRAMS during
        which every look found both clients with calls waiting: weights decide only
        between clients that both want to run, so a look that finds one without starts
        the count again."""
        shares = {s.client: s for s in gang.stats().shares}
        if set(shares) != {"light", "heavy"} or not all(s.waiting for s in shares.values()):
            start.clear()
        elif not start:
            start.update(shares)
        elif sum(run_since(shares, start).values()) >= SHARED_PROGRAMS:
            return dict(start), shares
        return None

    before, after = wait_until(
        counted, timeout_s=180, what=f"{SHARED_PROGRAMS} programs run with both clients waiting"
    )
    stop.set()
    for t in threads:
        t.join(timeout=180)
    assert all(not t.is_alive() for t in threads), "a client hung"
    run = run_since(after, before)
    assert abs(run["light"] / run["heavy"] - 0.5) <= 0.05, (run, before, after)
    for name in ("light", "heavy"):  # every call's result, in order: pmean + 1 each time
        assert out[name]["value"] == [float(out[name]["calls"])] * 8


def test_a_higher_priority_request_preempts_a_whole_lower_priority_gang(sched_controller):
    with (
        slicewise.connect(sched_controller.address, name="low") as low_client,
        slicewise.connect(sched_controller.address, name="high") as high_client,
    ):
        low = low_client.allocate(slices=2, slice_type="v5litepod-4", priority=0, timeout=120)
        events: list[tuple[str, float]] = []
        watcher = threading.Thread(
            target=lambda: events.extend((e.kind, e.grace_s) for e in low.events()),
            daemon=True,
        )
        watcher.start()

        def kinds() -> list[str]:
            return [k for k, _ in events]

        # A watch is not acknowledged; it is registered long before anything happens to
        # the gang, which takes starting another gang's workers and a program on this one.
        other = low_client.allocate(slices=1, slice_type="v5litepod-4", priority=5, timeout=120)
        mesh = low.mesh()
        x = low.put(np.ones(8, np.float32), mesh.sharding(("slice", "chip")))
        double = low.compile(jax.jit(lambda a: a * 2), x)
        assert double(x).fetch().tolist() == [2.0] * 8

        granted: list = []

        def ask():
            try:
                granted.append(
                    high_client.allocate(
                        slices=3, slice_type="v5litepod-4", priority=10, timeout=120
                    )
                )
            except Exception as exc:  # noqa: BLE001 - reported by the assertions below
                granted.append(exc)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        wait_until(lambda: "preempt" in kinds(), timeout_s=60, what="the low gang's preempt event")
        # Within its grace period the victim keeps its whole gang and the request waits.
        assert double(x).fetch().tolist() == [2.0] * 8
        assert not granted, granted
        asker.join(timeout=150)
        assert granted and isinstance(granted[0], slicewise.Gang), granted
        high = granted[0]
        wait_until(lambda: len(events) >= 2, timeout_s=60, what="the low gang's second event")
        assert kinds()[:2] == ["preempt", "preempted"], events
        assert 0.0 < events[0][1] <= GRACE_S  # the grace period it was given
        assert set(high.slices) >= set(low.slices)  # took the victim's slices, all of them
        # A call returns at once; the refusal comes back on its output.
        with pytest.raises(slicewise.FailedPreconditionError, match="was preempted"):
            double(x).fetch()
        # The priority-5 gang was not the cheapest victim... it kept its slice.
        assert (
            other.compile(jax.jit(lambda a: a + 1), np.zeros(4, np.float32))(
                np.zeros(4, np.float32)
            )
            .fetch()
            .tolist()
            == [1.0] * 4
        )
        other.release()
        high.release()

        wait_until(lambda: "resumed" in kinds(), timeout_s=120, what="the low gang to resume")
        y = low.put(np.full(8, 3.0, np.float32), mesh.sharding(("slice", "chip")))
        assert double(y).fetch().tolist() == [6.0] * 8  # the program loads again by itself
        low.release()


def test_a_host_lost_during_reservation_is_rolled_back_and_retried_elsewhere(
    sched_controller, cluster, failpoints, ray_table
):
    # The first reservation pauses before it asks Ray for anything. The pause outlasts
    # the time Ray takes to see the host gone (~15 s here) and is cut short by the
    # rollback. It is cleared once the host is gone and before Ray notices, so the retry
    # does not pause (had it read the file first, it would pause once more: slower, not
    # wrong).
    failpoints.write_text(json.dumps({"reserve_delay_s": 60}))
    outcome: list = []

    def allocate():
        with slicewise.connect(sched_controller.address, name="reserver") as c:
            try:
                gang = c.allocate(slices=3, slice_type="v5litepod-4", timeout=200)
                outcome.append(gang)
                outcome.append(
                    gang.compile(jax.jit(lambda a: a + 1), np.zeros(12, np.float32))(
                        np.zeros(12, np.float32)
                    )
                    .fetch()
                    .tolist()
                )
                gang.release()
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                outcome.append(exc)

    thread = threading.Thread(target=allocate, daemon=True)
    thread.start()
    with slicewise.connect(sched_controller.address) as observer:

        def at_failpoint():
            """The request's gang: admitted onto three slices, starting, paused at the
            failpoint (the controller logged it), and with no placement group yet."""
            for g in observer.cluster_info().gangs:
                if g.client == "reserver" and g.state == "starting" and len(g.slices) == 3:
                    prefix = f"slicewise-{g.gang_id}-"
                    pausing = f"gang {g.gang_id}: failpoint: pausing"
                    if pausing in controller_log(sched_controller) and not any(
                        name.startswith(prefix) for name in ray_table()
                    ):
                        return g
            return None

        paused = wait_until(at_failpoint, timeout_s=120, what="the reservation to pause")
    victim = paused.slices[1]
    cluster.remove_host(victim, 0)
    failpoints.write_text("{}")
    partial: list[str] = []
    wait_until(
        sampling(ray_table, partial, lambda: not thread.is_alive()),
        timeout_s=240,
        interval_s=0.2,
        what="the allocation to finish",
    )
    assert not partial, partial
    gang, result = outcome
    assert isinstance(gang, slicewise.Gang), gang
    # The same request, rolled back off the lost slice and placed again without it.
    assert gang.id == paused.gang_id
    assert victim not in gang.slices and len(gang.slices) == 3, (victim, gang.slices)
    retried = rf"gang {gang.id}: .*{re.escape(victim)}.*; retrying \(1/\d+\)"
    assert re.search(retried, controller_log(sched_controller)), retried
    assert result == [1.0] * 12
    assert not [pg for pg in ray_table().values() if pg["state"] != "REMOVED"]
    with slicewise.connect(sched_controller.address) as c:
        states = {s.name: s.state for s in c.cluster_info().slices}
    assert states[victim] == pb.SLICE_STATE_BROKEN


def test_a_worker_that_dies_while_its_gang_forms_is_quoted_in_the_error(
    sched_controller, failpoints, ray_table
):
    """Process 1 of a two-slice gang exits during `initialize` after writing to stderr:
    the allocation fails with that line in its error, holds nothing afterwards, and the
    next allocation succeeds."""
    failpoints.write_text(json.dumps({"initialize_exit_process": 2}))
    try:
        with (
            slicewise.connect(sched_controller.address) as c,
            pytest.raises(slicewise.WorkerError) as raised,
        ):
            c.allocate(slices=2, slice_type="v5litepod-4", timeout=200)
    finally:
        failpoints.write_text("{}")
    message = str(raised.value)
    assert "failed to start: ActorDiedError" in message, message
    assert "The worker's last output (stderr):" in message, message
    assert "failpoint: process 1 exits while joining" in message, message
    assert not [pg for pg in ray_table().values() if pg["state"] != "REMOVED"]
    with slicewise.connect(sched_controller.address) as c:
        gang = c.allocate(slices=2, slice_type="v5litepod-4", timeout=200)
        x = np.arange(8, dtype=np.float32)
        assert gang.compile(jax.jit(lambda a: a * 2), x)(x).fetch().tolist() == (x * 2).tolist()
        gang.release()
