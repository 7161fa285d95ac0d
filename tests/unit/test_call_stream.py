"""The controller's side of a call stream (`Controller.stream_calls`): calls whose outputs
the client named, queued in order; a refused call refuses only itself and what reads its
outputs. Against an in-memory cluster (no processes)."""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from controller.arrays import ArrayState
from controller.core import MAX_REPEAT, Controller
from slicewise.common.arrays import ArraySpec
from slicewise.common.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    ProgramMismatchError,
)
from slicewise.common.mesh import MeshSpec
from slicewise.common.ops import ExecOp
from tests.unit.fake_cluster import Clock, FakeCluster

TIMEOUT = 60.0
V4 = "v5litepod-4"
MESH = MeshSpec.build({"slice": 1}, {"chip": 4})
SPEC = ArraySpec((8,), "int32")


@pytest.fixture(scope="module")
def plus_one() -> bytes:
    aval = jax.ShapeDtypeStruct(
        (8,), jnp.int32, sharding=NamedSharding(MESH.abstract(), PartitionSpec())
    )
    return bytes(jax.export.export(jax.jit(lambda a: a + 1), platforms=["cpu"])(aval).serialize())


def run(scenario: Any) -> Any:
    return asyncio.run(asyncio.wait_for(scenario, TIMEOUT))


async def gang_with(serialized: bytes) -> tuple[Controller, str, str, str]:
    """A controller with a one-slice gang, plus_one registered, and one ready array
    (its cluster is `controller.test_cluster`)."""
    cluster = FakeCluster(V4)
    controller = Controller(backend=cluster, clock=Clock(), simulated=True)
    controller.test_cluster = cluster  # type: ignore[attr-defined]
    await controller.refresh_inventory()
    _, gang_id = await controller.allocate(1, V4)
    program = await controller.register_program(gang_id, "plus_one", MESH, serialized)
    x = controller.arrays.new(gang_id, SPEC)
    x.settle(None)
    x.numbered = True
    return controller, gang_id, program.program_id, x.handle


def test_calls_get_the_handles_the_client_named_and_run_in_order(plus_one):
    async def scenario() -> tuple[list[Any], list[ArrayState], int]:
        controller, gang_id, program, x = await gang_with(plus_one)
        a, b = f"{gang_id}/cq7.1", f"{gang_id}/cq7.2"
        refused = controller.stream_calls(gang_id, [(program, [x], [a]), (program, [a], [b])])
        await controller.wait([a, b], 10)
        seqs = [controller.gangs[gang_id].dispatcher.completed]
        return refused, [controller.arrays.get(h).state for h in (a, b)], seqs[0]

    refused, states, completed = run(scenario())
    assert refused == []
    assert states == [ArrayState.READY, ArrayState.READY]
    assert completed >= 2  # loading the program may be an operation too


def test_a_refused_call_fails_its_outputs_and_what_reads_them_but_nothing_else(plus_one):
    async def scenario() -> tuple[list[Any], dict[str, Any]]:
        controller, gang_id, program, x = await gang_with(plus_one)
        bad, after, independent = (f"{gang_id}/cz.{n}" for n in (1, 2, 3))
        refused = controller.stream_calls(
            gang_id,
            [
                (program, [x, x], [bad]),  # two inputs for a program of one
                (program, [bad], [after]),  # reads the refused call's output
                (program, [x], [independent]),
            ],
        )
        await controller.wait([independent], 10)
        records = {h: controller.arrays.get(h) for h in (bad, after, independent)}
        return refused, {h: (r.state, r.error) for h, r in records.items()}

    refused, records = run(scenario())
    assert [(k, type(e)) for k, e in refused] == [
        (0, ProgramMismatchError),
        (1, FailedPreconditionError),
    ]
    assert "takes 1 input(s)" in str(refused[0][1]) and "its call was refused" in str(refused[1][1])
    states = list(records.values())
    assert states[0][0] is ArrayState.FAILED and "takes 1 input(s)" in states[0][1]
    assert states[1][0] is ArrayState.FAILED and "its call was refused" in states[1][1]
    assert states[2] == (ArrayState.READY, "")


@pytest.mark.parametrize(
    "outputs, why, failed",
    [
        (["{other}/cq.1"], "not one a client may choose", 0),
        (["{gang}/a1"], "not one a client may choose", 0),
        (["{gang}/cQ.1"], "not one a client may choose", 0),
        (["{x}"], "not one a client may choose", 0),
        (["{gang}/cq.9"], "already used", 0),  # named by the first call
        # Names it may give, but too many: recorded as failed, to explain a fetch of them.
        (["{gang}/cq.1", "{gang}/cq.2"], "names 2 output handle(s)", 2),
    ],
)
def test_output_handles_a_client_may_not_name_are_refused(plus_one, outputs, why, failed):
    async def scenario() -> tuple[list[Any], int]:
        controller, gang_id, program, x = await gang_with(plus_one)
        controller.stream_calls(gang_id, [(program, [x], [f"{gang_id}/cq.9"])])
        before = len(controller.arrays)
        names = [o.format(gang=gang_id, other="g99-aaaaaaaaaaaaa", x=x) for o in outputs]
        refused = controller.stream_calls(gang_id, [(program, [x], names)])
        return refused, len(controller.arrays) - before

    refused, added = run(scenario())
    assert len(refused) == 1 and isinstance(refused[0][1], InvalidRequestError)
    assert why in str(refused[0][1])
    assert added == failed  # nothing recorded under a name the client may not give


