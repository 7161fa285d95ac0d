"""Gang admission and preemption: which queued request gets which whole slices. Pure logic.

The controller feeds it the slice inventory and the requests, calls `schedule()` and carries
out the decisions it returns, in order. Nothing here does I/O, and time is only read through
the injected `clock`.

What one `schedule()` does, in this order:

1. Requests queued longer than their `max_wait_s` leave the queue (`Expire`).
2. Victims whose grace period ran out lose their slices (`ForceRelease`); the slices go to
   the request they were preempted for, and the victim is requeued with backoff.
3. The queue is walked in order: higher priority first, then first come, first served,
   i.e. by `(-priority, submitted_at, seq)`. Admission is all-or-nothing. A request that
   cannot be admitted *claims* the free slices it could use, up to what it still needs;
   later requests may only use free slices nobody earlier claimed. So a later request is
   admitted ahead (backfill) only when it takes nothing an earlier one could use: without
   runtime estimates this is the conservative way never to delay the head of the queue.
4. A blocked request of priority p that waiting for slices already being freed for it would
   not satisfy may evict whole running gangs of priority < p. Of the victim sets that make
   it fit it picks the cheapest (`victim_cost`): fewest chips taken from victims (every chip
   of every victim gang), then the lowest highest-victim priority, then the set whose
   earliest-admitted victim was admitted latest (least work thrown away). A blocked request
   that can evict nothing claims the lower-priority gangs holding its types instead, so
   that later requests do not evict what it will need. Victims get `Preempt` with a
   deadline `grace_s` away and keep their slices until they release (or are forced); the
   slices then go to the preemptor. A preemption is never taken back. An evicted gang is
   requeued in its old place but not admitted before `backoff_s * 2**(n-1)` (at most
   `max_backoff_s`) after its n-th eviction.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field

from controller.inventory import Slice, check_can_ever_fit
from controller.preemption import Candidate, cheapest_victims, victim_cost
from slicewise.common.errors import InvalidRequestError, NotFoundError
from slicewise.common.ids import id_order
from slicewise.common.topology import SliceType

GRACE_S = 30.0
BACKOFF_S = 5.0
MAX_BACKOFF_S = 300.0
_INF = math.inf


@dataclass
class GangRequest:
    """A request for `num_slices` whole slices of one of `slice_types` (preferred first)."""

    request_id: str
    num_slices: int
    slice_type: SliceType
    client: str = ""
    _: KW_ONLY
    priority: int = 0
    slice_types: tuple[SliceType, ...] = ()
    same_type: bool = True
    max_wait_s: float | None = None
    submitted_at: float = 0.0

    def __post_init__(self) -> None:
        if self.num_slices < 1:
            raise InvalidRequestError(f"a gang needs at least 1 slice, asked for {self.num_slices}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {self.priority!r}")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise InvalidRequestError(f"max wait must be positive seconds, got {self.max_wait_s}")
        # The primary type always leads, so that GangRequest(id, n, type) means what it says.
        self.slice_types = tuple(dict.fromkeys((self.slice_type, *self.slice_types)))


@dataclass(frozen=True)
class Admission:
    """A decision: `request_id` now holds `slices`; start its gang."""

    request_id: str
    slices: tuple[str, ...]


@dataclass(frozen=True)
class Preempt:
    """A decision: gang `victim_id` should checkpoint and release by `deadline`; its slices
    then go to `for_request`, and it is requeued."""

    victim_id: str
    for_request: str
    deadline: float


@dataclass(frozen=True)
class ForceRelease:
    """A decision: the victim's grace period passed and its `slices` were taken back; stop its
    workers before starting any gang admitted later in the same list."""

    victim_id: str
    for_request: str
    slices: tuple[str, ...]


@dataclass(frozen=True)
class Expire:
    """A decision: `request_id` waited longer than its max wait and left the queue."""

    request_id: str
    reason: str


Decision = Admission | Preempt | ForceRelease | Expire


@dataclass(frozen=True)
class QueuedRequest:
    """One line of `queue_snapshot()`: a queued request, its place and why it waits."""

    request: GangRequest
    position: int
    reason: str


def expiry_reason(
    request: GangRequest, waited_s: float, position: int, free: Mapping[str, int]
) -> str:
    """The sentence an expired request's client reads."""
    counts = ", ".join(f"{free.get(t.name, 0)} {t.name}" for t in request.slice_types)
    return (
        f"waited {waited_s:.0f} s in the queue, longer than its max wait of "
        f"{request.max_wait_s:g} s, at position {position}: needs {request.num_slices} "
        f"slice(s), free then: {counts}; ask again, with a longer max wait or fewer slices"
    )


