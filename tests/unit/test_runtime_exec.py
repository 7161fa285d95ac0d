"""The worker runtime's ExecOp on a real mesh of 8 CPU devices in one process (tier b):
a call of several runs (a chain) launches the program that many times, each run on the
previous run's outputs, keeps only the last run's outputs and reports their values."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from slicewise.common import heap
from slicewise.common.mesh import GangShape, MeshSpec, ShardingSpec
from slicewise.common.ops import ExecOp, LoadOp
from worker.runtime import JaxRuntime

GANG = GangShape(2, 1, 4)
MESH = MeshSpec.build({"slice": 2}, {"chip": 4})
SPLIT = ShardingSpec(MESH, (("slice", "chip"),))


def exported(fn, dtype=jnp.float32) -> bytes:
    aval = jax.ShapeDtypeStruct(
        (8,), dtype, sharding=NamedSharding(MESH.abstract(), PartitionSpec(("slice", "chip")))
    )
    return bytes(jax.export.export(jax.jit(fn), platforms=["cpu"])(aval).serialize())


@pytest.fixture
def runtime():
    rt = JaxRuntime(GANG, 0)
    # What initialize() finds in a one-process "gang": every device is local.
    rt._devices = sorted(jax.devices(), key=lambda d: d.id)
    rt.buffers.put("x", jax.device_put(np.arange(8, dtype=np.float32), rt.named_sharding(SPLIT)))
    yield rt
    gc.unfreeze()  # a first call froze this test process's heap (slicewise/common/heap.py)


def test_a_call_of_n_runs_gives_the_nth_run_and_keeps_nothing_else(runtime):
    runtime.apply(LoadOp(1, "p", exported(lambda a: a * 2 + 1), MESH, "double_plus_one"))
    pending = runtime.apply(ExecOp(2, "p", ("x",), ("y",), report=(0,), repeat=5))
    (value,) = pending.wait()
    want = np.arange(8, dtype=np.float32)
    for _ in range(5):
        want = want * 2 + 1
    np.testing.assert_array_equal(np.asarray(runtime.buffers.get("y")), want)
    np.testing.assert_array_equal(value, want[:1])  # process 0's first shard
    assert len(runtime.buffers) == 2  # x and y: no run before the last is kept
    # The process's first compiled program settled its heap, whichever test ran first.
    assert "the first program compiled" in heap._settled


def test_a_run_that_fails_is_named(runtime):
    # A program whose output cannot be its input: the second run cannot start.
    runtime.apply(LoadOp(1, "p", exported(lambda a: a[:4]), MESH, "halve"))
    with pytest.raises(RuntimeError, match="run 2 of 3 failed"):
        runtime.apply(ExecOp(2, "p", ("x",), ("y",), repeat=3))
    assert len(runtime.buffers) == 1  # x only


def test_an_input_is_moved_only_when_its_layout_is_not_the_programs(runtime):
    runtime.apply(LoadOp(1, "p", exported(lambda a: a + 1), MESH, "plus_one"))
    program = runtime._programs["p"]
    x = runtime.buffers.get("x")  # split over every device, as the program takes it
    assert JaxRuntime._conform(program, [x])[0] is x
    replicated = jax.device_put(x, NamedSharding(x.sharding.mesh, PartitionSpec()))
    (moved,) = JaxRuntime._conform(program, [replicated])
    assert moved is not replicated
    assert moved.sharding.is_equivalent_to(program.in_shardings[0], 1)
    np.testing.assert_array_equal(np.asarray(moved), np.arange(8, dtype=np.float32))
    # Run through an ExecOp, the replicated input gives the program's answer.
    runtime.buffers.put("r", replicated)
    runtime.apply(ExecOp(2, "p", ("r",), ("y",))).wait()
    np.testing.assert_array_equal(np.asarray(runtime.buffers.get("y")), np.arange(8) + 1.0)


def split_aval():
    return jax.ShapeDtypeStruct(
        (8,), jnp.float32, sharding=NamedSharding(MESH.abstract(), PartitionSpec(("slice", "chip")))
    )


@pytest.mark.parametrize(
    "fn, args, flat_in, want",
    [
        (lambda a: a + 1, lambda a: (a,), True, lambda x: [x + 1]),
        (lambda a: (a, a * 2), lambda a: (a,), True, lambda x: [x, x * 2]),
        # Leaves of a dict come in key order: "d" before "s".
        (lambda a: {"s": a * 3, "d": a - 1}, lambda a: (a,), True, lambda x: [x - 1, x * 3]),
        (lambda p: p["w"] * 2, lambda a: ({"w": a},), False, lambda x: [x * 2]),
    ],
    ids=["one-array", "tuple", "dict-out", "dict-in"],
)
def test_programs_of_any_argument_and_result_tree_give_their_outputs_in_order(
    runtime, fn, args, flat_in, want
):
    blob = bytes(jax.export.export(jax.jit(fn), platforms=["cpu"])(*args(split_aval())).serialize())
    runtime.apply(LoadOp(1, "p", blob, MESH, "tree"))
    assert runtime._programs["p"].flat_in is flat_in
    for seq, out in ((2, "y"), (3, "z")):  # the first call, then the usual path
        wanted = want(np.arange(8, dtype=np.float32))
        handles = tuple(f"{out}{i}" for i in range(len(wanted)))
        runtime.apply(ExecOp(seq, "p", ("x",), handles)).wait()
        for handle, value in zip(handles, wanted, strict=True):
            np.testing.assert_array_equal(np.asarray(runtime.buffers.get(handle)), value)
    # Compiled when loaded; taking its arrays as they come, later calls go to it directly.
    assert runtime._programs["p"].compiled is not None
    assert (runtime._programs["p"].direct is not None) is flat_in
