"""Carrying out the scheduler's decisions: gangs are admitted, started, preempted,
resumed, shared and released here. The decisions themselves are the pure scheduler's
(scheduler.py); this is the I/O around them (the cluster backend, workers, waiters).
Every change of a gang's state goes through `Gang.transition` (gangstate.py has the
table). Shared gangs are sharing.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from controller.auth import Caps, current_identity, may_see
from controller.backend import ClusterBackend
from controller.gang import LOST_POLL_S, Gang, SliceLostError
from controller.gangstate import GangState, why_unusable
from controller.health import raylet_answers
from controller.inventory import Slice, slices_from_nodes
from controller.options import DEFAULT_OPTIONS, ControllerOptions
from controller.scheduler import (
    Admission,
    Decision,
    Expire,
    ForceRelease,
    GangRequest,
    Preempt,
    Scheduler,
)
from controller.sharing import SharedGangs
from slicewise.common.errors import (
    CapacityError,
    DeadlineError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
)
from slicewise.common.ids import unguessable_id
from slicewise.common.topology import slice_type
from slicewise.common.trace import SpanRecorder

log = logging.getLogger(__name__)


class GangManager:
    """The controller's gangs: admission, start, preemption, sharing, release."""

    def __init__(
        self,
        backend: ClusterBackend,
        *,
        clock: Callable[[], float] = time.monotonic,
        options: ControllerOptions = DEFAULT_OPTIONS,
        spans: SpanRecorder | None = None,
        on_released: Callable[[Gang, str], None] = lambda gang, why: None,
        lost_poll_s: float = LOST_POLL_S,
        next_id: Callable[[], int] | None = None,
        gone: Mapping[str, str] | None = None,
    ) -> None:
        """`next_id` numbers the gangs (`g1-<suffix>`, `g2-...`: slicewise/common/ids.py; a
        journal's counter keeps numbering across restarts); `gone` says why ids of an
        earlier run no longer name a gang."""
        self.options = options
        self.scheduler = Scheduler(clock, grace_s=options.preemption_grace_s)
        self.gangs: dict[str, Gang] = {}
        self.spans = spans or SpanRecorder()
        self._backend = backend
        self._clock = clock
        self._on_released = on_released
        self._lost_poll_s = lost_poll_s
        self._next_id = next_id or itertools.count(1).__next__
        self._released: OrderedDict[str, str] = OrderedDict(gone or {})
        # The tenant of every gang, kept (as long as why it went) after it is released.
        self._tenants: dict[str, str] = {}
        self._waiters: dict[str, asyncio.Future[tuple[str, ...]]] = {}
        self.shared = SharedGangs(lambda gang: self.gangs.get(gang.gang_id) is gang)
        # Decisions about gangs that were still starting, carried out once they are up.
        self._deferred: dict[str, list[Preempt | ForceRelease]] = {}
        self._resuming: dict[str, asyncio.Task[None]] = {}
        self._allocating: set[str] = set()  # requests of allocations under way
        # Per-tenant caps (controller/auth.py), and the chips each allocation under way
        # asks for, by gang id: (tenant, chips).
        self.caps: dict[str, Caps] = {}
        self._asking: dict[str, tuple[str, int]] = {}
        # Ray nodes found gone (their raylet does not answer) before Ray noticed.
        self._lost_nodes: set[str] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Future[Any]] = set()

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh_inventory()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="inventory")

    async def shutdown(self, why: str) -> None:
        """Releases every gang (those still being allocated are left to their allocation,
        which rolls them back when it is cancelled)."""
        if self._refresher is not None:
            self._refresher.cancel()
        resuming = list(self._resuming.values())
        for task in resuming:
            task.cancel()
        await asyncio.gather(*resuming, return_exceptions=True)
        for gang_id in list(self.gangs):
            if gang_id in self._allocating:
                log.warning("gang %s is still being allocated at shutdown", gang_id)
                continue
            await self.release(gang_id, why=why, detach_all=True)
        await asyncio.gather(*self._background, return_exceptions=True)

    async def refresh_inventory(self) -> dict[str, Slice]:
        nodes = await asyncio.to_thread(self._backend.nodes)
        # Once Ray says so too, a lost node needs no remembering.
        self._lost_nodes -= {n["NodeID"] for n in nodes if not n.get("Alive")}
        slices = slices_from_nodes(nodes, self._lost_nodes)
        self.scheduler.set_inventory(slices)
        self.decide()
        return slices

    async def check_hosts(self, gang: Gang) -> list[tuple[str, int]]:
        """Asks the raylet of every host of a failed gang whether it is still there;
        marks the hosts that do not answer as lost (their slices are broken from now on,
        not once Ray's health checks notice, seconds later); returns them as (slice
        name, host index)."""
        hosts = [(s, h) for s in gang.slices for h in s.hosts if h.alive]
        answers = await asyncio.gather(
            *(asyncio.to_thread(raylet_answers, h.address, h.port) for _, h in hosts)
        )
        lost = [(s, h) for (s, h), up in zip(hosts, answers, strict=True) if not up]
        if lost:
            self._lost_nodes.update(h.node_id for _, h in lost)
            await self.refresh_inventory()
        return [(s.name, h.worker_id) for s, h in lost]

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.inventory_period_s)
            try:
                await self.refresh_inventory()
            except Exception:  # noqa: BLE001 - keep serving; the next round may work
                log.exception("reading the cluster's node table failed")

    # -- lookups --------------------------------------------------------------------

    def resolve(self, gang_id: str, *, usable: bool = True) -> tuple[Gang, str]:
        """The gang an id (or a shared gang's attachment id `g3-...@a2`) names, and the
        attachment it was used through ("" for the owner of an unshared gang).

        Raises:
            NotFoundError: the id is unknown.
            FailedPreconditionError: released; or, with `usable`, not able to run work now.
        """
        base, _, attachment = gang_id.partition("@")
        seen = self.visible(base)  # another tenant's gang is as if it did not exist
        gang = self.gangs.get(base) if seen else None
        if gang is None or (attachment and attachment not in gang.attachments):
            why = (self._released.get(gang_id) or self._released.get(base)) if seen else None
            if why is not None:
                raise FailedPreconditionError(
                    f"gang {gang_id} {why}; allocate a new gang to run more work"
                )
            raise NotFoundError(f"gang {gang_id!r} is unknown to this controller")
        if usable:
            self.check_usable(gang, gang_id)
        return gang, attachment

    def _check_caps(self, chips: int, priority: int) -> None:
        """Raises if the caller's tenant may not ask for `chips` more at `priority`.

        Raises:
            CapacityError: past its cap on priority, chips held or asked for, or
                allocations waiting; the message says what is in use.
        """
        tenant = current_identity().tenant
        caps = self.caps.get(tenant)
        if caps is None:
            return
        if caps.max_priority is not None and priority > caps.max_priority:
            raise CapacityError(
                f"tenant {tenant!r} may ask for priority up to {caps.max_priority}, not {priority}"
            )
        asking = [n for t, n in self._asking.values() if t == tenant]
        if caps.max_queued is not None and len(asking) >= caps.max_queued:
            raise CapacityError(
                f"tenant {tenant!r} has {len(asking)} allocation(s) under way, its cap "
                f"(max_queued {caps.max_queued}); wait for one to finish or give up"
            )
        held = sum(
            g.shape.num_slices * g.shape.hosts_per_slice * g.shape.chips_per_host
            for g in self.gangs.values()
            if g.tenant == tenant and g.gang_id not in self._asking
        )
        if caps.max_chips is not None and held + sum(asking) + chips > caps.max_chips:
            raise CapacityError(
                f"tenant {tenant!r} holds {held} chips and is allocating {sum(asking)} more, "
                f"of its cap of {caps.max_chips}; this asks for {chips}: release a gang first"
            )

    def visible(self, gang_id: str) -> bool:
        """Whether the caller may see the gang of an id (a gang, attachment or array id);
        ids of gangs never made count as visible (they answer NOT_FOUND anyway)."""
        tenant = self._tenants.get(gang_id.partition("@")[0].partition("/")[0])
        return tenant is None or may_see(tenant)

    def get(self, gang_id: str, *, usable: bool = True) -> Gang:
        return self.resolve(gang_id, usable=usable)[0]

    def check_usable(self, gang: Gang, gang_id: str = "") -> None:
        """Returns if work may run on the gang now; else says why, and what to do.

        Raises:
            FailedPreconditionError: the gang failed, is stopping, preempted or starting.
        """
        if gang.state.usable:
            return  # as `why_unusable` says, without looking up a queue position (per call)
        why = why_unusable(gang, gang_id or gang.gang_id, self._position(gang.gang_id))
        if why is not None:
            raise FailedPreconditionError(why)

    def _position(self, request_id: str) -> int | None:
        try:
            return self.scheduler.position(request_id)
        except NotFoundError:
            return None

    # -- allocation -----------------------------------------------------------------

    async def allocate(
        self,
        num_slices: int,
        slice_type_name: str,
        *,
        timeout_s: float = 0,
        client: str = "",
        priority: int = 0,
        max_wait_s: float | None = None,
        alternatives: Sequence[str] = (),
        same_type: bool = True,
        shared: str = "",
        weight: float = 1.0,
    ) -> tuple[Gang, str]:
        """Admits a gang of whole slices and starts its workers (see AllocateGang).
        Returns the gang and the id the caller should use for it."""
        if not (math.isfinite(weight) and weight > 0):
            raise InvalidRequestError(
                f"a share weight (AllocateGangRequest.weight) must be a positive finite "
                f"number, got {weight!r}; unset means 1"
            )
        if shared:

            async def create() -> Gang:
                created, _ = await self.allocate(
                    num_slices,
                    slice_type_name,
                    timeout_s=timeout_s,
                    client=client,
                    priority=priority,
                    max_wait_s=max_wait_s,
                    alternatives=alternatives,
                    same_type=same_type,
                )
                return created

            shared_gang = await self.shared.get_or_create(shared, create)
            attachment = self.shared.attach(
                shared_gang, num_slices, slice_type_name, client, weight
            )
            return shared_gang, attachment
        stype = slice_type(slice_type_name)
        alts = tuple(slice_type(n) for n in alternatives if slice_type(n) != stype)
        shapes = {(t.hosts, t.chips_per_host) for t in (stype, *alts)}
        if not same_type and len(shapes) > 1:
            raise InvalidRequestError(
                "a gang runs one SPMD program over equal slices, and slices of types "
                f"{', '.join(t.name for t in (stype, *alts))} differ in shape; ask for one "
                "type at a time (alternatives without mixed types)"
            )
        timeout_s = timeout_s or self.options.allocate_timeout_s
        chips = num_slices * stype.chips
        self._check_caps(chips, priority)
        gang_id = unguessable_id("g", self._next_id())
        self._asking[gang_id] = (current_identity().tenant, chips)
        request = GangRequest(
            gang_id,
            num_slices,
            stype,
            client,
            priority=priority,
            slice_types=(stype, *alts),
            same_type=same_type,
            max_wait_s=max_wait_s,
        )
        await self.refresh_inventory()
        log.info(
            "gang %s: %s asks for %d x %s (priority %d)",
            gang_id,
            client or "a client",
            num_slices,
            "/".join(t.name for t in request.slice_types),
            priority,
        )
        deadline = self._clock() + timeout_s
        gang: Gang | None = None
        self._allocating.add(gang_id)
        try:
            for attempt in range(1, self.options.reserve_attempts + 1):
                slice_names = await self._admitted(request, deadline)
                if gang is None:
                    gang = self.gangs[gang_id] = Gang(
                        gang_id,
                        client,
                        stype,
                        num_slices,
                        backend=self._backend,
                        options=self.options,
                        spans=self.spans,
                        lost_poll_s=self._lost_poll_s,
                    )
                    gang.priority = priority
                    self._tenants[gang_id] = gang.tenant
                try:
                    await gang.start(
                        self._slices(slice_names),
                        self.options.gang_start_timeout_s,
                        self._lost_slice(gang),
                    )
                    break
                except SliceLostError as exc:
                    # Rolled back (nothing of it is left): try again elsewhere, in the
                    # request's old place in the queue (it keeps its submission time, and
                    # nothing is admitted before it is queued again).
                    self.scheduler.release(gang_id)
                    self.scheduler.cancel(gang_id)
                    if attempt == self.options.reserve_attempts:
                        raise
                    log.warning(
                        "gang %s: %s; retrying (%d/%d)",
                        gang_id,
                        exc,
                        attempt,
                        self.options.reserve_attempts,
                    )
        except BaseException as exc:
            self._give_up(gang_id, gang, exc)
            raise
        finally:
            self._allocating.discard(gang_id)
            self._asking.pop(gang_id, None)
        assert gang is not None  # the loop breaks only once it started
        self._carry_out_deferred(gang)
        return gang, gang_id

    async def _admitted(self, request: GangRequest, deadline: float) -> tuple[str, ...]:
        """Queues the request and waits until the scheduler admits it. A caller that
        gives up (timeout, cancellation) leaves nothing behind: no queue entry, and no
        slices if it was admitted just as it gave up."""
        rid = request.request_id
        self.scheduler.submit(request)
        waiter = self._waiters[rid] = asyncio.get_running_loop().create_future()
        self.decide()
        try:
            slices = await asyncio.wait_for(asyncio.shield(waiter), deadline - self._clock())
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # Python 3.11's wait_for returns a result that raced its cancellation.
                raise asyncio.CancelledError()
            return slices
        except BaseException as exc:
            timed_out = isinstance(exc, TimeoutError) and not isinstance(exc, DeadlineError)
            why = self.scheduler.why_waiting(rid) if timed_out else ""
            if not waiter.done():
                self.scheduler.cancel(rid)
            elif waiter.exception() is None:
                self.scheduler.release(rid)  # admitted just as its caller gave up
                self.decide()
            if timed_out:
                raise DeadlineError(
                    f"no {request.num_slices} x {request.slice_type.name} could be admitted "
                    f"in time: {why}; wait longer (timeout) or release other gangs"
                ) from None
            raise
        finally:
            self._waiters.pop(rid, None)

    def _give_up(self, gang_id: str, gang: Gang | None, exc: BaseException) -> None:
        """Forgets an allocation that failed; its start was rolled back already."""
        self._deferred.pop(gang_id, None)
        if gang is not None:
            if self.gangs.get(gang_id) is gang:
                del self.gangs[gang_id]
            if gang.state is GangState.QUEUED:
                gang.transition(GangState.FAILED, why=f"could not be allocated: {exc}")
        self.scheduler.release(gang_id)
        self.scheduler.cancel(gang_id)
        self.decide()

    def _slices(self, names: Sequence[str]) -> list[Slice]:
        """The admitted slices as the inventory has them now.

        Raises:
            SliceLostError: one of them vanished from the inventory since.
        """
        for name in names:
            if name not in self.scheduler.inventory:
                raise SliceLostError(f"slice {name} left the cluster as it was admitted")
        return [self.scheduler.inventory[n] for n in names]

    def _lost_slice(self, gang: Gang) -> Callable[[], str | None]:
        def lost() -> str | None:
            for s in gang.slices:
                now = self.scheduler.inventory.get(s.name)
                if now is None or not now.intact:
                    return s.name
            return None

        return lost

    # -- the scheduler's decisions ----------------------------------------------------

    def decide(self) -> None:
        """Asks the scheduler and carries out what it decides, in order."""
        for decision in self.scheduler.schedule():
            self._carry_out(decision)

    def _carry_out(self, decision: Decision) -> None:
        if isinstance(decision, Admission):
            self._on_admission(decision)
        elif isinstance(decision, Expire):
            waiter = self._waiters.get(decision.request_id)
            if waiter is not None and not waiter.done():
                waiter.set_exception(DeadlineError(decision.reason))
        else:
            victim = decision.victim_id
            gang = self.gangs.get(victim)
            starting = victim in self._allocating or victim in self._resuming
            if starting and (gang is None or not gang.state.usable):
                self._deferred.setdefault(victim, []).append(decision)
            elif gang is None:
                return
            elif isinstance(decision, Preempt):
                self._on_preempt(gang, decision)
            else:
                self._on_force_release(gang, decision.for_request)

    def _carry_out_deferred(self, gang: Gang) -> None:
        """What was decided about the gang while it was starting, now that it is up."""
        for decision in self._deferred.pop(gang.gang_id, []):
            self._carry_out(decision)

    def _on_admission(self, admission: Admission) -> None:
        rid = admission.request_id
        waiter = self._waiters.get(rid)
        if waiter is not None and not waiter.done():
            waiter.set_result(admission.slices)
            return
        gang = self.gangs.get(rid)
        if gang is not None and GangState.PREEMPTED in (gang.state, gang.stopping_to):
            self._resuming[rid] = asyncio.create_task(self._resume(gang, admission.slices))
            return
        self.scheduler.release(rid)  # its client gave up meanwhile
        self.scheduler.cancel(rid)

    def grace_left(self, gang: Gang) -> float:
        """Seconds left of the grace period of a gang being preempted (0 when over)."""
        return max(0.0, gang.preempt_deadline - self._clock())

    def _on_preempt(self, gang: Gang, decision: Preempt) -> None:
        if gang.state is not GangState.READY:
            return  # failed or stopping already: its slices come free without a notice
        grace = max(0.0, decision.deadline - self._clock())
        gang.preempted_by = decision.for_request
        gang.preempt_deadline = decision.deadline
        gang.transition(GangState.PREEMPTING, why=f"is being preempted by {decision.for_request}")
        gang.publish(
            "preempt",
            f"gang {gang.gang_id} must make room for {decision.for_request} within "
            f"{grace:.0f} s: save what you need and release (or yield) it",
        )

    def _on_force_release(self, gang: Gang, for_request: str) -> None:
        """The grace period is over and the scheduler took the slices back: the gang
        stops at once (and stays queued to resume), unless it is stopping already."""
        if gang.state is GangState.FAILED:
            self._spawn(gang.stop(GangState.FAILED, gang.why))
        elif gang.state.usable:
            gang.preempted_by = for_request
            stopping = gang.stop(
                GangState.PREEMPTED,
                f"is being preempted by {for_request} (its grace period is over)",
            )
            self._spawn(self._after_preempted(gang, stopping, for_request))

    async def _after_preempted(
        self, gang: Gang, stopping: asyncio.Future[None], for_request: str
    ) -> None:
        await stopping
        if gang.state is GangState.RELEASED:
            return
        self._on_released(gang, f"was preempted by {for_request}")
        gang.publish(
            "preempted",
            f"gang {gang.gang_id} was stopped for {for_request}; it is queued to resume on "
            "new workers (its arrays are gone)",
        )

    async def _resume(self, gang: Gang, slice_names: tuple[str, ...]) -> None:
        rid = gang.gang_id
        try:
            await gang.wait_stopped()
            if self.gangs.get(rid) is not gang or gang.state is not GangState.PREEMPTED:
                self.scheduler.release(rid)  # released meanwhile
                self.scheduler.cancel(rid)
                return
            await gang.start(
                self._slices(slice_names), self.options.gang_start_timeout_s, self._lost_slice(gang)
            )
        except Exception as exc:  # noqa: BLE001 - the gang fails; its owner hears of it
            gang.transition(GangState.FAILED, why=f"could not resume: {exc}")
            self._deferred.pop(rid, None)
            self.scheduler.release(rid)  # nothing runs on its slices: free them now
            self.scheduler.cancel(rid)
            gang.publish("failed", gang.why)
            self.decide()
            return
        finally:
            self._resuming.pop(rid, None)
        gang.publish("resumed", f"gang {rid} runs again on {', '.join(slice_names)}")
        self._carry_out_deferred(gang)

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- release --------------------------------------------------------------------

    async def release(
        self,
        gang_id: str,
        why: str = "was released",
        *,
        requeue: bool = False,
        detach_all: bool = False,
    ) -> None:
        """Releases a gang (or detaches one attachment of a shared gang; the gang goes when
        its last attachment does). With `requeue` a gang being preempted yields its
        slices at once but stays queued to resume, as a preempted gang does.

        Raises:
            FailedPreconditionError: requeue of a gang that is not being preempted; or the
                gang is still being allocated.
        """
        gang, attachment = self.resolve(gang_id, usable=False)
        base = gang.gang_id
        if base in self._allocating:
            raise FailedPreconditionError(
                f"gang {gang_id} is still being allocated; release it once its allocation returns"
            )
        if requeue and GangState.PREEMPTED in (gang.state, gang.stopping_to):
            return  # preempted already, or being stopped for it: queued to resume
        if requeue and gang.state is not GangState.PREEMPTING:
            raise FailedPreconditionError(
                f"gang {gang_id} is not being preempted; only a preempted gang can yield and "
                "stay queued (release it instead)"
            )
        if attachment and not detach_all:
            del gang.attachments[attachment]
            self._released[gang_id] = "was released (detached from the shared gang)"
            if gang.attachments:
                log.info("gang %s: attachment %s detached", base, attachment)
                return
        if requeue:
            await gang.stop(GangState.PREEMPTED, f"is yielding its slices to {gang.preempted_by}")
            self._on_released(gang, why)
            gang.publish(
                "preempted",
                f"gang {base} yielded its slices to {gang.preempted_by}; it is queued to "
                "resume on new workers (its arrays are gone)",
            )
            self.scheduler.release(base)  # a preempted gang goes back to its queue place
            self.decide()
            return
        resuming = self._resuming.get(base)
        if resuming is not None:
            resuming.cancel()
            await asyncio.gather(resuming, return_exceptions=True)
        del self.gangs[base]
        self._released[base] = why  # calls during the stop learn why already
        while len(self._released) > 10_000:
            gone, _ = self._released.popitem(last=False)
            self._tenants.pop(gone, None)
        if gang.shared_name:
            self.shared.forget(gang)
        self._deferred.pop(base, None)
        await gang.stop(GangState.RELEASED, why)
        self._on_released(gang, why)
        self.scheduler.release(base)
        self.scheduler.cancel(base)  # released for good: not back to the queue
        gang.publish("released", f"gang {base} {why}")
        self.decide()