@dataclass(eq=False)
class _Entry:
    """A queued request and what the scheduler knows about its wait."""

    request: GangRequest
    key: tuple[int, float, int, str]  # (-priority, submitted_at, seq, id): the queue order
    since: float  # when its current wait began (submission, or end of backoff)
    not_before: float = -_INF
    expires_at: float = _INF
    victims: set[str] = field(default_factory=set)  # gangs being preempted for it
    reserved: set[str] = field(default_factory=set)  # its victims' freed slices

    @property
    def types(self) -> list[str]:
        return [t.name for t in self.request.slice_types]


@dataclass(eq=False)
class _Gang:
    """An admitted request and the slices it holds."""

    request: GangRequest
    key: tuple[int, float, int, str]
    slices: tuple[str, ...]
    types: dict[str, SliceType]  # slice -> its type, kept for slices that vanish
    seq: int  # admission order
    cover: dict[str, int] = field(default_factory=dict)  # intact slices held, per type
    preemptor: _Entry | None = None
    deadline: float = _INF

    @property
    def chips(self) -> int:
        return sum(t.chips for t in self.types.values())


class Scheduler:
    """Priority-FIFO, all-or-nothing gang scheduling with backfill and preemption."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        grace_s: float = GRACE_S,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.clock = clock
        self.grace_s = grace_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._inventory: dict[str, Slice] = {}
        self._state: dict[str, tuple[str, bool]] = {}  # slice -> (type name, intact)
        self._holder: dict[str, str] = {}
        self._reserved: dict[str, _Entry] = {}
        self._free: dict[str, list[str]] = {}  # type -> sorted intact, unheld, unreserved
        self._gangs: dict[str, _Gang] = {}
        self._victims: dict[str, list[tuple[int, int, str]]] = {}  # type -> (prio, seq, id)
        self._queue: list[tuple[int, float, int, str]] = []  # sorted entry keys
        self._entries: dict[str, _Entry] = {}
        self._demand: dict[str, int] = {}  # type -> queued requests accepting it
        self._with_reserved: set[str] = set()
        self._evictions: dict[str, int] = {}
        self._expiries: list[tuple[float, int, _Entry]] = []
        self._deadlines: list[tuple[float, int, _Gang]] = []
        self._wakeups: list[float] = []  # ends of backoff
        self._seq = itertools.count()
        self._dirty = True  # whether a walk could decide anything new

    # -- reading -------------------------------------------------------------------------

    @property
    def inventory(self) -> Mapping[str, Slice]:
        """The slices last reported by `set_inventory`."""
        return self._inventory

    def holder(self, slice_name: str) -> str | None:
        """The request holding the slice, if any (held through its grace period too)."""
        return self._holder.get(slice_name)

    def held_by(self, request_id: str) -> tuple[str, ...]:
        """The slices the request holds, sorted: all of its gang, or none."""
        gang = self._gangs.get(request_id)
        return tuple(sorted(gang.slices)) if gang else ()

    def queued(self) -> list[GangRequest]:
        """Queued requests in queue order, those backing off after eviction included."""
        return [self._entries[k[3]].request for k in self._queue]

    def position(self, request_id: str) -> int:
        """The request's place in the queue (0 = next); NotFoundError when not queued."""
        entry = self._entries.get(request_id)
        if entry is None:
            raise NotFoundError(f"request {request_id} is not queued")
        return bisect.bisect_left(self._queue, entry.key)

    def free_slices(self, stype: SliceType) -> list[str]:
        """Intact slices of the type that nobody holds and no preemptor waits for."""
        return list(self._free.get(stype.name, ()))

    def why_waiting(self, request_id: str) -> str:
        """A sentence for a person: why this request is not admitted yet."""
        if request_id not in self._entries:
            return "not queued"
        return _Walk(self, self.clock(), explain=True, until=request_id).run().reasons[request_id]

    def queue_snapshot(self) -> list[QueuedRequest]:
        """Every queued request in order, with its position and why it waits."""
        reasons = _Walk(self, self.clock(), explain=True).run().reasons
        return [
            QueuedRequest(self._entries[k[3]].request, i, reasons[k[3]])
            for i, k in enumerate(self._queue)
        ]

    # -- changing ------------------------------------------------------------------------

    def set_inventory(self, slices: Mapping[str, Slice]) -> None:
        """Replaces the inventory; holdings of slices that vanished stay recorded until
        released, so that nothing is handed out twice when a host comes back. Queued
        requests stay queued when slices break or vanish (hosts come back); a max wait
        bounds how long they wait for that."""
        self._inventory = dict(slices)
        state = {name: (s.type.name, s.intact) for name, s in slices.items()}
        if state == self._state:
            return  # called every second; most seconds nothing changed
        self._state = state
        self._free = {}
        for name in sorted(state):
            tname, intact = state[name]
            if intact and name not in self._holder and name not in self._reserved:
                self._free.setdefault(tname, []).append(name)
        self._victims = {}
        for gang in self._gangs.values():
            gang.cover = self._cover(gang.slices)
            if gang.preemptor is None:
                self._add_victim(gang)
        self._dirty = True

    def submit(self, request: GangRequest) -> int:
        """Queues a request; returns its position (0 = next).

        Raises:
            CapacityError: the request could never fit this cluster.
            InvalidRequestError: a request of that id is already queued or admitted.
        """
        rid = request.request_id
        if rid in self._entries or rid in self._gangs:
            raise InvalidRequestError(f"request {rid} is already queued or admitted")
        known: Mapping[str, Slice] = self._inventory
        vanished = {
            name: Slice(name, stype, (), simulated=False)  # still exist: held
            for gang in self._gangs.values()
            for name, stype in gang.types.items()
            if name not in self._state
        }
        if vanished:
            known = {**self._inventory, **vanished}
        check_can_ever_fit(
            known, request.num_slices, request.slice_types, same_type=request.same_type
        )
        if not request.submitted_at:
            request.submitted_at = self.clock()
        key = (-request.priority, request.submitted_at, next(self._seq), rid)
        self._enqueue(_Entry(request, key, since=request.submitted_at))
        return self.position(rid)

    def cancel(self, request_id: str) -> None:
        """Drops a queued request; its preemptions, if any, still go ahead."""
        entry = self._entries.get(request_id)
        if entry is not None:
            self._dequeue(entry)

    def release(self, request_id: str) -> tuple[str, ...]:
        """Frees every slice the request holds; returns their names. A gang being preempted
        is requeued, and its slices go to the request it was preempted for."""
        return self._release(request_id, self.clock())

    def schedule(self) -> list[Decision]:
        """Expires, force-releases, admits and preempts; returns the decisions in order."""
        now = self.clock()
        if not self._dirty and now < self._next_event():
            return []  # nothing changed since a walk that decided nothing
        decisions: list[Decision] = [*self._expire(now), *self._force_release(now)]
        while self._wakeups and self._wakeups[0] <= now:
            heapq.heappop(self._wakeups)
        for action in _Walk(self, now).run().actions:
            if isinstance(action, Admission):
                self._admit(self._entries[action.request_id], action.slices)
            else:
                self._mark_victim(action)
            decisions.append(action)
        self._dirty = bool(decisions)
        return decisions

    # -- internals -----------------------------------------------------------------------

    def _next_event(self) -> float:
        heads = [h[0][0] for h in (self._expiries, self._deadlines) if h]
        return min([*heads, *self._wakeups[:1], _INF])

    def _enqueue(self, entry: _Entry) -> None:
        request = entry.request
        bisect.insort(self._queue, entry.key)
        self._entries[request.request_id] = entry
        for t in entry.types:
            self._demand[t] = self._demand.get(t, 0) + 1
        if request.max_wait_s is not None:
            entry.expires_at = entry.since + request.max_wait_s
            heapq.heappush(self._expiries, (entry.expires_at, next(self._seq), entry))
        self._dirty = True

    def _dequeue(self, entry: _Entry) -> None:
        del self._queue[bisect.bisect_left(self._queue, entry.key)]
        del self._entries[entry.request.request_id]
        for t in entry.types:
            self._demand[t] -= 1
        for name in entry.reserved:
            del self._reserved[name]
            self._to_pool(name)
        entry.reserved.clear()
        self._with_reserved.discard(entry.request.request_id)
        self._dirty = True

    def _to_pool(self, name: str) -> None:
        tname, intact = self._state.get(name, ("", False))
        if intact and name not in self._holder and name not in self._reserved:
            bisect.insort(self._free.setdefault(tname, []), name)

    def _cover(self, slices: Iterable[str]) -> dict[str, int]:
        cover: dict[str, int] = {}
        for name in slices:
            tname, intact = self._state.get(name, ("", False))
            if intact:
                cover[tname] = cover.get(tname, 0) + 1
        return cover

    def _add_victim(self, gang: _Gang) -> None:
        item = (gang.request.priority, gang.seq, gang.request.request_id)
        for tname in gang.cover:
            bisect.insort(self._victims.setdefault(tname, []), item)

    def _drop_victim(self, gang: _Gang) -> None:
        item = (gang.request.priority, gang.seq, gang.request.request_id)
        for tname in gang.cover:
            candidates = self._victims.get(tname, [])
            i = bisect.bisect_left(candidates, item)
            if i < len(candidates) and candidates[i] == item:
                del candidates[i]

    def _admit(self, entry: _Entry, slices: tuple[str, ...]) -> None:
        rid = entry.request.request_id
        for name in slices:
            if self._reserved.get(name) is entry:
                del self._reserved[name]
                entry.reserved.discard(name)
            else:
                free = self._free[self._state[name][0]]
                del free[bisect.bisect_left(free, name)]
            self._holder[name] = rid
        self._dequeue(entry)  # what it reserved but did not need goes back to the pool
        gang = _Gang(
            entry.request,
            entry.key,
            slices,
            {n: self._inventory[n].type for n in slices},
            next(self._seq),
        )
        gang.cover = self._cover(slices)
        self._gangs[rid] = gang
        self._add_victim(gang)

    def _mark_victim(self, preempt: Preempt) -> None:
        gang = self._gangs[preempt.victim_id]
        preemptor = self._entries[preempt.for_request]
        self._drop_victim(gang)
        gang.preemptor, gang.deadline = preemptor, preempt.deadline
        preemptor.victims.add(preempt.victim_id)
        heapq.heappush(self._deadlines, (gang.deadline, next(self._seq), gang))

    def _release(self, request_id: str, now: float) -> tuple[str, ...]:
        gang = self._gangs.pop(request_id, None)
        if gang is None:
            return ()
        for name in gang.slices:
            del self._holder[name]
        preemptor = gang.preemptor
        if preemptor is None:
            self._drop_victim(gang)
            for name in gang.slices:
                self._to_pool(name)
        else:
            live = self._entries.get(preemptor.request.request_id) is preemptor
            preemptor.victims.discard(request_id)
            wanted = {t.name for t in preemptor.request.slice_types} if live else set()
            for name in gang.slices:
                if gang.types[name].name in wanted:
                    self._reserved[name] = preemptor
                    preemptor.reserved.add(name)
                    self._with_reserved.add(preemptor.request.request_id)
                else:
                    self._to_pool(name)
            self._requeue(gang, now)
        self._dirty = True
        return tuple(sorted(gang.slices))

    def _requeue(self, gang: _Gang, now: float) -> None:
        rid = gang.request.request_id
        n = self._evictions[rid] = self._evictions.get(rid, 0) + 1
        not_before = now + min(self.backoff_s * 2 ** (n - 1), self.max_backoff_s)
        # Back in its old place: eviction should not cost it its turn, only the backoff.
        self._enqueue(_Entry(gang.request, gang.key, since=not_before, not_before=not_before))
        heapq.heappush(self._wakeups, not_before)

    def _expire(self, now: float) -> list[Expire]:
        due: list[_Entry] = []
        while self._expiries and self._expiries[0][0] <= now:
            _, _, entry = heapq.heappop(self._expiries)
            if self._entries.get(entry.request.request_id) is entry:
                due.append(entry)
        due.sort(key=lambda e: e.key)
        free = {t: len(names) for t, names in self._free.items()}
        decisions = [
            Expire(
                e.request.request_id,
                expiry_reason(e.request, now - e.since, self.position(e.request.request_id), free),
            )
            for e in due
        ]
        for entry in due:
            self._dequeue(entry)
        return decisions

    def _force_release(self, now: float) -> list[ForceRelease]:
        due: list[_Gang] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, gang = heapq.heappop(self._deadlines)
            if self._gangs.get(gang.request.request_id) is gang:
                due.append(gang)
        due.sort(key=lambda g: (g.deadline, g.seq))
        decisions = []
        for gang in due:
            assert gang.preemptor is not None
            slices = self._release(gang.request.request_id, now)
            decisions.append(
                ForceRelease(gang.request.request_id, gang.preemptor.request.request_id, slices)
            )
        return decisions


