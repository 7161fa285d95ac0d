"""The controller's record of every remote array: its handle, shape, dtype and state.

The data itself lives on the workers; the controller keeps what it needs to validate
calls at once (before anything reaches a worker) and to answer `wait` and `fetch`.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slicewise.common.arrays import ArraySpec
from slicewise.common.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
)
from slicewise.common.mesh import ShardingSpec

# How many deleted handles of held gangs, and how many released gangs, to remember for a
# precise error message. A released gang's handles are remembered through its id, not one
# by one: what a gang's calls leave here goes with the gang.
_FORGOTTEN_LIMIT = 100_000
_GONE_GANGS = 10_000
# A handle a client names itself (a call stream's outputs): "<gang id>/c<tag>.<n>".
_CLIENT_HANDLE = re.compile(r"[a-z0-9-]{1,40}/c[a-z0-9]{1,32}\.[0-9]{1,18}")
_TRAILING_NUMBER = re.compile(r"[0-9]+$")


class ArrayState(enum.Enum):
    PENDING = 1
    READY = 2
    FAILED = 3


@dataclass
class ArrayRecord:
    """One remote array as the controller knows it."""

    handle: str
    gang_id: str
    spec: ArraySpec
    sharding: ShardingSpec | None = None
    state: ArrayState = ArrayState.PENDING
    error: str = ""
    # Its producing operation has its place in the gang's order, so later operations
    # that read it may be numbered.
    numbered: bool = False
    # The client whose call makes it: that client's later operations come after that
    # call in the gang's order anyway (one client's operations keep their order), so
    # they are queued with no readiness check on it (core.Controller._submit).
    made_by: str | None = None
    # Operations queued to read it and not numbered yet (dispatch.Ticket): a delete must
    # come after them, even when another client of a shared gang queued them.
    readers: list[Any] = field(default_factory=list, repr=False)
    # Until it settles: asks the workers to report the operation that makes it as soon
    # as it completes (Dispatcher.hurry), for a wait.
    hurry: Callable[[], None] | None = field(default=None, repr=False)
    # Set once settled; made only when somebody waits (`settled`): most arrays a stream
    # of calls makes are settled and deleted with nobody waiting on them, and an
    # asyncio.Event per call cost the controller a few microseconds per call.
    _settled: asyncio.Event | None = field(default=None, repr=False)
    _is_settled: bool = field(default=False, repr=False)

    @property
    def settled(self) -> asyncio.Event:
        """Set once the array is settled (its producing operation completed or failed)."""
        if self._settled is None:
            self._settled = asyncio.Event()
            if self._is_settled:
                self._settled.set()
        return self._settled

    def settle(self, error: str | None) -> None:
        self.hurry = None
        if self.state is ArrayState.PENDING:
            self.state = ArrayState.FAILED if error else ArrayState.READY
            self.error = error or ""
        self._is_settled = True
        if self._settled is not None:
            self._settled.set()

    def require_usable(self) -> None:
        if self.state is ArrayState.FAILED:
            raise FailedPreconditionError(f"array {self.handle} is unavailable: {self.error}")


class ArrayTable:
    """Handle -> record, and a memory of recently forgotten handles for error messages."""

    def __init__(self) -> None:
        self._records: dict[str, ArrayRecord] = {}
        # gang id -> the handles of its arrays deleted while it is held (insertion order:
        # a handle's number), at most _FORGOTTEN_LIMIT in all, oldest forgotten first.
        self._deleted: dict[str, dict[str, None]] = {}
        self._num_deleted = 0
        # gang id -> why its arrays went (it "was released", ...), for its handles.
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._ids = itertools.count(1)
        # Whether the caller may see the arrays of a gang (by id); the controller sets it
        # to its tenants' rule (controller/auth.py). Another tenant's arrays answer as
        # unknown ones do.
        self.visible: Callable[[str], bool] = lambda gang_id: True

    def __len__(self) -> int:
        return len(self._records)

    @property
    def remembered(self) -> int:
        """How many forgotten handles and gangs are remembered for error messages."""
        return self._num_deleted + len(self._gone)

    def new(
        self,
        gang_id: str,
        spec: ArraySpec,
        sharding: ShardingSpec | None = None,
        *,
        handle: str = "",
    ) -> ArrayRecord:
        """A new record, under `handle` when a client chose it (see `check_new`), else
        under "<gang>/a<n>"."""
        record = ArrayRecord(handle or f"{gang_id}/a{next(self._ids)}", gang_id, spec, sharding)
        self._records[record.handle] = record
        return record

    def check_new(self, gang_id: str, handles: Sequence[str], count: int) -> None:
        """Raises InvalidRequestError unless `handles` are `count` handles a client may
        give new outputs on gang `gang_id`: each "<gang_id>/c<tag>.<n>", none in use or
        used before on the gang (as far as the gang's deleted handles are remembered)."""
        if len(handles) != count:
            raise InvalidRequestError(
                f"the call names {len(handles)} output handle(s) for a program with {count} "
                "output(s); name one per output"
            )
        deleted = self._deleted.get(gang_id, {})
        for h in handles:
            if not _CLIENT_HANDLE.fullmatch(h) or h.partition("/")[0] != gang_id:
                raise InvalidRequestError(
                    f"output handle {h[:100]!r} is not one a client may choose on gang "
                    f'{gang_id}: write it "{gang_id}/c<tag>.<n>" (tag: 1-32 lowercase letters '
                    "and digits; n: a number)"
                )
            if h in self._records or h in deleted:
                raise InvalidRequestError(
                    f"output handle {h} is already used on gang {gang_id}; name each new "
                    "output with a handle never used before"
                )
        if len(set(handles)) != len(handles):
            raise InvalidRequestError(
                f"the call names the same output handle twice ({list(handles)}); name each "
                "output with a handle of its own"
            )

    def on_gang(self, handle: str, gang_id: str) -> ArrayRecord:
        """The record for `handle`, an array of gang `gang_id` that the caller has
        resolved (and so may see): its tenant is not asked again for every input of
        every call. Raises as `get` does, and FailedPreconditionError for an array of
        another gang."""
        record = self._records.get(handle)
        if record is None or record.gang_id != gang_id:
            record = self.get(handle)  # NotFoundError, as anywhere else
        if record.gang_id != gang_id:
            raise FailedPreconditionError(
                f"array {handle} lives on gang {record.gang_id}, not on gang {gang_id}; "
                "fetch it and put it on this gang"
            )
        return record

    def find(self, handle: str) -> ArrayRecord | None:
        """The record for `handle`, or None (never known, deleted, gone, or another
        tenant's)."""
        record = self._records.get(handle)
        return record if record is not None and self.visible(record.gang_id) else None

    def get(self, handle: str) -> ArrayRecord:
        """The record for `handle`.

        Raises:
            NotFoundError: never known, deleted, or its gang was released.
        """
        record = self._records.get(handle)
        if record is not None and self.visible(record.gang_id):
            return record
        why = self._why_forgotten(handle) if record is None and self.visible(handle) else None
        if why is not None:
            raise NotFoundError(f"array {handle} {why}")
        raise NotFoundError(f"array handle {handle!r} is unknown to this controller")

    def _why_forgotten(self, handle: str) -> str | None:
        gang_id = handle.partition("/")[0]
        if handle in self._deleted.get(gang_id, ()):
            return "was deleted"
        why = self._gone.get(gang_id)
        if why is not None and handle.startswith((f"{gang_id}/a", f"{gang_id}/c")):
            return f"belonged to gang {gang_id}, which {why}"
        return None

    def delete(self, handle: str) -> ArrayRecord:
        return self.remove(self.get(handle))

    def remove(self, record: ArrayRecord) -> ArrayRecord:
        """Deletes a record the caller has already looked up (`get`)."""
        handle = record.handle
        del self._records[handle]
        self._deleted.setdefault(record.gang_id, {})[handle] = None
        self._num_deleted += 1
        while self._num_deleted > _FORGOTTEN_LIMIT:
            self._forget_oldest_deleted()
        return record

    def _forget_oldest_deleted(self) -> None:
        # Deletes come in handle order within a gang, mostly: the gang with the oldest
        # remembered handle goes first, one handle at a time.
        if len(self._deleted) == 1:  # one gang (the usual case): no handle to parse
            oldest = next(iter(self._deleted))
        else:
            oldest = min(self._deleted, key=lambda g: _number(next(iter(self._deleted[g]))))
        handles = self._deleted[oldest]
        del handles[next(iter(handles))]
        self._num_deleted -= 1
        if not handles:
            del self._deleted[oldest]

    def drop_gang(self, gang_id: str, why: str) -> int:
        """Forgets every array of a gang that stopped (`why`: "was released", ...); its
        handles are remembered as the gang's from now on."""
        dropped = [h for h, r in self._records.items() if r.gang_id == gang_id]
        for handle in dropped:
            self._records.pop(handle).settle(f"gang {gang_id} {why}")
        self._num_deleted -= len(self._deleted.pop(gang_id, {}))
        self._gone[gang_id] = why
        self._gone.move_to_end(gang_id)
        while len(self._gone) > _GONE_GANGS:
            self._gone.popitem(last=False)
        return len(dropped)

    def nbytes(self, gang_ids: set[str]) -> int:
        """The bytes of the live arrays of these gangs (logical sizes, one copy each)."""
        return sum(r.spec.nbytes for r in self._records.values() if r.gang_id in gang_ids)

    def count(self, gang_id: str) -> int:
        return sum(1 for r in self._records.values() if r.gang_id == gang_id)


def _number(handle: str) -> int:
    """N of a handle "g3/aN" or "g3/c<tag>.N": handles are numbered in the order they
    are made (a client's own in its own order)."""
    digits = _TRAILING_NUMBER.search(handle)
    return int(digits.group()) if digits else 0
