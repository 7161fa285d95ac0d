"""Gang admission: which queued request gets which whole slices. Pure logic, no I/O.

The controller feeds it the slice inventory and the requests, asks for decisions, and
carries them out (Ray placement groups, workers). Admission is all-or-nothing: a request
gets every slice it asked for at once, or none. Requests of one slice type are served
first come, first served, so a large request is never starved by smaller later ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from controller.errors import NotFoundError
from controller.inventory import Slice, check_can_ever_fit
from controller.topology import SliceType


@dataclass
class GangRequest:
    """A request for `num_slices` whole slices of one type."""

    request_id: str
    num_slices: int
    slice_type: SliceType
    client: str = ""
    submitted_at: float = 0.0


@dataclass(frozen=True)
class Admission:
    """A decision: `request_id` now holds `slices`."""

    request_id: str
    slices: tuple[str, ...]


@dataclass
class Scheduler:
    """FIFO-per-slice-type, all-or-nothing gang admission over an inventory of slices."""

    clock: Callable[[], float] = time.monotonic
    _inventory: dict[str, Slice] = field(default_factory=dict)
    _holder: dict[str, str] = field(default_factory=dict)  # slice name -> request id
    _queue: list[GangRequest] = field(default_factory=list)

    @property
    def inventory(self) -> Mapping[str, Slice]:
        return self._inventory

    def holder(self, slice_name: str) -> str | None:
        return self._holder.get(slice_name)

    def held_by(self, request_id: str) -> tuple[str, ...]:
        return tuple(sorted(s for s, h in self._holder.items() if h == request_id))

    def queued(self) -> list[GangRequest]:
        return list(self._queue)

    def set_inventory(self, slices: Mapping[str, Slice]) -> None:
        """Replaces the inventory; holdings of slices that vanished stay recorded until
        released, so that nothing is handed out twice when a host comes back."""
        self._inventory = dict(slices)

    def submit(self, request: GangRequest) -> int:
        """Queues a request; returns its position (0 = next).

        Raises:
            CapacityError: the request could never fit this cluster.
        """
        check_can_ever_fit(self._inventory, request.num_slices, request.slice_type)
        if not request.submitted_at:
            request.submitted_at = self.clock()
        self._queue.append(request)
        return self.position(request.request_id)

    def cancel(self, request_id: str) -> None:
        self._queue = [r for r in self._queue if r.request_id != request_id]

    def position(self, request_id: str) -> int:
        for i, r in enumerate(self._queue):
            if r.request_id == request_id:
                return i
        raise NotFoundError(f"request {request_id} is not queued")

    def free_slices(self, stype: SliceType) -> list[str]:
        return sorted(
            name for name, s in self._inventory.items()
            if s.type == stype and s.intact and name not in self._holder
        )

    def schedule(self) -> list[Admission]:
        """Admits every queued request that can be, in order; returns the decisions."""
        admitted: list[Admission] = []
        blocked: set[str] = set()
        for request in list(self._queue):
            if request.slice_type.name in blocked:
                continue
            free = self.free_slices(request.slice_type)
            if len(free) < request.num_slices:
                blocked.add(request.slice_type.name)
                continue
            chosen = tuple(free[: request.num_slices])
            for name in chosen:
                self._holder[name] = request.request_id
            self._queue.remove(request)
            admitted.append(Admission(request.request_id, chosen))
        return admitted

    def release(self, request_id: str) -> tuple[str, ...]:
        """Frees every slice the request holds; returns their names."""
        freed = self.held_by(request_id)
        for name in freed:
            del self._holder[name]
        return freed

    def why_waiting(self, request_id: str) -> str:
        """A sentence for a person: why this request is not admitted yet."""
        request = next((r for r in self._queue if r.request_id == request_id), None)
        if request is None:
            return "not queued"
        ahead = [r for r in self._queue[: self.position(request_id)]
                 if r.slice_type == request.slice_type]
        free = len(self.free_slices(request.slice_type))
        holders = sorted({h for s, h in self._holder.items()
                          if self._inventory.get(s) and self._inventory[s].type == request.slice_type})
        text = (f"needs {request.num_slices} free {request.slice_type.name} slice(s), "
                f"{free} free now")
        if ahead:
            text += f"; {len(ahead)} earlier request(s) for {request.slice_type.name} go first"
        if holders:
            text += f"; held by {', '.join(holders)}"
        return text