def test_stream_deletes_skip_handles_already_gone(plus_one):
    async def scenario() -> tuple[int, int, int]:
        controller, gang_id, program, x = await gang_with(plus_one)
        a = f"{gang_id}/cd.1"
        controller.stream_calls(gang_id, [(program, [x], [a])])
        first = controller.delete_quietly([a, a, f"{gang_id}/cd.2"])
        again = controller.delete_quietly([a])
        return first, again, len(controller.arrays)

    assert run(scenario()) == (1, 0, 1)  # only x is left


def test_a_wait_naming_a_batch_still_on_its_way_waits_for_it(plus_one):
    """A client's wait may reach the controller before the stream message with the call
    it waits for: it waits for that batch to be queued, then for the array."""

    async def scenario() -> tuple[bool, bool, list[ArrayState], int]:
        controller, gang_id, program, x = await gang_with(plus_one)
        prefix = f"{gang_id}/cw"
        a = f"{prefix}.1"
        waiter = asyncio.create_task(controller.after_stream([a], 1))
        await asyncio.sleep(0)  # the waiter runs up to its wait (an ordering, not a delay)
        early = waiter.done()
        progress = controller.stream_opened(prefix)
        controller.stream_calls(gang_id, [(program, [x], [a])])
        progress.advance(1)
        await asyncio.wait_for(waiter, TIMEOUT)
        states = [r.state for r in await controller.wait([a], TIMEOUT)]
        controller.stream_closed(prefix)
        return early, waiter.done(), states, len(controller._streams)

    early, done, states, streams = run(scenario())
    assert not early and done
    assert states == [ArrayState.READY]
    assert streams == 0  # nothing kept of the stream once it ended


def test_a_call_of_several_runs_is_one_operation_with_only_the_last_outputs(plus_one):
    async def scenario() -> tuple[list[Any], list[Any], list[Any], int]:
        controller, gang_id, program, x = await gang_with(plus_one)
        last = f"{gang_id}/cr.1"
        before = len(controller.arrays)
        refused = controller.stream_calls(gang_id, [(program, [x], [last], 128)])
        await controller.wait([last], TIMEOUT)
        sent = [
            op
            for channel in controller.test_cluster.channels
            for op in channel.sent
            if isinstance(op, ExecOp)
        ]
        return refused, sent, [controller.arrays.get(last).state], len(controller.arrays) - before

    refused, sent, states, added = run(scenario())
    assert refused == [] and states == [ArrayState.READY] and added == 1
    # One operation per worker, naming the runs and only the last run's outputs.
    assert [(op.repeat, op.outputs) for op in sent] == [(128, sent[0].outputs)] * len(sent)
    assert len({op.seq for op in sent}) == 1 and sent[0].outputs[0].endswith("/cr.1")


@pytest.mark.parametrize(
    "repeat, why",
    [
        (MAX_REPEAT + 1, "at most 1,000,000 times"),
        (2, "cannot repeat: each run takes the previous run's outputs"),
    ],
)
def test_runs_a_program_cannot_make_are_refused(plus_one, repeat, why):
    async def scenario() -> tuple[list[Any], Any]:
        controller, gang_id, program, x = await gang_with(plus_one)
        if repeat == 2:  # a program whose output is not what it takes
            aval = jax.ShapeDtypeStruct(
                (8,), jnp.int32, sharding=NamedSharding(MESH.abstract(), PartitionSpec())
            )
            widen = jax.export.export(jax.jit(lambda a: a.astype(jnp.float32)), platforms=["cpu"])(
                aval
            )
            registered = await controller.register_program(
                gang_id, "widen", MESH, bytes(widen.serialize())
            )
            program = registered.program_id
        out = f"{gang_id}/cr.1"
        refused = controller.stream_calls(gang_id, [(program, [x], [out], repeat)])
        return refused, controller.arrays.get(out)

    refused, record = run(scenario())
    assert len(refused) == 1 and isinstance(refused[0][1], InvalidRequestError)
    assert why in str(refused[0][1])
    assert record.state is ArrayState.FAILED and why in record.error


def test_a_wait_hurries_the_calls_it_waits_for_and_no_other(plus_one):
    """The workers hold completions while their queue is deep; a wait for an output asks
    each of them to report the call that makes it as soon as it completes."""

    async def scenario() -> tuple[list[int], list[int], int]:
        controller, gang_id, program, x = await gang_with(plus_one)
        channel = controller.test_cluster.channels[0]  # type: ignore[attr-defined]
        channel.hold = (ExecOp,)
        a, b = f"{gang_id}/cq7.1", f"{gang_id}/cq7.2"
        controller.stream_calls(gang_id, [(program, [x], [a]), (program, [a], [b])])
        await until(lambda: sum(isinstance(op, ExecOp) for op in channel.sent) == 2)
        waited = await controller.wait([a], 0.001)  # times out: the calls are held
        state = waited[0].state
        calls = [op.seq for op in channel.sent if isinstance(op, ExecOp)]
        hurried = list(channel.hurried)
        channel.complete_held()
        await controller.wait([a, b], 10)
        return calls, hurried, state

    calls, hurried, state = run(scenario())
    assert hurried == [calls[0]]  # a's call, not b's
    assert state is ArrayState.PENDING


async def until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.001)
