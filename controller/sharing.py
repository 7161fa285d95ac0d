"""Shared gangs (Pathways-style multi-tenancy): clients that allocate with the same
`shared` name attach to one gang and get their own attachment id, `g3-...@a2`, to use as
the gang id; their programs are interleaved in the gang's single order by weight.

Exactly one gang of a name is created at a time: clients that ask while it is being
created wait for it, and all of them get its error if the creation fails (the name is
then free again)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable

from controller.auth import current_identity
from controller.gang import Gang
from slicewise.common.errors import DeadlineError, InvalidRequestError
from slicewise.common.topology import slice_type

log = logging.getLogger(__name__)


class SharedGangs:
    """The shared gangs by name, and the attachments of clients to them. Names are per
    tenant (controller/auth.py): two tenants' "pool" are two gangs."""

    def __init__(self, is_live: Callable[[Gang], bool]) -> None:
        self._is_live = is_live  # whether a gang is still held (not released)
        # (tenant, name) -> the gang of that name (a future while it is being created)
        self._by_name: dict[tuple[str, str], asyncio.Future[Gang]] = {}
        self._attach_ids = itertools.count(1)

    async def get_or_create(self, name: str, create: Callable[[], Awaitable[Gang]]) -> Gang:
        """The caller's shared gang `name`: the one being created or up already, else a
        new one from `create()`."""
        key = (current_identity().tenant, name)
        while (existing := self._by_name.get(key)) is not None:
            gang = await asyncio.shield(existing)
            if self._is_live(gang):
                return gang
            await asyncio.sleep(0)  # released just now: its release frees the name
        creating = self._by_name[key] = asyncio.get_running_loop().create_future()
        try:
            gang = await create()
        except BaseException as exc:
            del self._by_name[key]
            creating.set_exception(
                exc
                if isinstance(exc, Exception)
                else DeadlineError(f"shared gang {name!r} was not created: its creator gave up")
            )
            creating.exception()  # retrieved: waiters get it; nobody else needs to
            raise
        gang.share(name)
        creating.set_result(gang)
        return gang

    def forget(self, gang: Gang) -> None:
        """Frees the name of a shared gang being released."""
        self._by_name.pop((gang.tenant, gang.shared_name), None)

    def attach(
        self, gang: Gang, num_slices: int, slice_type_name: str, client: str, weight: float
    ) -> str:
        """Attaches a client to a shared gang; returns the id it uses for the gang.

        Raises:
            InvalidRequestError: the client asked for another shape than the gang has.
        """
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
        return f"{gang.gang_id}@{attachment}"