@dataclass
class _WalkResult:
    actions: list[Admission | Preempt] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)


class _Walk:
    """One pass over the queue in order, deciding without changing the scheduler.

    Claims live only for the pass: `avail` counts free slices nobody earlier took or
    claimed; `claimed_below[t] = p` means gangs of priority < p holding type t are claimed.
    """

    def __init__(
        self, s: Scheduler, now: float, *, explain: bool = False, until: str | None = None
    ) -> None:
        self.s, self.now, self.explain, self.until = s, now, explain, until
        self.avail = {t: len(names) for t, names in s._free.items()}
        self.taken = dict.fromkeys(self.avail, 0)
        self.remaining = dict(s._demand)
        self.claimed_below: dict[str, int] = {}
        self.consumed: set[str] = set()  # gangs chosen as victims in this pass
        self.cursor = dict.fromkeys(s._victims, 0)  # first victim not yet ruled out
        self.claimants: dict[str, list[str]] = {}
        self.holders: dict[str, set[str]] | None = None
        self.result = _WalkResult()

    def run(self) -> _WalkResult:
        s = self.s
        stopped_at = None
        for key in s._queue:
            if not self.explain and not self._open(-key[0]):
                stopped_at = key
                break
            entry = s._entries[key[3]]
            for t in entry.types:
                self.remaining[t] -= 1
            self._visit(entry)
            if key[3] == self.until:
                break
        if stopped_at is not None:
            # Nothing is free or evictable for anyone left; only slices freed for a
            # preemptor can still admit it.
            late = sorted(s._entries[r].key for r in s._with_reserved)
            for key in late[bisect.bisect_left(late, stopped_at) :]:
                self._visit(s._entries[key[3]])
        return self.result

    def _open(self, priority: int) -> bool:
        for t, n in self.remaining.items():
            if n > 0 and (self.avail.get(t, 0) > 0 or self._evictable(t, priority)):
                return True
        return False

    def _evictable(self, t: str, priority: int) -> bool:
        if t in self.claimed_below:
            return False
        victims = self.s._victims.get(t, [])
        i = self.cursor.get(t, 0)
        while i < len(victims) and victims[i][0] < priority:
            if self._may_evict(self.s._gangs[victims[i][2]], priority):
                self.cursor[t] = i
                return True
            i += 1  # ruled out for the rest of the pass: consumed or claimed stays so
        self.cursor[t] = i
        return False

    def _may_evict(self, gang: _Gang, priority: int) -> bool:
        p = gang.request.priority
        return (
            p < priority
            and gang.preemptor is None
            and gang.request.request_id not in self.consumed
            and not any(p < self.claimed_below.get(t, -_INF) for t in gang.cover)
        )

    def _candidates(self, types: list[str], priority: int) -> list[_Gang]:
        seen: dict[str, _Gang] = {}
        for t in types:
            if t in self.claimed_below:
                continue
            for p, _, rid in self.s._victims.get(t, []):
                if p >= priority:
                    break
                gang = self.s._gangs[rid]
                if rid not in seen and self._may_evict(gang, priority):
                    seen[rid] = gang
        return list(seen.values())

    def _claim(self, rid: str, types: list[str], count: int) -> None:
        for t in types:
            n = min(self.avail.get(t, 0), count)
            if n > 0:
                self.avail[t] -= n
                count -= n
                if self.explain:
                    self.claimants.setdefault(t, []).append(rid)

    def _take(self, rid: str, t: str, count: int) -> list[str]:
        if count <= 0:
            return []
        start = self.taken[t]
        self.taken[t] += count
        self.avail[t] -= count
        if self.explain:
            self.claimants.setdefault(t, []).append(rid)
        return self.s._free[t][start : start + count]

    def _visit(self, entry: _Entry) -> None:
        s, r = self.s, entry.request
        rid, n, types, prio = r.request_id, r.num_slices, entry.types, r.priority
        if entry.not_before > self.now:
            if self.explain:
                self.result.reasons[rid] = (
                    f"preempted {s._evictions.get(rid, 0)} time(s); backs off for another "
                    f"{entry.not_before - self.now:.0f} s"
                )
            return
        avail = {t: self.avail.get(t, 0) for t in types}
        res: dict[str, list[str]] = {t: [] for t in types}
        for name in sorted(entry.reserved):
            tname, intact = s._state.get(name, ("", False))
            if intact and tname in res:
                res[tname].append(name)
        pend = {t: len(res[t]) for t in types}
        for victim in entry.victims:
            for t in types:
                pend[t] += s._gangs[victim].cover.get(t, 0)
        order = {t: i for i, t in enumerate(types)}

        def admit(names: list[str]) -> None:
            slices = tuple(sorted(names, key=lambda x: (order[s._state[x][0]], x)))
            self.result.actions.append(Admission(rid, slices))
            if self.explain:
                self.result.reasons[rid] = "can be admitted now"

        if r.same_type:
            for t in types:
                if len(res[t]) + avail[t] >= n:
                    mine = res[t][:n]
                    return admit(mine + self._take(rid, t, n - len(mine)))
            ready = next((t for t in types if avail[t] + pend[t] >= n), None)
            if ready is not None:
                self._claim(rid, [ready], n - pend[ready])
                return self._waiting(entry, res)
        else:
            if sum(len(v) for v in res.values()) + sum(avail.values()) >= n:
                names = [x for t in types for x in res[t]][:n]
                for t in types:
                    if len(names) < n and avail[t]:
                        names += self._take(rid, t, min(avail[t], n - len(names)))
                return admit(names)
            if sum(avail.values()) + sum(pend.values()) >= n:
                self._claim(rid, types, n - sum(pend.values()))
                return self._waiting(entry, res)
        if self._preempt(entry, avail, pend):
            return
        if r.same_type:
            for t in types:
                self._claim(rid, [t], n - pend[t])
        else:
            self._claim(rid, types, n - sum(pend.values()))
        for t in types:
            self.claimed_below.setdefault(t, prio)
        if self.explain:
            self.result.reasons[rid] = self._blocked_reason(entry, avail)

    def _preempt(self, entry: _Entry, avail: dict[str, int], pend: dict[str, int]) -> bool:
        r = entry.request
        rid, n, types = r.request_id, r.num_slices, entry.types
        options: list[tuple[list[str], int]] = (
            [([t], n - avail[t] - pend[t]) for t in types]
            if r.same_type
            else [(types, n - sum(avail.values()) - sum(pend.values()))]
        )
        best: tuple[tuple[tuple[float, float, float], int], tuple[Candidate, ...], list[str]] | None
        best = None
        for i, (ts, need) in enumerate(options):
            gangs = self._candidates(ts, r.priority)
            candidates = [
                Candidate(
                    g.request.request_id,
                    sum(g.cover.get(t, 0) for t in ts),
                    g.chips,
                    g.request.priority,
                    g.seq,
                )
                for g in gangs
            ]
            if sum(c.cover for c in candidates) < need:
                continue
            chosen = cheapest_victims(candidates, need)
            assert chosen is not None
            rank = (victim_cost(chosen), i)
            if best is None or rank < best[0]:
                best = (rank, chosen, ts)
        if best is None:
            return False
        _, chosen, ts = best
        deadline = self.now + self.s.grace_s
        for victim in chosen:
            self.consumed.add(victim.gang_id)
            self.result.actions.append(Preempt(victim.gang_id, rid, deadline))
        freed = sum(c.cover for c in chosen)
        self._claim(rid, ts, n - sum(pend[t] for t in ts) - freed)
        if self.explain:
            self.result.reasons[rid] = (
                f"can preempt {', '.join(c.gang_id for c in chosen)} (lower priority) now"
            )
        return True

    def _waiting(self, entry: _Entry, res: dict[str, list[str]]) -> None:
        if self.explain:
            reserved = sum(len(v) for v in res.values())
            victims = ", ".join(sorted(entry.victims, key=id_order)) or "nobody"
            self.result.reasons[entry.request.request_id] = (
                f"waiting for {victims} to release slices preempted for it; "
                f"{reserved} freed for it so far"
            )

    def _blocked_reason(self, entry: _Entry, avail: dict[str, int]) -> str:
        r, s = entry.request, self.s
        parts = []
        for t in entry.types:
            free = len(s._free.get(t, ()))
            text = f"{free} free now"
            if free - avail[t] > 0:
                who = _names(self.claimants.get(t, []))
                text += f", {free - avail[t]} claimed by earlier request(s) {who}"
            parts.append(text if len(entry.types) == 1 else f"{t}: {text}")
        if self.holders is None:
            self.holders = {}
            for gang in s._gangs.values():
                for stype in gang.types.values():
                    self.holders.setdefault(stype.name, set()).add(gang.request.request_id)
        holders = sorted(
            set().union(*(self.holders.get(t, set()) for t in entry.types)), key=id_order
        )
        if len(entry.types) == 1:
            head = f"needs {r.num_slices} free {entry.types[0]} slice(s), {parts[0]}"
        else:
            kind = "of one type among" if r.same_type else "(types may mix) of"
            head = f"needs {r.num_slices} free slice(s) {kind} {', '.join(entry.types)}; "
            head += "; ".join(parts)
        return head + (f"; held by {_names(holders)}" if holders else "")


def _names(ids: list[str], most: int = 5) -> str:
    ids = list(dict.fromkeys(ids))
    text = ", ".join(ids[:most])
    return text + (f" and {len(ids) - most} more" if len(ids) > most else "")
