"""Tenants: what one makes, another cannot see; what it cannot see answers exactly as what
does not exist; admins see all. The rules on the controller's tables (arrays, programs,
gangs by id); the same on a real controller with tokens: tests/integration/test_auth.py."""

from __future__ import annotations

import asyncio
import contextvars
import json

import pytest

from controller.arrays import ArrayTable
from controller.auth import (
    LOCAL,
    AuthConfigError,
    Caps,
    Identity,
    TokenTable,
    add_token,
    current_identity,
    may_see,
    run_as,
)
from controller.programs import ProgramRegistry, load_program
from slicewise.common.arrays import ArraySpec
from slicewise.common.errors import CapacityError, NotFoundError
from tests.unit.fake_cluster import FakeCluster
from tests.unit.test_arrays_programs import MESH, export
from tests.unit.test_gang_manager import V4, manager_for

ALICE, BOB, OPS = Identity("alice"), Identity("bob"), Identity("ops", "admin")


def as_(identity, fn, *args):
    """`fn(*args)` run as `identity`, in a context of its own (as an RPC handler is)."""
    context = contextvars.copy_context()
    context.run(run_as, identity)
    return context.run(fn, *args)


def test_identity_is_per_call_context_and_local_is_an_admin():
    assert current_identity() == LOCAL and LOCAL.admin
    assert as_(ALICE, current_identity) == ALICE
    assert current_identity() == LOCAL  # the other context is untouched
    assert as_(ALICE, may_see, "alice") and not as_(ALICE, may_see, "bob")
    assert as_(OPS, may_see, "alice") and may_see("anyone")


def test_another_tenants_array_is_as_unknown_as_one_never_made():
    table = ArrayTable()
    owners = {"g1": "alice", "g2": "bob"}
    table.visible = lambda gang_id: may_see(owners[gang_id.partition("/")[0]])
    mine = table.new("g1", ArraySpec.of((2,), "float32"))
    assert as_(ALICE, table.get, mine.handle) is mine
    assert as_(OPS, table.get, mine.handle) is mine
    with pytest.raises(NotFoundError) as seen:
        as_(BOB, table.get, mine.handle)
    with pytest.raises(NotFoundError) as never:
        as_(BOB, table.get, "g1/a999")
    assert str(seen.value) == str(never.value).replace("g1/a999", mine.handle)
    as_(ALICE, table.delete, mine.handle)
    # That it was deleted is alice's business too.
    with pytest.raises(NotFoundError, match="was deleted"):
        as_(ALICE, table.get, mine.handle)
    with pytest.raises(NotFoundError, match="is unknown to this controller"):
        as_(BOB, table.get, mine.handle)


def test_a_program_is_its_registrants_and_admins():
    registry = ProgramRegistry()
    program = load_program(export(MESH), "scale", MESH)
    as_(ALICE, registry.add, program)
    assert as_(ALICE, registry.get, program.program_id) is program
    assert as_(OPS, registry.get, program.program_id) is program
    with pytest.raises(NotFoundError, match="is not registered with this controller"):
        as_(BOB, registry.get, program.program_id)
    # Bob registering the same bytes makes it his as well (content-addressed: one copy).
    assert as_(BOB, registry.add, program) is program
    assert as_(BOB, registry.get, program.program_id) is program


# -- caps ------------------------------------------------------------------------------


def test_caps_come_from_the_tokens_file(tmp_path):
    path = tmp_path / "tokens"
    add_token(path, "alice")
    line = {"tenant": "alice", "sha256": "a" * 64, "caps": {"max_chips": 8, "max_bytes": 1e6}}
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")
    table = TokenTable.load(path)
    assert table.caps == {"alice": Caps(max_chips=8, max_bytes=1_000_000)}
    for caps, message in (
        ({"max_gpus": 1}, "'caps' must be an object with some of"),
        ({"max_chips": -1}, "caps.max_chips must be a number >= 0"),
        ({"max_chips": float("inf")}, "caps.max_chips must be a number >= 0"),
        ({"max_chips": True}, "caps.max_chips must be a number >= 0"),
    ):
        path.write_text(json.dumps({**line, "caps": caps}) + "\n")
        with pytest.raises(AuthConfigError, match=message):
            TokenTable.load(path)


def test_a_tenant_past_its_caps_gets_resource_exhausted_saying_what_is_in_use():
    async def scenario():
        cluster = FakeCluster(V4, V4, V4)
        manager = await manager_for(cluster)
        manager.caps = {"alice": Caps(max_chips=8, max_priority=2, max_queued=1)}
        run_as(ALICE)
        first, _ = await manager.allocate(1, V4)
        errors = {}
        for name, kwargs in (("chips", {"num_slices": 2}), ("priority", {"priority": 3})):
            try:
                await manager.allocate(kwargs.pop("num_slices", 1), V4, **kwargs)
            except CapacityError as exc:
                errors[name] = str(exc)
        second, _ = await manager.allocate(1, V4)  # 8 chips: at the cap, not past it
        # Bob has no caps: the third slice is his for the asking.
        context = contextvars.copy_context()
        context.run(run_as, BOB)
        third, _ = await context.run(asyncio.create_task, manager.allocate(1, V4))
        return errors, (first, second, third)

    errors, gangs = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert errors["chips"] == (
        "tenant 'alice' holds 4 chips and is allocating 0 more, of its cap of 8; this asks "
        "for 8: release a gang first"
    )
    assert errors["priority"] == "tenant 'alice' may ask for priority up to 2, not 3"
    assert [g.tenant for g in gangs] == ["alice", "alice", "bob"]


def test_a_tenant_may_have_only_so_many_allocations_waiting():
    async def scenario():
        cluster = FakeCluster(V4)
        manager = await manager_for(cluster)
        manager.caps = {"alice": Caps(max_queued=1)}
        held, _ = await manager.allocate(1, V4)  # the local admin holds the only slice
        run_as(ALICE)
        waiting = asyncio.create_task(manager.allocate(1, V4))
        while not manager.scheduler.queued():  # queued behind the held slice
            await asyncio.sleep(0.001)
        with pytest.raises(CapacityError) as refused:
            await manager.allocate(1, V4)
        waiting.cancel()
        return str(refused.value)

    message = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert message == (
        "tenant 'alice' has 1 allocation(s) under way, its cap (max_queued 1); wait for one "
        "to finish or give up"
    )
