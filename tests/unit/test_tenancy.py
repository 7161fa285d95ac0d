"""Tenants: what one makes, another cannot see; what it cannot see answers exactly as what
does not exist; admins see all. The rules on the controller's tables (arrays, programs,
gangs by id); the same on a real controller with tokens: tests/integration/test_auth.py."""

from __future__ import annotations

import contextvars

import pytest

from controller.arrays import ArrayTable
from controller.auth import LOCAL, Identity, current_identity, may_see, run_as
from controller.programs import ProgramRegistry, load_program
from slicewise.common.arrays import ArraySpec
from slicewise.common.errors import NotFoundError
from tests.unit.test_arrays_programs import MESH, export

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
