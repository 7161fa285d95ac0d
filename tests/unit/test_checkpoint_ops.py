"""The worker's checkpoint operations (SaveOp, CloseCheckpointsOp, RestoreOp) applied by
the runtime to its buffer table, in one process with 8 CPU devices (tier b), with real
orbax writes: what lands in storage, what comes back, what a restore refuses, and the
saves' own thread: a SaveOp returns before its save has committed, saves commit in
the order queued, a failed one is raised by the operations after it."""

from __future__ import annotations

import gc
import json
import logging
import weakref

import jax
import numpy as np
import pytest

from slicewise.common.checkpoints import COMMIT_FILE, committed_steps
from slicewise.common.failpoints import ENV_VAR
from slicewise.common.mesh import GangShape, MeshSpec, ShardingSpec
from slicewise.common.ops import CloseCheckpointsOp, RestoreOp, SaveOp
from slicewise.testing import wait_until
from worker.checkpoint import SaveFailedError, UncommittedStepError
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


def put_state(runtime, seed=0):
    """Stores a state of two arrays as s0, s1; returns their values."""
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal((8, 16), np.float32), np.int32(seed)]
    for handle, value, sharding in zip(("s0", "s1"), values, SHARDINGS, strict=True):
        runtime.buffers.put(handle, jax.device_put(value, runtime.named_sharding(sharding)))
    return values


def save_op(seq, directory, step, **retention):
    meta = json.dumps(META | {"step": step})
    return SaveOp(seq, directory, step, ("s0", "s1"), meta, "t", **retention)


def assert_restored(runtime, values):
    for handle, want in zip(("r0", "r1"), values, strict=True):
        got = np.asarray(runtime.buffers.get(handle))
        np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want).view(np.uint32))


def step_times(directory, step):
    """When orbax began writing `step` and when it committed it (ns, its own record)."""
    saved = json.loads((directory / str(step) / "_CHECKPOINT_METADATA").read_text())
    return saved["init_timestamp_nsecs"], saved["commit_timestamp_nsecs"]


@pytest.fixture
def failpoints(tmp_path, monkeypatch):
    path = tmp_path / "failpoints.json"
    path.write_text("{}")
    monkeypatch.setenv(ENV_VAR, str(path))
    return path


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


def test_a_save_op_returns_while_its_commit_is_held_and_saves_commit_in_order(
    runtime, tmp_path, failpoints, caplog
):
    directory = str(tmp_path / "ckpt")
    failpoints.write_text(json.dumps({"save_commit_delay_s": 600}))
    put_state(runtime, seed=1)
    with caplog.at_level(logging.WARNING, logger="worker.checkpoint"):
        runtime.apply(save_op(1, directory, 1))
        # Returned with its arrays in host memory: they may go from the table at once.
        runtime.buffers.delete(("s0", "s1"))
        wait_until(
            lambda: "checkpoint step 1: failpoint: holding its commit" in caplog.text,
            timeout_s=60,
            what="the commit of step 1 to be held",
        )
    # The op came back while its commit is held (for up to 600 s, until released).
    assert not (tmp_path / "ckpt" / "1").exists()
    failpoints.write_text("{}")  # releases the hold
    values = put_state(runtime, seed=2)
    runtime.apply(save_op(2, directory, 2))
    runtime.apply(save_op(3, directory, 3))
    runtime.apply(CloseCheckpointsOp(4, directory, "t"))
    for step in (1, 2, 3):
        assert (tmp_path / "ckpt" / str(step) / COMMIT_FILE).is_file()
    # Each save began after the one before it had committed: one at a time, in order.
    times = [step_times(tmp_path / "ckpt", step) for step in (1, 2, 3)]
    assert times[0][1] <= times[1][0] and times[1][1] <= times[2][0]
    runtime.apply(restore_op(5, directory, 2, expect=(*EXPECT[:-1], ("step", 2))))
    assert_restored(runtime, values)


def test_a_restore_waits_for_the_save_in_flight(runtime, tmp_path, failpoints):
    directory = str(tmp_path / "ckpt")
    failpoints.write_text(json.dumps({"save_commit_delay_s": 2}))
    values = put_state(runtime, seed=3)
    runtime.apply(save_op(1, directory, 7))
    # Queued straight behind the save, before it has committed: it waits for it (a
    # step not yet committed cannot be restored: UncommittedStepError).
    runtime.apply(restore_op(2, directory, 7, expect=(*EXPECT[:-1], ("step", 7))))
    assert_restored(runtime, values)
    runtime.apply(CloseCheckpointsOp(3, directory, "t"))


