"""Property tests of the gang scheduler over random clusters and streams of submits, cancels,
releases, host failures and returns, and clock advances.

Every stream also runs through benchmarks/naive_scheduler.py, the same policy written the
obvious way; the two must make the same decisions step by step.
"""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.naive_scheduler import NaiveScheduler
from controller.inventory import Host, Slice
from controller.preemption import Candidate, cheapest_victims, victim_cost
from controller.scheduler import (
    Admission,
    ForceRelease,
    GangRequest,
    Preempt,
    Scheduler,
)
from slicewise.common.errors import CapacityError
from slicewise.common.topology import SLICE_TYPES

TYPES = [SLICE_TYPES["v5litepod-4"], SLICE_TYPES["v5litepod-8"], SLICE_TYPES["v5litepod-16"]]


def make_slice(name, stype, broken):
    hosts = tuple(
        Host(f"{name}-h{i}", "", i, stype.chips_per_host, not (broken and i == 0))
        for i in range(stype.hosts)
    )
    return Slice(name, stype, hosts, simulated=True)


class Harness:
    """A stand-in controller: drives both schedulers and checks every decision."""

    def __init__(self, types, broken):
        self.now = 0.0
        self.types = {f"s{i}": TYPES[t] for i, t in enumerate(types)}
        self.present = sorted(set(types))  # requests mostly ask for types the cluster has
        self.broken = {f"s{i}" for i, b in enumerate(broken) if b}
        self.gone = set()
        self.fast = Scheduler(clock=lambda: self.now)
        self.naive = NaiveScheduler(clock=lambda: self.now)
        self.requests = {}
        self.ids = []
        self.running = []  # admitted, in admission order
        self.preempted = set()
        self.admitted_ever = set()
        self.cancelled = set()
        self.set_inventory()

    def inventory(self):
        return {
            n: make_slice(n, t, n in self.broken)
            for n, t in self.types.items()
            if n not in self.gone
        }

    def set_inventory(self):
        self.fast.set_inventory(self.inventory())
        self.naive.set_inventory(self.inventory())

    def submit(self, size, types, same_type, priority, max_wait):
        rid = f"r{len(self.ids)}"
        types = list(
            dict.fromkeys(self.present[t % len(self.present)] if t < 3 else t - 3 for t in types)
        )
        kwargs = dict(
            slice_types=tuple(TYPES[t] for t in types[1:]),
            same_type=same_type,
            priority=priority,
            max_wait_s=max_wait,
        )
        try:
            self.fast.submit(GangRequest(rid, size, TYPES[types[0]], **kwargs))
        except CapacityError:
            try:
                self.naive.submit(GangRequest(rid, size, TYPES[types[0]], **kwargs))
            except CapacityError:
                return None
            raise AssertionError("only the fast scheduler refused") from None
        self.naive.submit(GangRequest(rid, size, TYPES[types[0]], **kwargs))
        self.requests[rid] = GangRequest(rid, size, TYPES[types[0]], **kwargs)
        self.ids.append(rid)
        return rid

    def release(self, rid):
        assert self.fast.release(rid) == self.naive.release(rid)
        if rid in self.running:
            self.running.remove(rid)
        self.preempted.discard(rid)

    def cancel(self, rid):
        self.fast.cancel(rid)
        self.naive.cancel(rid)
        self.cancelled.add(rid)

    def apply(self, action):
        kind, *args = action
        if kind == "submit":
            self.submit(*args)
        elif kind == "release" and self.running:
            self.release(self.running[args[0] % len(self.running)])
        elif kind == "victim" and self.preempted:
            self.release(sorted(self.preempted)[args[0] % len(self.preempted)])
        elif kind == "cancel" and self.ids:
            self.cancel(self.ids[args[0] % len(self.ids)])
        elif kind in ("fail", "heal", "vanish", "return"):
            name = f"s{args[0] % len(self.types)}"
            {
                "fail": self.broken.add,
                "heal": self.broken.discard,
                "vanish": self.gone.add,
                "return": self.gone.discard,
            }[kind](name)
            self.set_inventory()
        elif kind == "tick":
            self.now += args[0]
        return self.schedule()

    def schedule(self):
        inventory = self.fast.inventory
        before = {n: self.fast.holder(n) for n in self.types}
        held_before = {rid: self.fast.held_by(rid) for rid in self.ids}
        decisions = self.fast.schedule()
        assert decisions == self.naive.schedule()
        forced = set()
        for d in decisions:
            if isinstance(d, ForceRelease):
                assert d.victim_id in self.preempted
                forced.add(d.victim_id)
                self.running.remove(d.victim_id)
                self.preempted.discard(d.victim_id)
            elif isinstance(d, Preempt):
                victim, preemptor = self.requests[d.victim_id], self.requests[d.for_request]
                assert victim.priority < preemptor.priority  # strictly lower, never equal
                assert len(held_before[d.victim_id]) == victim.num_slices  # a whole gang
                assert d.victim_id in self.running and d.victim_id not in self.preempted
                self.preempted.add(d.victim_id)
            elif isinstance(d, Admission):
                request = self.requests[d.request_id]
                assert len(set(d.slices)) == request.num_slices
                for name in d.slices:
                    assert inventory[name].intact  # broken or vanished: never handed out
                    assert inventory[name].type in request.slice_types
                    assert before[name] is None or before[name] in forced
                if request.same_type:
                    assert len({inventory[n].type for n in d.slices}) == 1
                self.running.append(d.request_id)
                self.admitted_ever.add(d.request_id)
        self.check_holdings()
        return decisions

    def check_holdings(self):
        seen = {}
        for rid in self.ids:
            held = self.fast.held_by(rid)
            assert held == self.naive.held_by(rid)
            assert len(held) in (0, self.requests[rid].num_slices)  # never part of a gang
            assert bool(held) == (rid in self.running)
            for name in held:
                assert name not in seen, f"{name} held by {seen.get(name)} and {rid}"
                seen[name] = rid
        for name in self.types:
            assert self.fast.holder(name) == seen.get(name)
        assert [r.request_id for r in self.fast.queued()] == [
            r.request_id for r in self.naive.queued()
        ]


