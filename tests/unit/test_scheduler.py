"""Slice inventory from Ray's node table, and gang admission: priorities, backfill, preemption,
expiry. Property tests over random streams are in test_scheduler_properties.py."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.inventory import Host, Slice, check_can_ever_fit, slices_from_nodes
from controller.preemption import Candidate, cheapest_victims
from controller.scheduler import (
    Admission,
    Expire,
    ForceRelease,
    GangRequest,
    Preempt,
    Scheduler,
)
from slicewise.common.errors import CapacityError, InvalidRequestError, NotFoundError
from slicewise.common.topology import SLICE_TYPES, slice_type

V8 = SLICE_TYPES["v5litepod-8"]
V16 = SLICE_TYPES["v5litepod-16"]
V4 = SLICE_TYPES["v5litepod-4"]


def node(slice_name, pod_type, worker_id, *, alive=True, node_id=None, chips=None):
    """One row of `ray.nodes()` for a TPU host."""
    labels = {"ray.io/tpu-pod-type": pod_type, "ray.io/tpu-worker-id": str(worker_id)}
    if slice_name is not None:
        labels["ray.io/tpu-slice-name"] = slice_name
    return {
        "NodeID": node_id or f"{slice_name}-node{worker_id}",
        "NodeManagerAddress": f"10.0.0.{worker_id}",
        "Alive": alive,
        "Resources": {"TPU": chips if chips is not None else SLICE_TYPES[pod_type].chips_per_host},
        "Labels": labels,
    }


def whole_slice(name, stype, *, dead=()):
    hosts = tuple(
        Host(f"{name}-h{i}", f"10.0.0.{i}", i, stype.chips_per_host, i not in dead)
        for i in range(stype.hosts)
    )
    return Slice(name, stype, hosts, simulated=True)


def scheduler_with(*slices):
    scheduler = Scheduler(clock=lambda: 42.0)
    scheduler.set_inventory({s.name: s for s in slices})
    return scheduler


# -- inventory -------------------------------------------------------------------------


def test_slices_from_nodes_groups_hosts_by_slice_name():
    nodes = [node("big", "v5litepod-16", w) for w in (2, 0, 3, 1)] + [
        node("small", "v5litepod-8", 0)
    ]
    slices = slices_from_nodes(nodes)
    assert sorted(slices) == ["big", "small"]
    assert slices["big"].type == V16
    assert [h.worker_id for h in slices["big"].hosts] == [0, 1, 2, 3]
    assert slices["big"].host(2).node_id == "big-node2"
    assert slices["small"].type == V8
    assert slices["big"].intact and slices["small"].intact


def test_nodes_that_are_not_v5e_hosts_are_ignored():
    head = {"NodeID": "head", "Alive": True, "Resources": {"CPU": 8}, "Labels": {}}
    v4 = node("old", "v4-8", 0, chips=4)
    unlabelled = {"NodeID": "cpu", "Alive": True, "Resources": {"CPU": 4}}
    slices = slices_from_nodes([head, v4, unlabelled, node("s", "v5litepod-4", 0)])
    assert list(slices) == ["s"]


def test_single_host_slice_without_a_name_label_is_named_after_its_node():
    slices = slices_from_nodes([node(None, "v5litepod-8", 0, node_id="abc123")])
    assert list(slices) == ["abc123"]


@pytest.mark.parametrize(
    "nodes",
    [
        [node("s", "v5litepod-16", w, alive=w != 1) for w in range(4)],
        [node("s", "v5litepod-16", w) for w in (0, 1, 3)],
        [node("s", "v5litepod-16", w, chips=2 if w == 0 else None) for w in range(4)],
    ],
    ids=["dead-host", "missing-host", "host-without-its-chips"],
)
def test_slice_is_not_intact_unless_every_host_is_alive_with_its_chips(nodes):
    assert not slices_from_nodes(nodes)["s"].intact


@pytest.mark.parametrize("dead_first", [True, False])
def test_the_live_entry_wins_for_a_worker_id_reported_twice(dead_first):
    dead = node("s", "v5litepod-16", 1, alive=False, node_id="old")
    live = node("s", "v5litepod-16", 1, node_id="new")
    others = [node("s", "v5litepod-16", w) for w in (0, 2, 3)]
    pair = [dead, live] if dead_first else [live, dead]
    s = slices_from_nodes(others + pair)["s"]
    assert [h.worker_id for h in s.hosts] == [0, 1, 2, 3]
    assert s.host(1).node_id == "new"
    assert s.intact


def test_check_can_ever_fit_names_the_counts_when_the_cluster_is_too_small():
    slices = {
        s.name: s for s in (whole_slice("a", V8), whole_slice("b", V8), whole_slice("c", V16))
    }
    check_can_ever_fit(slices, 2, V8)
    with pytest.raises(CapacityError) as info:
        check_can_ever_fit(slices, 3, V8)
    message = str(info.value)
    assert "asked for 3 x v5litepod-8" in message
    assert "has 2 v5litepod-8 slice(s)" in message
    assert "1 x v5litepod-16, 2 x v5litepod-8" in message
    assert "at most 2" in message


def test_check_can_ever_fit_counts_broken_slices_since_they_may_come_back():
    check_can_ever_fit({"a": whole_slice("a", V8, dead=(0,))}, 1, V8)


@pytest.mark.parametrize("num_slices", [0, -1])
def test_a_gang_of_fewer_than_one_slice_is_invalid(num_slices):
    with pytest.raises(InvalidRequestError, match="at least 1 slice"):
        check_can_ever_fit({"a": whole_slice("a", V8)}, num_slices, V8)


# -- scheduler -------------------------------------------------------------------------


def test_a_request_that_can_never_fit_is_refused_and_not_queued():
    scheduler = scheduler_with(whole_slice("a", V8))
    with pytest.raises(CapacityError):
        scheduler.submit(GangRequest("r1", 2, V8))
    assert scheduler.queued() == []


def test_submit_stamps_the_request_with_the_injected_clock_and_returns_its_position():
    scheduler = scheduler_with(whole_slice("a", V8))
    first, second = GangRequest("r1", 1, V8), GangRequest("r2", 1, V8)
    assert scheduler.submit(first) == 0
    assert scheduler.submit(second) == 1
    assert first.submitted_at == 42.0


def test_admission_is_all_or_nothing():
    scheduler = scheduler_with(*(whole_slice(n, V8) for n in "abc"))
    scheduler.submit(GangRequest("small", 1, V8))
    assert scheduler.schedule() == [Admission("small", ("a",))]
    scheduler.submit(GangRequest("big", 3, V8))
    assert scheduler.schedule() == []
    assert scheduler.held_by("big") == ()
    assert scheduler.free_slices(V8) == ["b", "c"]


def test_release_frees_the_slices_and_lets_the_next_request_in():
    scheduler = scheduler_with(*(whole_slice(n, V8) for n in "abc"))
    scheduler.submit(GangRequest("small", 1, V8))
    scheduler.schedule()
    scheduler.submit(GangRequest("big", 3, V8))
    assert scheduler.schedule() == []
    assert scheduler.release("small") == ("a",)
    assert scheduler.holder("a") is None
    assert scheduler.schedule() == [Admission("big", ("a", "b", "c"))]
    assert scheduler.held_by("big") == ("a", "b", "c")
    assert scheduler.queued() == []


def test_a_later_small_request_does_not_overtake_an_earlier_large_one_of_its_type():
    scheduler = scheduler_with(whole_slice("a", V8), whole_slice("b", V8))
    scheduler.submit(GangRequest("holder", 1, V8))
    scheduler.schedule()
    scheduler.submit(GangRequest("large", 2, V8))
    scheduler.submit(GangRequest("small", 1, V8))
    assert scheduler.schedule() == []  # "b" is free, but "large" asked first
    assert [r.request_id for r in scheduler.queued()] == ["large", "small"]
    scheduler.release("holder")
    assert scheduler.schedule() == [Admission("large", ("a", "b"))]


def test_a_blocked_request_does_not_block_requests_for_another_slice_type():
    scheduler = scheduler_with(whole_slice("a", V8), whole_slice("x", V16))
    scheduler.submit(GangRequest("holder", 1, V8))
    scheduler.schedule()
    scheduler.submit(GangRequest("waits", 1, V8))
    scheduler.submit(GangRequest("other", 1, V16))
    assert scheduler.schedule() == [Admission("other", ("x",))]
    assert [r.request_id for r in scheduler.queued()] == ["waits"]


def test_broken_slices_are_never_handed_out():
    scheduler = scheduler_with(whole_slice("a", V8), whole_slice("b", V8, dead=(0,)))
    scheduler.submit(GangRequest("r1", 1, V8))
    scheduler.submit(GangRequest("r2", 1, V8))
    assert scheduler.schedule() == [Admission("r1", ("a",))]
    assert scheduler.schedule() == []
    assert scheduler.holder("b") is None
    scheduler.set_inventory({"a": whole_slice("a", V8), "b": whole_slice("b", V8)})
    assert scheduler.schedule() == [Admission("r2", ("b",))]


def test_why_waiting_names_the_free_count_the_claims_ahead_and_the_holders():
    scheduler = scheduler_with(*(whole_slice(n, V8) for n in "abc"))
    scheduler.submit(GangRequest("first", 2, V8))
    scheduler.schedule()
    scheduler.submit(GangRequest("large", 2, V8))
    scheduler.submit(GangRequest("small", 1, V8))
    scheduler.schedule()
    assert scheduler.why_waiting("large") == (
        "needs 2 free v5litepod-8 slice(s), 1 free now; held by first"
    )
    assert scheduler.why_waiting("small") == (
        "needs 1 free v5litepod-8 slice(s), 1 free now, "
        "1 claimed by earlier request(s) large; held by first"
    )
    assert scheduler.why_waiting("first") == "not queued"


def test_cancel_removes_a_queued_request():
    scheduler = scheduler_with(whole_slice("a", V8), whole_slice("b", V8))
    scheduler.submit(GangRequest("holder", 1, V8))
    scheduler.schedule()
    scheduler.submit(GangRequest("large", 2, V8))
    scheduler.submit(GangRequest("small", 1, V8))
    scheduler.cancel("large")
    assert [r.request_id for r in scheduler.queued()] == ["small"]
    with pytest.raises(NotFoundError, match="large is not queued"):
        scheduler.position("large")
    assert scheduler.schedule() == [Admission("small", ("b",))]


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from([V8, V16]), st.integers(1, 2)),
        st.tuples(st.just("release"), st.integers(0, 30)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(actions=ACTIONS)
def test_admissions_never_share_a_slice_never_use_a_broken_one_and_keep_fifo(actions):
    slices = [
        whole_slice("a", V8),
        whole_slice("b", V8),
        whole_slice("c", V8, dead=(0,)),
        whole_slice("x", V16),
        whole_slice("y", V16, dead=(3,)),
    ]
    scheduler = scheduler_with(*slices)
    order, kind, size = [], {}, {}
    for action in actions:
        if action[0] == "submit":
            rid = f"r{len(order)}"
            order.append(rid)
            kind[rid], size[rid] = action[1], action[2]
            scheduler.submit(GangRequest(rid, action[2], action[1]))
        elif order and action[0] == "release":
            scheduler.release(order[action[1] % len(order)])
        elif order:
            scheduler.cancel(order[action[1] % len(order)])
        holders_before = {n: scheduler.holder(n) for n in scheduler.inventory}
        taken = set()
        for admission in scheduler.schedule():
            rid = admission.request_id
            assert len(set(admission.slices)) == size[rid]
            assert all(holders_before[n] is None and n not in taken for n in admission.slices)
            taken.update(admission.slices)
            assert all(
                scheduler.inventory[n].intact and scheduler.inventory[n].type == kind[rid]
                for n in admission.slices
            )
            assert scheduler.held_by(rid) == tuple(sorted(admission.slices))
            still_queued = {r.request_id for r in scheduler.queued()}
            earlier = order[: order.index(rid)]
            assert not [r for r in earlier if r in still_queued and kind[r] == kind[rid]]


# -- priorities, backfill, preemption, expiry ------------------------------------------


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def cluster(*slices, clock=None, **options):
    scheduler = Scheduler(clock=clock or Clock(), **options)
    scheduler.set_inventory({s.name: s for s in slices})
    return scheduler


def admit(scheduler, request):
    """Submits a request that must be admitted at once; returns its slices."""
    scheduler.submit(request)
    [decision] = scheduler.schedule()
    assert decision == Admission(request.request_id, decision.slices)
    assert scheduler.held_by(request.request_id) == tuple(sorted(decision.slices))
    return decision.slices


def test_gang_request_keeps_its_old_constructor_and_puts_the_primary_type_first():
    request = GangRequest("r", 2, V8, "alice")
    assert (request.client, request.priority, request.slice_types) == ("alice", 0, (V8,))
    assert request.same_type and request.max_wait_s is None
    assert GangRequest("r", 1, V16, slice_types=(V8, V16)).slice_types == (V16, V8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_slices": 0}, "at least 1 slice"),
        ({"priority": 1.5}, "priority must be an integer"),
        ({"max_wait_s": 0}, "max wait must be positive"),
    ],
)
def test_gang_request_refuses_bad_fields(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        GangRequest(**{"request_id": "r", "num_slices": 1, "slice_type": V8, **kwargs})


def test_a_request_id_cannot_be_queued_twice():
    scheduler = cluster(whole_slice("a", V8))
    scheduler.submit(GangRequest("r", 1, V8))
    with pytest.raises(InvalidRequestError, match="already queued or admitted"):
        scheduler.submit(GangRequest("r", 1, V8))


def test_a_topology_request_gets_the_slice_type_of_that_shape():
    scheduler = cluster(whole_slice("small", V8), whole_slice("big", V16))
    assert admit(scheduler, GangRequest("r", 1, slice_type("4x4"))) == ("big",)


def test_higher_priority_goes_first_and_fifo_holds_within_a_priority():
    scheduler = cluster(whole_slice("a", V8))
    scheduler.submit(GangRequest("holder", 1, V8))
    scheduler.schedule()
    for rid, priority in [("low1", 0), ("high1", 5), ("low2", 0), ("high2", 5)]:
        scheduler.submit(GangRequest(rid, 1, V8, priority=priority))
    assert [r.request_id for r in scheduler.queued()] == ["high1", "high2", "low1", "low2"]
    assert scheduler.position("low1") == 2
    for expected in ["high1", "high2", "low1", "low2"]:
        scheduler.release(scheduler.holder("a"))
        assert scheduler.schedule() == [Admission(expected, ("a",))]


def test_backfill_takes_only_slices_the_head_cannot_use():
    scheduler = cluster(whole_slice("x", V16), whole_slice("y", V16), whole_slice("a", V8))
    scheduler.submit(GangRequest("holder", 1, V16))
    scheduler.schedule()
    scheduler.submit(GangRequest("head", 2, V16))
    scheduler.submit(GangRequest("later16", 1, V16))
    scheduler.submit(GangRequest("later8", 1, V8))
    # "y" is free but the head claims it; "a" is of no use to the head, so it is backfilled.
    assert scheduler.schedule() == [Admission("later8", ("a",))]
    assert scheduler.why_waiting("later16") == (
        "needs 1 free v5litepod-16 slice(s), 1 free now, 1 claimed by earlier request(s) head; "
        "held by holder"
    )
    scheduler.release("holder")
    assert scheduler.schedule() == [Admission("head", ("x", "y"))]


def test_a_head_that_accepts_two_types_claims_the_free_slices_of_both():
    scheduler = cluster(whole_slice("a", V8), whole_slice("x", V16), whole_slice("y", V16))
    scheduler.submit(GangRequest("holder", 1, V16))
    scheduler.schedule()
    scheduler.submit(GangRequest("head", 2, V16, slice_types=(V8,)))
    scheduler.submit(GangRequest("later", 1, V8))
    assert scheduler.schedule() == []
    scheduler.release("holder")
    assert scheduler.schedule() == [Admission("head", ("x", "y")), Admission("later", ("a",))]


def test_same_type_picks_one_type_in_preference_order_while_mixed_may_combine():
    scheduler = cluster(whole_slice("a", V8), whole_slice("b", V8), whole_slice("x", V16))
    with pytest.raises(CapacityError, match="has 1 v5litepod-16, 2 v5litepod-8 slice"):
        scheduler.submit(GangRequest("never", 3, V16, slice_types=(V8,)))
    assert admit(scheduler, GangRequest("one", 1, V16, slice_types=(V8,))) == ("x",)
    scheduler.release("one")
    assert admit(scheduler, GangRequest("two", 2, V16, slice_types=(V8,))) == ("a", "b")
    scheduler.release("two")
    mixed = GangRequest("mixed", 3, V16, slice_types=(V8,), same_type=False)
    assert admit(scheduler, mixed) == ("x", "a", "b")  # preferred type first


def test_a_mixed_request_that_can_never_fit_names_the_counts():
    scheduler = cluster(whole_slice("a", V8), whole_slice("x", V16))
    with pytest.raises(CapacityError) as info:
        scheduler.submit(GangRequest("r", 3, V8, slice_types=(V16,), same_type=False))
    assert "3 slices of v5litepod-8, v5litepod-16 (types may mix)" in str(info.value)
    assert "ask for at most 2" in str(info.value)


def test_held_slices_that_vanish_stay_held_and_count_towards_capacity():
    a, b = whole_slice("a", V8), whole_slice("b", V8)
    scheduler = cluster(a, b)
    admit(scheduler, GangRequest("r1", 2, V8))
    scheduler.set_inventory({"b": b})
    assert scheduler.held_by("r1") == ("a", "b")
    scheduler.submit(GangRequest("r2", 2, V8))  # "a" still exists as far as capacity goes
    scheduler.set_inventory({"a": a, "b": b})
    assert scheduler.schedule() == []  # "a" came back, but r1 still holds it
    assert scheduler.release("r1") == ("a", "b")
    assert scheduler.schedule() == [Admission("r2", ("a", "b"))]


def preemption_cluster(**options):
    clock = Clock()
    scheduler = cluster(*(whole_slice(n, V8) for n in "abcd"), clock=clock, **options)
    return scheduler, clock


def test_preemption_evicts_a_whole_lower_priority_gang_and_hands_its_slices_over():
    scheduler, clock = preemption_cluster()
    admit(scheduler, GangRequest("low", 2, V8, priority=0))
    admit(scheduler, GangRequest("mid", 1, V8, priority=3))
    admit(scheduler, GangRequest("other", 1, V8, priority=1))
    scheduler.submit(GangRequest("high", 2, V8, priority=3))  # equal to mid: never evicts it
    assert scheduler.schedule() == [Preempt("low", "high", clock.now + 30)]
    assert scheduler.held_by("low") == ("a", "b")  # kept through the grace period
    clock.now += 1
    assert scheduler.schedule() == []  # waiting for "low" suffices: "other" is left alone
    assert "waiting for low to release" in scheduler.why_waiting("high")
    clock.now += 10
    assert scheduler.release("low") == ("a", "b")
    assert scheduler.schedule() == [Admission("high", ("a", "b"))]
    assert [r.request_id for r in scheduler.queued()] == ["low"]


def test_a_preemptor_claims_only_the_free_slices_it_still_needs():
    scheduler, _ = preemption_cluster()
    admit(scheduler, GangRequest("low", 2, V8))  # a, b; c and d stay free
    scheduler.submit(GangRequest("high", 3, V8, priority=1))
    scheduler.submit(GangRequest("small1", 1, V8))
    scheduler.submit(GangRequest("small2", 1, V8))
    # "high" gets a and b from "low" and needs one free slice more: one is left to backfill.
    assert scheduler.schedule() == [Preempt("low", "high", 1030.0), Admission("small1", ("c",))]
    scheduler.release("low")
    assert scheduler.schedule() == [Admission("high", ("a", "b", "d"))]


def test_a_victim_that_does_not_release_in_time_is_forced():
    scheduler, clock = preemption_cluster(grace_s=20)
    admit(scheduler, GangRequest("low", 4, V8))
    scheduler.submit(GangRequest("high", 1, V8, priority=1))
    assert scheduler.schedule() == [Preempt("low", "high", clock.now + 20)]
    clock.now += 19.9
    assert scheduler.schedule() == []
    clock.now += 0.1
    assert scheduler.schedule() == [
        ForceRelease("low", "high", ("a", "b", "c", "d")),
        Admission("high", ("a",)),
    ]
    assert scheduler.held_by("low") == ()
    assert scheduler.free_slices(V8) == ["b", "c", "d"]  # more than it needed: back to the pool
    assert scheduler.release("low") == ()  # the controller's late release changes nothing


def test_an_evicted_gang_is_requeued_in_its_place_with_doubling_backoff():
    scheduler, clock = preemption_cluster(backoff_s=5, max_backoff_s=8)
    admit(scheduler, GangRequest("victim", 4, V8))
    scheduler.submit(GangRequest("later", 1, V8))
    for round_, backoff in [(1, 5), (2, 8)]:  # 5 s, then 10 s capped at 8 s
        scheduler.submit(GangRequest(f"boss{round_}", 4, V8, priority=1))
        assert [type(d) for d in scheduler.schedule()] == [Preempt]
        scheduler.release("victim")
        assert scheduler.schedule() == [Admission(f"boss{round_}", ("a", "b", "c", "d"))]
        assert [r.request_id for r in scheduler.queued()] == ["victim", "later"]
        assert scheduler.why_waiting("victim") == (
            f"preempted {round_} time(s); backs off for another {backoff} s"
        )
        scheduler.release(f"boss{round_}")
        clock.now += backoff - 0.5
        # Backing off, it claims nothing: the later request may use the slices meanwhile.
        assert scheduler.schedule() == [Admission("later", ("a",))]
        scheduler.release("later")
        clock.now += 0.5
        assert scheduler.schedule() == [Admission("victim", ("a", "b", "c", "d"))]
        scheduler.submit(GangRequest("later", 1, V8))


def test_preemption_chooses_the_cheapest_victims():
    clock = Clock()
    scheduler = cluster(*(whole_slice(n, V8) for n in "abcdef"), whole_slice("x", V16), clock=clock)
    admit(scheduler, GangRequest("two-old", 2, V8, priority=0))  # a, b
    admit(scheduler, GangRequest("one-p1", 1, V8, priority=1))  # c
    admit(scheduler, GangRequest("one-old", 1, V8, priority=0))  # d
    admit(scheduler, GangRequest("one-new", 1, V8, priority=0))  # e
    admit(scheduler, GangRequest("mixed", 2, V8, slice_types=(V16,), same_type=False))  # f, x
    # One slice: fewest chips rules out "mixed" (24 chips), lowest priority rules out
    # "one-p1", and the most recently admitted of the rest is "one-new".
    scheduler.submit(GangRequest("need1", 1, V8, priority=5))
    assert scheduler.schedule() == [Preempt("one-new", "need1", clock.now + 30)]
    # Two slices: {two-old} and {one-old, one-p1} both take 16 chips, and the first has the
    # lower highest priority.
    scheduler.submit(GangRequest("need2", 2, V8, priority=5))
    assert [d.victim_id for d in scheduler.schedule()] == ["two-old"]


def test_cheapest_victims_prefers_the_set_whose_oldest_victim_is_newest():
    old, new1, new2 = (
        Candidate("old", 2, 16, 0, 1),
        Candidate("new1", 1, 8, 0, 2),
        Candidate("new2", 1, 8, 0, 3),
    )
    assert cheapest_victims([old, new1, new2], 2) == (new1, new2)
    assert cheapest_victims([old, new1, new2], 4) == (old, new1, new2)
    assert cheapest_victims([old, new1, new2], 5) is None
    assert cheapest_victims([], 0) == ()


def test_no_preemption_when_lower_priority_gangs_could_not_make_it_fit():
    scheduler, _ = preemption_cluster()
    admit(scheduler, GangRequest("low", 1, V8, priority=0))
    admit(scheduler, GangRequest("peer", 3, V8, priority=2))
    scheduler.submit(GangRequest("head", 2, V8, priority=2))
    scheduler.submit(GangRequest("small", 1, V8, priority=2))
    # "head" cannot fit by evicting "low" alone, so it claims "low" and "small" may not
    # evict it either: that would only put an equal-priority gang in the head's way.
    assert scheduler.schedule() == []
    scheduler.release("peer")
    assert scheduler.schedule() == [Admission("head", ("b", "c")), Admission("small", ("d",))]


def test_a_cancelled_preemptor_still_evicts_and_the_slices_return_to_the_pool():
    scheduler, _ = preemption_cluster()
    admit(scheduler, GangRequest("low", 4, V8))
    scheduler.submit(GangRequest("high", 4, V8, priority=1))
    assert [type(d) for d in scheduler.schedule()] == [Preempt]
    scheduler.cancel("high")
    scheduler.submit(GangRequest("other", 2, V8))
    scheduler.release("low")
    assert scheduler.schedule() == [Admission("other", ("a", "b"))]


def test_a_request_that_waits_past_its_max_wait_expires_with_a_reason():
    clock = Clock()
    scheduler = cluster(whole_slice("a", V8), clock=clock)
    admit(scheduler, GangRequest("holder", 1, V8))
    scheduler.submit(GangRequest("patient", 1, V8))
    scheduler.submit(GangRequest("hasty", 1, V8, max_wait_s=60))
    clock.now += 59
    assert scheduler.schedule() == []
    clock.now += 1
    [expired] = scheduler.schedule()
    assert expired == Expire("hasty", expired.reason)
    assert expired.reason.startswith(
        "waited 60 s in the queue, longer than its max wait of 60 s, at position 1"
    )
    assert [r.request_id for r in scheduler.queued()] == ["patient"]


def test_queue_snapshot_gives_each_queued_request_its_position_and_reason():
    scheduler = cluster(whole_slice("a", V8), whole_slice("x", V16))
    admit(scheduler, GangRequest("holder", 1, V8))
    scheduler.submit(GangRequest("first", 1, V8))
    scheduler.submit(GangRequest("second", 1, V16, slice_types=(V8,)))
    snapshot = scheduler.queue_snapshot()
    assert [(q.request.request_id, q.position) for q in snapshot] == [("first", 0), ("second", 1)]
    assert snapshot[0].reason == "needs 1 free v5litepod-8 slice(s), 0 free now; held by holder"
    assert snapshot[1].reason == "can be admitted now"