def test_a_failed_save_is_raised_by_the_next_save_restore_and_close(runtime, tmp_path):
    directory = str(tmp_path / "ckpt")
    put_state(runtime)
    runtime.apply(save_op(1, directory, 5))
    runtime.apply(CloseCheckpointsOp(2, directory, "t"))
    # Saving a committed step again fails in orbax, on the save thread: the operation
    # itself has returned by then.
    runtime.apply(save_op(3, directory, 5))
    failed = "checkpoint step 5 was not saved in .*StepAlreadyExistsError"
    with pytest.raises(SaveFailedError, match=failed):
        runtime.apply(save_op(4, directory, 10))
    with pytest.raises(SaveFailedError, match=failed):
        runtime.apply(restore_op(5, directory, 5, expect=(*EXPECT[:-1], ("step", 5))))
    with pytest.raises(SaveFailedError, match=failed):
        runtime.apply(CloseCheckpointsOp(6, directory, "t"))
    assert runtime.stats()["checkpoint_dirs"] == 0
    assert not (tmp_path / "ckpt" / "10").exists()


def test_a_failed_save_with_nothing_after_it_is_raised_by_close(runtime, tmp_path):
    directory = str(tmp_path / "ckpt")
    put_state(runtime)
    runtime.apply(save_op(1, directory, 5))
    runtime.apply(CloseCheckpointsOp(2, directory, "t"))
    runtime.apply(save_op(3, directory, 5))
    with pytest.raises(SaveFailedError, match="checkpoint step 5 was not saved"):
        runtime.apply(CloseCheckpointsOp(4, directory, "t"))


def test_the_save_thread_lets_go_of_the_arrays_before_the_commit(runtime, tmp_path, failpoints):
    directory = str(tmp_path / "ckpt")
    failpoints.write_text(json.dumps({"save_commit_delay_s": 30}))
    put_state(runtime)
    arrays = [weakref.ref(runtime.buffers.get(h)) for h in ("s0", "s1")]
    runtime.apply(save_op(1, directory, 1))
    runtime.buffers.delete(("s0", "s1"))

    def released() -> bool:
        gc.collect()
        return all(a() is None for a in arrays)

    wait_until(released, timeout_s=20, what="the saved arrays to be let go of")
    assert not (tmp_path / "ckpt" / "1").exists()  # its commit is still held
    failpoints.write_text("{}")
    runtime.apply(CloseCheckpointsOp(2, directory, "t"))
    assert (tmp_path / "ckpt" / "1" / COMMIT_FILE).is_file()


def test_saves_apply_their_retention_to_a_directory_a_restore_opened(runtime, tmp_path):
    directory = str(tmp_path / "ckpt")
    put_state(runtime)
    runtime.apply(save_op(1, directory, 1))
    runtime.apply(CloseCheckpointsOp(2, directory, "t"))
    # A resumed job: its restore opens the directory, its saves say what to keep.
    runtime.apply(restore_op(3, directory, 1, expect=(*EXPECT[:-1], ("step", 1))))
    for seq, step in enumerate((2, 3, 4, 5), start=4):
        runtime.apply(save_op(seq, directory, step, max_to_keep=2, keep_steps=(1,)))
    runtime.apply(CloseCheckpointsOp(8, directory, "t"))
    assert committed_steps(directory) == [1, 4, 5]


def test_a_directorys_setup_and_first_save_count_as_compiling(runtime, tmp_path, monkeypatch):
    """The heartbeat's `compiling` is set while the first checkpoint op of a directory
    sets up (orbax's import, the checkpointer) and while its first save copies and
    queues: the step watchdog lets them take long. Later saves are watched; a directory
    closed and opened again sets up again."""
    import worker.checkpoint

    seen = []

    class Recording(worker.checkpoint.HostCheckpointer):
        def __init__(self, *args, **kwargs):
            seen.append(("setup", runtime.compiling))
            super().__init__(*args, **kwargs)

    queued_save = worker.checkpoint.QueuedCheckpointer.save

    def recording_save(self, step, *args, **kwargs):
        seen.append((step, runtime.compiling))
        return queued_save(self, step, *args, **kwargs)

    monkeypatch.setattr(worker.checkpoint, "HostCheckpointer", Recording)
    monkeypatch.setattr(worker.checkpoint.QueuedCheckpointer, "save", recording_save)
    put_state(runtime)
    directory = str(tmp_path / "ckpt")
    runtime.apply(save_op(1, directory, 1))
    runtime.apply(save_op(2, directory, 2))  # the same checkpointer, saved before
    runtime.apply(CloseCheckpointsOp(3, directory, "t"))
    runtime.apply(save_op(4, directory, 3))  # opened again
    runtime.apply(CloseCheckpointsOp(5, directory, "t"))
    setup, first = f"checkpointing in {directory}", f"the first save in {directory}"
    assert seen == [("setup", setup), (1, first), (2, ""), ("setup", setup), (3, first)]
    assert runtime.compiling == ""
    assert committed_steps(directory) == [1, 2, 3]
