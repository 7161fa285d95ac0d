"""Slice inventory from Ray's node table, and all-or-nothing FIFO gang admission."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.errors import CapacityError, InvalidRequestError, NotFoundError
from controller.inventory import Host, Slice, check_can_ever_fit, slices_from_nodes
from controller.scheduler import Admission, GangRequest, Scheduler
from controller.topology import SLICE_TYPES

V8 = SLICE_TYPES["v5litepod-8"]
V16 = SLICE_TYPES["v5litepod-16"]


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
    hosts = tuple(Host(f"{name}-h{i}", f"10.0.0.{i}", i, stype.chips_per_host, i not in dead)
                  for i in range(stype.hosts))
    return Slice(name, stype, hosts, simulated=True)


def scheduler_with(*slices):
    scheduler = Scheduler(clock=lambda: 42.0)
    scheduler.set_inventory({s.name: s for s in slices})
    return scheduler


# -- inventory -------------------------------------------------------------------------


def test_slices_from_nodes_groups_hosts_by_slice_name():
    nodes = [node("big", "v5litepod-16", w) for w in (2, 0, 3, 1)] + [node("small", "v5litepod-8", 0)]
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


@pytest.mark.parametrize("nodes", [
    [node("s", "v5litepod-16", w, alive=w != 1) for w in range(4)],
    [node("s", "v5litepod-16", w) for w in (0, 1, 3)],
    [node("s", "v5litepod-16", w, chips=2 if w == 0 else None) for w in range(4)],
], ids=["dead-host", "missing-host", "host-without-its-chips"])
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
    slices = {s.name: s for s in (whole_slice("a", V8), whole_slice("b", V8),
                                  whole_slice("c", V16))}
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


def test_why_waiting_names_the_free_count_the_requests_ahead_and_the_holders():
    scheduler = scheduler_with(*(whole_slice(n, V8) for n in "abc"))
    scheduler.submit(GangRequest("first", 2, V8))
    scheduler.schedule()
    scheduler.submit(GangRequest("large", 2, V8))
    scheduler.submit(GangRequest("small", 1, V8))
    scheduler.schedule()
    assert scheduler.why_waiting("large") == (
        "needs 2 free v5litepod-8 slice(s), 1 free now; held by first")
    assert scheduler.why_waiting("small") == (
        "needs 1 free v5litepod-8 slice(s), 1 free now; "
        "1 earlier request(s) for v5litepod-8 go first; held by first")
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


ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.sampled_from([V8, V16]), st.integers(1, 2)),
    st.tuples(st.just("release"), st.integers(0, 30)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
), max_size=30)


@settings(max_examples=150, deadline=None)
@given(actions=ACTIONS)
def test_admissions_never_share_a_slice_never_use_a_broken_one_and_keep_fifo(actions):
    slices = [whole_slice("a", V8), whole_slice("b", V8), whole_slice("c", V8, dead=(0,)),
              whole_slice("x", V16), whole_slice("y", V16, dead=(3,))]
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
            assert all(scheduler.inventory[n].intact and scheduler.inventory[n].type == kind[rid]
                       for n in admission.slices)
            assert scheduler.held_by(rid) == tuple(sorted(admission.slices))
            still_queued = {r.request_id for r in scheduler.queued()}
            earlier = order[:order.index(rid)]
            assert not [r for r in earlier if r in still_queued and kind[r] == kind[rid]]
