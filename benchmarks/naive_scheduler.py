"""The baseline for benchmarks/scheduler.py: the same policy as controller.scheduler, written
the obvious way. Every `schedule()` re-sorts the whole queue, rescans the whole inventory,
walks every queued request and rescans every gang for each one that could preempt.

It shares only the request and decision types and the victim-choice function with the real
scheduler, so that a run of both on one stream checks the fast one's shortcuts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from controller.inventory import Slice, check_can_ever_fit
from controller.preemption import Candidate, cheapest_victims, victim_cost
from controller.scheduler import (
    BACKOFF_S,
    GRACE_S,
    MAX_BACKOFF_S,
    Admission,
    Decision,
    Expire,
    ForceRelease,
    GangRequest,
    Preempt,
    expiry_reason,
)
from slicewise.common.topology import SliceType


@dataclass(eq=False)
class _Waiting:
    request: GangRequest
    seq: int
    since: float
    not_before: float = -math.inf
    victims: set[str] = field(default_factory=set)

    def key(self) -> tuple[int, float, int]:
        return (-self.request.priority, self.request.submitted_at, self.seq)

    def expires_at(self) -> float:
        wait = self.request.max_wait_s
        return math.inf if wait is None else self.since + wait


@dataclass(eq=False)
class _Running:
    request: GangRequest
    seq: int  # queue seq, kept for requeueing
    admitted: int
    slices: dict[str, SliceType]
    preemptor: _Waiting | None = None
    deadline: float = math.inf


class NaiveScheduler:
    """Same decisions as controller.scheduler.Scheduler, recomputed from scratch each time."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        grace_s: float = GRACE_S,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.clock = clock
        self.grace_s, self.backoff_s, self.max_backoff_s = grace_s, backoff_s, max_backoff_s
        self.inventory: dict[str, Slice] = {}
        self.queue: list[_Waiting] = []
        self.running: dict[str, _Running] = {}
        self.reserved: dict[str, _Waiting] = {}
        self.evictions: dict[str, int] = {}
        self.counter = 0
        self._state: dict[str, tuple[str, bool]] = {}

    def _next(self) -> int:
        self.counter += 1
        return self.counter

    def set_inventory(self, slices: Mapping[str, Slice]) -> None:
        """Replaces the inventory."""
        self.inventory = dict(slices)
        self._rescan()

    def holder(self, name: str) -> str | None:
        """The gang holding the slice, if any."""
        return next((rid for rid, g in self.running.items() if name in g.slices), None)

    def held_by(self, request_id: str) -> tuple[str, ...]:
        """The slices the request holds."""
        gang = self.running.get(request_id)
        return tuple(sorted(gang.slices)) if gang else ()

    def queued(self) -> list[GangRequest]:
        """Queued requests in order."""
        return [w.request for w in sorted(self.queue, key=_Waiting.key)]

    def submit(self, request: GangRequest) -> None:
        """Queues a request (CapacityError when it can never fit)."""
        known = dict(self.inventory)
        for gang in self.running.values():
            for name, stype in gang.slices.items():
                known.setdefault(name, Slice(name, stype, (), simulated=False))
        check_can_ever_fit(
            known, request.num_slices, request.slice_types, same_type=request.same_type
        )
        if not request.submitted_at:
            request.submitted_at = self.clock()
        self.queue.append(_Waiting(request, self._next(), request.submitted_at))

    def cancel(self, request_id: str) -> None:
        """Drops a queued request."""
        for w in [w for w in self.queue if w.request.request_id == request_id]:
            self._drop(w)

    def release(self, request_id: str) -> tuple[str, ...]:
        """Frees the request's slices; requeues it if it was being preempted."""
        return self._release(request_id, self.clock())

    def _release(self, request_id: str, now: float) -> tuple[str, ...]:
        gang = self.running.pop(request_id, None)
        if gang is None:
            return ()
        preemptor = gang.preemptor
        if preemptor is not None:
            if preemptor in self.queue:
                preemptor.victims.discard(request_id)
                wanted = {t.name for t in preemptor.request.slice_types}
                for name, stype in gang.slices.items():
                    if stype.name in wanted:
                        self.reserved[name] = preemptor
            n = self.evictions[request_id] = self.evictions.get(request_id, 0) + 1
            not_before = now + min(self.backoff_s * 2 ** (n - 1), self.max_backoff_s)
            self.queue.append(_Waiting(gang.request, gang.seq, not_before, not_before))
        return tuple(sorted(gang.slices))

    def _drop(self, waiting: _Waiting) -> None:
        self.queue.remove(waiting)
        for name in [n for n, w in self.reserved.items() if w is waiting]:
            del self.reserved[name]

    def _intact(self, name: str) -> tuple[str, bool]:
        return self._state.get(name, ("", False))

    def _rescan(self) -> None:
        # Once per decision, not once per lookup: otherwise the baseline takes minutes.
        self._state = {n: (s.type.name, s.intact) for n, s in self.inventory.items()}

    def _free(self) -> dict[str, list[str]]:
        held = {n for g in self.running.values() for n in g.slices}
        free: dict[str, list[str]] = {}
        for name in sorted(self.inventory):
            tname, intact = self._intact(name)
            if intact and name not in held and name not in self.reserved:
                free.setdefault(tname, []).append(name)
        return free

    def _cover(self, gang: _Running, types: list[str]) -> int:
        return sum(1 for n in gang.slices if self._intact(n)[1] and self._intact(n)[0] in types)

    def schedule(self) -> list[Decision]:
        """Recomputes every decision from scratch."""
        now = self.clock()
        self._rescan()
        decisions: list[Decision] = []
        queue = sorted(self.queue, key=_Waiting.key)
        free = self._free()
        counts = {t: len(v) for t, v in free.items()}
        due = [w for w in queue if w.expires_at() <= now]
        for w in due:
            decisions.append(
                Expire(
                    w.request.request_id,
                    expiry_reason(w.request, now - w.since, queue.index(w), counts),
                )
            )
        for w in due:
            self._drop(w)
        late = sorted(
            (g for g in self.running.values() if g.preemptor is not None and g.deadline <= now),
            key=lambda g: (g.deadline, g.admitted),
        )
        for gang in late:
            assert gang.preemptor is not None
            slices = self._release(gang.request.request_id, now)
            decisions.append(
                ForceRelease(gang.request.request_id, gang.preemptor.request.request_id, slices)
            )
        decisions += self._walk(now)
        return decisions

    def _walk(self, now: float) -> list[Decision]:
        free = self._free()
        avail = {t: len(v) for t, v in free.items()}
        taken = dict.fromkeys(avail, 0)
        out: list[Decision] = []
        claimed: set[str] = set()
        consumed: set[str] = set()
        for w in sorted(self.queue, key=_Waiting.key):
            r = w.request
            rid, n, prio = r.request_id, r.num_slices, r.priority
            types = [t.name for t in r.slice_types]
            if w.not_before > now:
                continue
            res = {
                t: sorted(
                    x for x, o in self.reserved.items() if o is w and self._intact(x) == (t, True)
                )
                for t in types
            }
            pend = {
                t: len(res[t]) + sum(self._cover(self.running[v], [t]) for v in w.victims)
                for t in types
            }
            av = {t: avail.get(t, 0) for t in types}

            def take(t: str, k: int, rid: str = rid) -> list[str]:
                got = free.get(t, [])[taken.get(t, 0) : taken.get(t, 0) + k]
                taken[t] = taken.get(t, 0) + k
                avail[t] = avail.get(t, 0) - k
                return got

            def claim(ts: list[str], k: int) -> None:
                for t in ts:
                    m = min(avail.get(t, 0), k)
                    if m > 0:
                        avail[t] -= m
                        k -= m

            names: list[str] | None = None
            if r.same_type:
                for t in types:
                    if len(res[t]) + av[t] >= n:
                        names = res[t][:n]
                        names += take(t, n - len(names)) if n > len(names) else []
                        break
            elif sum(map(len, res.values())) + sum(av.values()) >= n:
                names = [x for t in types for x in res[t]][:n]
                for t in types:
                    if len(names) < n and av[t]:
                        names += take(t, min(av[t], n - len(names)))
            if names is not None:
                order = {t: i for i, t in enumerate(types)}
                out.append(
                    Admission(
                        rid, tuple(sorted(names, key=lambda x: (order[self._intact(x)[0]], x)))
                    )
                )
                continue
            if r.same_type:
                ready = [t for t in types if av[t] + pend[t] >= n]
                if ready:
                    claim(ready[:1], n - pend[ready[0]])
                    continue
            elif sum(av.values()) + sum(pend.values()) >= n:
                claim(types, n - sum(pend.values()))
                continue
            options = (
                [([t], n - av[t] - pend[t]) for t in types]
                if r.same_type
                else [(types, n - sum(av.values()) - sum(pend.values()))]
            )
            best = None
            for i, (ts, need) in enumerate(options):
                cands = []
                for gid, g in self.running.items():
                    if (
                        g.request.priority >= prio
                        or g.preemptor is not None
                        or gid in consumed
                        or gid in claimed
                    ):
                        continue
                    cover = self._cover(g, ts)
                    if cover:
                        cands.append(
                            Candidate(
                                gid,
                                cover,
                                sum(t.chips for t in g.slices.values()),
                                g.request.priority,
                                g.admitted,
                            )
                        )
                if sum(c.cover for c in cands) < need:
                    continue
                chosen = cheapest_victims(cands, need)
                assert chosen is not None
                if best is None or (victim_cost(chosen), i) < best[0]:
                    best = ((victim_cost(chosen), i), chosen, ts)
            if best is not None:
                _, chosen, ts = best
                for c in chosen:
                    consumed.add(c.gang_id)
                    out.append(Preempt(c.gang_id, rid, now + self.grace_s))
                claim(ts, n - sum(pend[t] for t in ts) - sum(c.cover for c in chosen))
                continue
            if r.same_type:
                for t in types:
                    claim([t], n - pend[t])
            else:
                claim(types, n - sum(pend.values()))
            for gid, g in self.running.items():
                if g.request.priority < prio and g.preemptor is None and self._cover(g, types):
                    claimed.add(gid)
        for d in out:
            self._apply(d, now)
        return out

    def _apply(self, decision: Decision, now: float) -> None:
        if isinstance(decision, Admission):
            w = next(w for w in self.queue if w.request.request_id == decision.request_id)
            self._drop(w)
            self.running[decision.request_id] = _Running(
                w.request, w.seq, self._next(), {n: self.inventory[n].type for n in decision.slices}
            )
        elif isinstance(decision, Preempt):
            gang = self.running[decision.victim_id]
            gang.preemptor = next(
                w for w in self.queue if w.request.request_id == decision.for_request
            )
            gang.deadline = decision.deadline
            gang.preemptor.victims.add(decision.victim_id)
