"""Carrying out the scheduler's decisions: gangs are admitted, started, preempted,
resumed, shared and released here. The decisions themselves are the pure scheduler's
(scheduler.py); this is the I/O around them (Ray placement groups, workers, waiters).

A gang may be shared (Pathways-style multi-tenancy): clients that allocate with the same
`shared` name attach to one gang and get their own attachment id, `g3@a2`, to use as the
gang id; their programs are interleaved in the gang's single order by weight.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from controller.gang import Gang, GangState, SliceLostError
from controller.inventory import Slice, slices_from_nodes
from controller.scheduler import Admission, Expire, ForceRelease, GangRequest, Preempt, Scheduler
from slicewise.common.errors import (
    DeadlineError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
)
from slicewise.common.topology import slice_type
from slicewise.common.trace import SpanRecorder

log = logging.getLogger(__name__)

DEFAULT_ALLOCATE_TIMEOUT_S = 600.0
GANG_START_TIMEOUT_S = 240.0
# Reservations that lose a slice mid-way are retried this often on other slices.
RESERVE_ATTEMPTS = 3
_INVENTORY_PERIOD_S = 1.0


class GangManager:
    """The controller's gangs: admission, start, preemption, sharing, release."""

    def __init__(
        self,
        nodes: Callable[[], list[dict[str, Any]]],
        *,
        worker_window: int = 3,
        spans: SpanRecorder | None = None,
        grace_s: float = 30.0,
        on_released: Callable[[Gang, str], None] = lambda gang, why: None,
    ) -> None:
        self.scheduler = Scheduler(grace_s=grace_s)
        self.gangs: dict[str, Gang] = {}
        self.spans = spans or SpanRecorder()
        self._nodes = nodes
        self._worker_window = worker_window
        self._on_released = on_released
        self._ids = itertools.count(1)
        self._attach_ids = itertools.count(1)
        self._released: OrderedDict[str, str] = OrderedDict()
        self._waiters: dict[str, asyncio.Future[tuple[str, ...]]] = {}
        # shared name -> the gang of that name (a future while it is being allocated)
        self._shared: dict[str, asyncio.Future[Gang]] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh_inventory()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="inventory")

    async def shutdown(self, why: str) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for gang_id in list(self.gangs):
            await self.release(gang_id, why=why, detach_all=True)

    async def refresh_inventory(self) -> dict[str, Slice]:
        slices = slices_from_nodes(await asyncio.to_thread(self._nodes))
        self.scheduler.set_inventory(slices)
        self.decide()
        return slices

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(_INVENTORY_PERIOD_S)
            try:
                await self.refresh_inventory()
            except Exception:  # noqa: BLE001 - keep serving; the next round may work
                log.exception("reading the Ray node table failed")

    # -- lookups --------------------------------------------------------------------

    def resolve(self, gang_id: str, *, usable: bool = True) -> tuple[Gang, str]:
        """The gang an id (or a shared gang's attachment id `g3@a2`) names, and the
        attachment it was used through ("" for the owner of an unshared gang).

        Raises:
            NotFoundError, FailedPreconditionError: unknown, released, failed, preempted.
        """
        base, _, attachment = gang_id.partition("@")
        gang = self.gangs.get(base)
        if gang is None or (attachment and attachment not in gang.attachments):
            why = self._released.get(gang_id) or self._released.get(base)
            if why is not None:
                raise FailedPreconditionError(
                    f"gang {gang_id} {why}; allocate a new gang to run more work"
                )
            raise NotFoundError(f"gang {gang_id!r} is unknown to this controller")
        if usable and gang.state is GangState.FAILED:
            raise FailedPreconditionError(
                f"gang {gang_id} failed ({gang.failure}); release it and allocate a new one"
            )
        if usable and gang.state in (GangState.PREEMPTED, GangState.STARTING):
            position = self._position(base)
            where = f" (queue position {position})" if position is not None else ""
            raise FailedPreconditionError(
                f"gang {gang_id} was preempted by a higher-priority request and is queued to "
                f"resume{where}; its arrays are gone: upload them again once it is back"
            )
        return gang, attachment

    def get(self, gang_id: str, *, usable: bool = True) -> Gang:
        return self.resolve(gang_id, usable=usable)[0]

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
        if weight <= 0:
            raise InvalidRequestError(f"a share weight must be positive, got {weight}")
        if shared:
            existing = self._shared.get(shared)
            if existing is not None:  # being allocated by another client, or up already
                gang = await asyncio.shield(existing)
                return self._attach(gang, num_slices, slice_type_name, client, weight)
            creating = self._shared[shared] = asyncio.get_running_loop().create_future()
            try:
                gang, _ = await self.allocate(
                    num_slices,
                    slice_type_name,
                    timeout_s=timeout_s,
                    client=client,
                    priority=priority,
                    max_wait_s=max_wait_s,
                    alternatives=alternatives,
                    same_type=same_type,
                )
            except BaseException as exc:
                del self._shared[shared]
                creating.set_exception(
                    exc
                    if isinstance(exc, Exception)
                    else DeadlineError(f"shared gang {shared!r} was not created")
                )
                creating.exception()  # retrieved: waiters get it; nobody else needs to
                raise
            gang.share(shared)
            creating.set_result(gang)
            return self._attach(gang, num_slices, slice_type_name, client, weight)
        stype = slice_type(slice_type_name)
        alts = tuple(slice_type(n) for n in alternatives if slice_type(n) != stype)
        shapes = {(t.hosts, t.chips_per_host) for t in (stype, *alts)}
        if not same_type and len(shapes) > 1:
            raise InvalidRequestError(
                "a gang runs one SPMD program over equal slices, and slices of types "
                f"{', '.join(t.name for t in (stype, *alts))} differ in shape; ask for one "
                "type at a time (alternatives without mixed types)"
            )
        timeout_s = timeout_s or DEFAULT_ALLOCATE_TIMEOUT_S
        gang_id = f"g{next(self._ids)}"
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
        deadline = time.monotonic() + timeout_s
        for attempt in range(RESERVE_ATTEMPTS):
            slice_names = await self._admitted(request, deadline)
            gang = self.gangs.get(gang_id) or Gang(
                gang_id,
                client,
                stype,
                [self.scheduler.inventory[n] for n in slice_names],
                window=self._worker_window,
                spans=self.spans,
            )
            gang.slices = [self.scheduler.inventory[n] for n in slice_names]
            self.gangs[gang_id] = gang
            try:
                await gang.start(GANG_START_TIMEOUT_S, lost=self._lost_slice(gang))
                break
            except SliceLostError as exc:
                # Rolled back (no placement group of it is left): try again elsewhere, in
                # the request's old place in the queue.
                log.warning(
                    "gang %s: %s; retrying (%d/%d)", gang_id, exc, attempt + 1, RESERVE_ATTEMPTS
                )
                self.scheduler.release(gang_id)
                self.scheduler.cancel(gang_id)
                await self.refresh_inventory()
                if attempt + 1 == RESERVE_ATTEMPTS:
                    self.gangs.pop(gang_id, None)
                    raise
            except BaseException:
                self.gangs.pop(gang_id, None)
                self.scheduler.release(gang_id)
                self.scheduler.cancel(gang_id)
                self.decide()
                raise
        gang.priority = priority
        return gang, gang_id

    async def _admitted(self, request: GangRequest, deadline: float) -> tuple[str, ...]:
        """Queues the request and waits until the scheduler admits it."""
        rid = request.request_id
        self.scheduler.submit(request)
        waiter = self._waiters[rid] = asyncio.get_running_loop().create_future()
        self.decide()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), deadline - time.monotonic())
        except TimeoutError:
            why = self.scheduler.why_waiting(rid)
            raise DeadlineError(
                f"no {request.num_slices} x {request.slice_type.name} could be admitted in "
                f"time: {why}; wait longer (timeout) or release other gangs"
            ) from None
        finally:
            self._waiters.pop(rid, None)
            if not waiter.done():
                self.scheduler.cancel(rid)
            elif waiter.exception() is None and asyncio.current_task().cancelled():
                self.scheduler.release(rid)

    def _attach(
        self, gang: Gang, num_slices: int, slice_type_name: str, client: str, weight: float
    ) -> tuple[Gang, str]:
        stype = slice_type(slice_type_name)
        if (num_slices, stype) != (gang.shape.num_slices, gang.slice_type):
            raise InvalidRequestError(
                f"shared gang {gang.shared_name!r} is {gang.shape.num_slices} x "
                f"{gang.slice_type.name}; ask for the same to attach, or use another name"
            )
        attachment = f"a{next(self._attach_ids)}"
        gang.attachments[attachment] = (client, weight)
        gang.dispatcher.set_weight(attachment, weight)
        log.info(
            "gang %s: %s attached as %s with weight %g",
            gang.gang_id,
            client or "a client",
            attachment,
            weight,
        )
        return gang, f"{gang.gang_id}@{attachment}"

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
            if isinstance(decision, Admission):
                self._on_admission(decision)
            elif isinstance(decision, Preempt):
                gang = self.gangs.get(decision.victim_id)
                if gang is not None:
                    grace = max(0.0, decision.deadline - time.monotonic())
                    gang.state = GangState.PREEMPTING
                    gang.preempt_deadline = decision.deadline
                    gang.publish(
                        "preempt",
                        f"gang {gang.gang_id} must make room for "
                        f"{decision.for_request} within {grace:.0f} s: save what you "
                        "need and release (or yield) it",
                    )
            elif isinstance(decision, ForceRelease):
                gang = self.gangs.get(decision.victim_id)
                if gang is not None:
                    self._spawn(self._stop_preempted(gang, decision.for_request))
            elif isinstance(decision, Expire):
                waiter = self._waiters.get(decision.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_exception(DeadlineError(decision.reason))

    def _on_admission(self, admission: Admission) -> None:
        waiter = self._waiters.get(admission.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(admission.slices)
            return
        gang = self.gangs.get(admission.request_id)
        if gang is not None and gang.state is GangState.PREEMPTED:
            self._spawn(self._resume(gang, admission.slices))
            return
        self.scheduler.release(admission.request_id)  # its client gave up meanwhile
        self.scheduler.cancel(admission.request_id)

    async def _stop_preempted(self, gang: Gang, for_request: str) -> None:
        await gang.stop()
        gang.state = GangState.PREEMPTED
        self._on_released(gang, f"was preempted by {for_request}")
        gang.publish(
            "preempted",
            f"gang {gang.gang_id} was stopped for {for_request}; it is "
            "queued to resume on new workers (its arrays are gone)",
        )

    async def _resume(self, gang: Gang, slice_names: tuple[str, ...]) -> None:
        try:
            await gang.restart(
                [self.scheduler.inventory[n] for n in slice_names],
                GANG_START_TIMEOUT_S,
                lost=self._lost_slice(gang),
            )
        except Exception as exc:  # noqa: BLE001 - the gang fails; its owner hears of it
            gang.state, gang.failure = GangState.FAILED, f"could not resume: {exc}"
            gang.publish("failed", gang.failure)
            return
        gang.publish("resumed", f"gang {gang.gang_id} runs again on {', '.join(slice_names)}")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
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
        its last attachment does). With `requeue` the gang yields its slices but stays
        queued to resume, as a preempted gang does."""
        gang, attachment = self.resolve(gang_id, usable=False)
        if attachment and not detach_all:
            del gang.attachments[attachment]
            self._released[gang_id] = "was released (detached from the shared gang)"
            if gang.attachments:
                log.info("gang %s: attachment %s detached", gang.gang_id, attachment)
                return
        base = gang.gang_id
        if requeue:
            await gang.stop()
            gang.state = GangState.PREEMPTED
            self._on_released(gang, why)
            self.scheduler.release(base)  # a preempted gang goes back to its queue place
            self.decide()
            return
        del self.gangs[base]
        if gang.shared_name:
            self._shared.pop(gang.shared_name, None)
        await gang.stop()
        self._on_released(gang, why)
        self.scheduler.release(base)
        self.scheduler.cancel(base)  # released for good: not back to the queue
        self._released[base] = why
        while len(self._released) > 10_000:
            self._released.popitem(last=False)
        gang.publish("released", f"gang {base} {why}")
        self.decide()