CLUSTERS = st.tuples(
    st.lists(st.integers(0, 2), min_size=2, max_size=8),
    st.lists(st.booleans(), min_size=8, max_size=8),
)
# Type numbers 0-2 pick among the cluster's own types, 3-5 name any type.
SUBMIT = st.tuples(
    st.just("submit"),
    st.integers(1, 3),
    st.lists(st.integers(0, 5), min_size=1, max_size=2, unique=True),
    st.booleans(),
    st.integers(0, 2),
    st.sampled_from([None, None, 30.0]),
)
ACTION = st.one_of(
    SUBMIT,
    SUBMIT,
    st.tuples(
        st.sampled_from(["release", "victim", "cancel", "fail", "heal", "vanish", "return"]),
        st.integers(0, 50),
    ),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 5.0, 20.0, 40.0])),
)


@settings(max_examples=120, deadline=None)
@given(cluster=CLUSTERS, actions=st.lists(ACTION, min_size=20, max_size=50))
def test_random_streams_keep_every_invariant_and_match_the_naive_scheduler(cluster, actions):
    harness = Harness(*cluster)
    for action in actions:
        harness.apply(action)
    for q in harness.fast.queue_snapshot():  # every queued request can say why it waits
        assert q.reason and q.position == harness.fast.position(q.request.request_id)


EQUAL = st.tuples(
    st.just("submit"),
    st.integers(1, 3),
    st.lists(st.integers(0, 2), min_size=1, max_size=2, unique=True),
    st.booleans(),
    st.just(0),
    st.just(None),
)


@settings(max_examples=100, deadline=None)
@given(
    types=st.lists(st.integers(0, 2), min_size=1, max_size=6),
    actions=st.lists(
        st.one_of(EQUAL, st.tuples(st.just("release"), st.integers(0, 50))),
        min_size=10,
        max_size=40,
    ),
)
def test_under_equal_priority_backfill_never_takes_what_an_earlier_request_could_use(
    types, actions
):
    harness = Harness(types, [False] * 8)
    for action in actions:
        for d in harness.apply(action):
            if not isinstance(d, Admission):
                continue
            got = {harness.fast.inventory[n].type for n in d.slices}
            for waiting in harness.fast.queued():
                if harness.ids.index(waiting.request_id) < harness.ids.index(d.request_id):
                    assert not got & set(waiting.slice_types), (d, waiting.request_id)
    # Gangs keep being released: every request that fits the cluster is admitted at last.
    for _ in range(10 * len(harness.ids) + 1):
        if not harness.fast.queued():
            break
        if harness.running:
            harness.release(harness.running[0])
        harness.schedule()
    assert not harness.fast.queued()
    assert harness.admitted_ever == set(harness.ids) - harness.cancelled


@settings(max_examples=200, deadline=None)
@given(
    candidates=st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(0, 2)), max_size=7
    ),
    need=st.integers(1, 6),
)
def test_cheapest_victims_matches_brute_force(candidates, need):
    pool = [
        Candidate(f"g{i}", cover, chips * 8, prio, i)
        for i, (cover, chips, prio) in enumerate(candidates)
    ]
    chosen = cheapest_victims(pool, need)
    covering = [
        subset
        for k in range(len(pool) + 1)
        for subset in itertools.combinations(pool, k)
        if sum(c.cover for c in subset) >= need
    ]
    if not covering:
        assert chosen is None
    else:
        assert chosen is not None and sum(c.cover for c in chosen) >= need
        assert victim_cost(chosen) == min(victim_cost(s) for s in covering)
