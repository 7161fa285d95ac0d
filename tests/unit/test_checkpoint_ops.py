"""The worker's checkpoint operations (SaveOp, CloseCheckpointsOp, RestoreOp) applied by
the runtime to its buffer table, in one process with 8 CPU devices (tier b), with real
orbax writes: what lands in storage, what comes back, and what a restore refuses."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from slicewise.common.checkpoints import COMMIT_FILE
from slicewise.common.mesh import GangShape, MeshSpec, ShardingSpec
from slicewise.common.ops import CloseCheckpointsOp, RestoreOp, SaveOp
from worker.checkpoint import UncommittedStepError
from worker.runtime import JaxRuntime

GANG = GangShape(2, 1, 4)
MESH = MeshSpec.build({"data": 2}, {"fsdp": 4})
SHARDINGS = (ShardingSpec(MESH, (("fsdp",), ())), ShardingSpec(MESH, ()))
META = {"program": "lm", "seed": 3, "global_batch_size": 8, "step": 10}
EXPECT = tuple(META.items())


@pytest.fixture
def runtime():
    rt = JaxRuntime(GANG, 0)
    # What initialize() finds in a one-process "gang": every device is local.
    rt._devices = sorted(jax.devices(), key=lambda d: d.id)
    return rt


def restore_op(seq, directory, step, expect=EXPECT):
    return RestoreOp(
        seq,
        directory,
        step,
        ("r0", "r1"),
        ((8, 16), ()),
        ("float32", "int32"),
        SHARDINGS,
        expect,
        "t",
    )


def test_save_commits_and_restore_brings_the_arrays_back_bit_for_bit(runtime, tmp_path):
    directory = str(tmp_path / "ckpt")
    values = [np.random.default_rng(0).standard_normal((8, 16), np.float32), np.int32(10)]
    for handle, value, sharding in zip(("s0", "s1"), values, SHARDINGS, strict=True):
        runtime.buffers.put(handle, jax.device_put(value, runtime.named_sharding(sharding)))

    runtime.apply(SaveOp(1, directory, 10, ("s0", "s1"), json.dumps(META), "t"))
    runtime.buffers.delete(("s0", "s1"))  # copied out already: the next step may drop them
    runtime.apply(CloseCheckpointsOp(2, directory, "t"))  # waits for the commit
    assert (tmp_path / "ckpt" / "10" / COMMIT_FILE).is_file()
    assert runtime.stats()["checkpoint_dirs"] == 0

    runtime.apply(restore_op(3, directory, 10))
    for handle, want, sharding in zip(("r0", "r1"), values, SHARDINGS, strict=True):
        got = runtime.buffers.get(handle)
        assert got.sharding == runtime.named_sharding(sharding)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)
        )


def test_restore_refuses_another_data_position_and_uncommitted_steps(runtime, tmp_path):
    directory = str(tmp_path / "ckpt")
    state = jax.device_put(np.zeros((8, 16), np.float32), runtime.named_sharding(SHARDINGS[0]))
    count = jax.device_put(np.int32(10), runtime.named_sharding(SHARDINGS[1]))
    runtime.buffers.put("s0", state)
    runtime.buffers.put("s1", count)
    runtime.apply(SaveOp(1, directory, 10, ("s0", "s1"), json.dumps(META), "t"))
    runtime.apply(CloseCheckpointsOp(2, directory, "t"))

    other_seed = (*EXPECT, ("seed", 4))
    op = restore_op(3, directory, 10, expect=other_seed)
    with pytest.raises(ValueError, match="seed is 3 there, 4 here"):
        runtime.apply(op)
    runtime.on_failure(op, "ValueError: ...")
    with pytest.raises(RuntimeError, match="restoring checkpoint step 10 failed"):
        runtime.buffers.get("r0")

    with pytest.raises(UncommittedStepError, match="step 20 is not committed"):
        runtime.apply(restore_op(4, directory, 20))
    runtime.apply(CloseCheckpointsOp(5, directory, "t"))
