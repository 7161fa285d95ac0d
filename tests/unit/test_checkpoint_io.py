"""worker/checkpoint.py with real orbax writes into a temporary directory, in one process
with 8 CPU devices (tier b): asynchronous save and commit, restore onto the saving mesh
and onto other meshes, retention, partial steps that must never be restored, and
compression: off for the steps it saves, steps saved compressed still restore."""

from __future__ import annotations

import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from slicewise.common.checkpoints import COMMIT_FILE
from slicewise.common.failpoints import ENV_VAR
from slicewise.testing import wait_until
from worker.checkpoint import HostCheckpointer, UncommittedStepError

WAIT_S = 120
META = {"seed": 7, "step": 10, "global_batch_size": 32, "data": {"epoch": 0, "offset": 320}}


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def make_state(m: Mesh, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    specs = {"w": P("data", "model"), "b": P("model"), "count": P()}
    values = {
        "w": rng.standard_normal((8, 16), dtype=np.float32),
        "b": rng.standard_normal((16,), dtype=np.float32),
        "count": np.int32(seed),
    }
    return {k: jax.device_put(values[k], NamedSharding(m, specs[k])) for k in values}


def target_of(state: dict, shardings: dict) -> dict:
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in state.items()
    }


def assert_bitwise(restored, expected) -> None:
    got, want = np.asarray(restored), np.asarray(expected)
    assert got.dtype == want.dtype and got.shape == want.shape
    unsigned = np.dtype(f"u{want.dtype.itemsize}")
    np.testing.assert_array_equal(got.view(unsigned), want.view(unsigned))


@pytest.fixture
def ckpt(tmp_path):
    checkpointer = HostCheckpointer(tmp_path / "ckpt", max_to_keep=3)
    yield checkpointer
    checkpointer.close(timeout=WAIT_S)


def test_async_save_commits_and_restores_bit_for_bit(ckpt):
    m = mesh((2, 4), ("data", "model"))
    state = make_state(m)
    host = {k: np.asarray(v) for k, v in state.items()}
    shardings = {k: v.sharding for k, v in state.items()}
    target = target_of(state, shardings)

    ckpt.save(10, state, META)
    # The arrays were copied out before save() returned: their buffers may be reused.
    for array in state.values():
        array.delete()
    assert ckpt.wait_until_committed(timeout=WAIT_S) == 10
    assert ckpt.in_flight is None
    assert ckpt.is_committed(10)
    assert ckpt.committed_steps() == [10]
    assert ckpt.latest_committed_step() == 10
    assert (ckpt.directory / "10" / COMMIT_FILE).exists()

    restored, meta = ckpt.restore(10, target)
    assert meta == META
    for k, want in host.items():
        assert_bitwise(restored[k], want)
        assert restored[k].sharding == shardings[k]


@pytest.mark.parametrize(
    "shape, names, specs",
    [
        ((8,), ("x",), {"w": P("x", None), "b": P("x"), "count": P()}),
        (
            (4, 2),
            ("data", "model"),
            {"w": P(None, "data"), "b": P(("data", "model")), "count": P()},
        ),
        ((1, 8), ("data", "model"), {"w": P(), "b": P(), "count": P()}),
    ],
)
def test_restores_onto_another_mesh(ckpt, shape, names, specs):
    state = make_state(mesh((2, 4), ("data", "model")), seed=3)
    host = {k: np.asarray(v) for k, v in state.items()}
    ckpt.save(4, state, META)
    ckpt.wait_until_committed(timeout=WAIT_S)

    other = mesh(shape, names)
    shardings = {k: NamedSharding(other, spec) for k, spec in specs.items()}
    restored, meta = ckpt.restore(4, target_of(state, shardings))
    assert meta == META
    for k, want in host.items():
        assert_bitwise(restored[k], want)
        assert restored[k].sharding == shardings[k]
        assert restored[k].sharding.mesh.shape == other.shape


def test_keeps_the_last_k_and_the_marked_steps(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    ckpt = HostCheckpointer(tmp_path / "ckpt", max_to_keep=2, keep_steps=[1])
    try:
        for step in range(1, 8):
            ckpt.save(step, make_state(m, seed=step), {"step": step})
            assert ckpt.wait_until_committed(timeout=WAIT_S) == step
            if step == 3:
                ckpt.keep(3)
        assert ckpt.committed_steps() == [1, 3, 6, 7]
        on_disk = sorted(int(p.name) for p in ckpt.directory.iterdir() if p.name.isdigit())
        assert on_disk == [1, 3, 6, 7]
        state = make_state(m)
        restored, meta = ckpt.restore(
            3, target_of(state, {k: v.sharding for k, v in state.items()})
        )
        assert meta == {"step": 3}
        assert_bitwise(restored["w"], np.asarray(make_state(m, seed=3)["w"]))
    finally:
        ckpt.close(timeout=WAIT_S)
    # Marks are the caller's to keep across restarts: a reopened checkpointer told
    # about step 1 keeps it, one not told lets it go with the next save.
    reopened = HostCheckpointer(tmp_path / "ckpt", max_to_keep=2)
    try:
        reopened.save(8, make_state(m, seed=8), {"step": 8})
        reopened.wait_until_committed(timeout=WAIT_S)
        assert reopened.committed_steps() == [7, 8]
    finally:
        reopened.close(timeout=WAIT_S)


def test_a_partial_step_is_never_listed_or_restored(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    state = make_state(m, seed=1)
    target = target_of(state, {k: v.sharding for k, v in state.items()})
    ckpt = HostCheckpointer(tmp_path / "ckpt", max_to_keep=5)
    try:
        ckpt.save(3, state, {"step": 3})
        ckpt.wait_until_committed(timeout=WAIT_S)
    finally:
        ckpt.close(timeout=WAIT_S)
    root = tmp_path / "ckpt"
    # What a save killed before its commit leaves: every shard written, no marker, and
    # (POSIX, atomic rename) the temporary name, or (buckets, commit file) the final name.
    for partial in (f"5{ocp.path.atomicity_types.TMP_DIR_SUFFIX}", "7"):
        shutil.copytree(root / "3", root / partial)
        (root / partial / COMMIT_FILE).unlink()

    reopened = HostCheckpointer(root, max_to_keep=5)
    try:
        assert reopened.committed_steps() == [3]
        assert reopened.latest_committed_step() == 3
        assert not reopened.is_committed(5) and not reopened.is_committed(7)
        for step in (5, 7):
            with pytest.raises(UncommittedStepError, match=f"step {step} is not committed"):
                reopened.restore(step, target)
        restored, meta = reopened.restore(3, target)
        assert meta == {"step": 3}
        assert_bitwise(restored["w"], np.asarray(state["w"]))
        # The next save waits for orbax's clean-up of temporary directories.
        reopened.save(9, state, {"step": 9})
        reopened.wait_until_committed(timeout=WAIT_S)
        assert reopened.committed_steps() == [3, 9]
        assert not (root / f"5{ocp.path.atomicity_types.TMP_DIR_SUFFIX}").exists()
    finally:
        reopened.close(timeout=WAIT_S)


def test_a_commit_held_by_the_failpoint_leaves_a_partial_step_a_new_save_replaces(
    tmp_path, monkeypatch, caplog
):
    failpoints = tmp_path / "failpoints.json"
    failpoints.write_text(
        json.dumps({"save_commit_delay_s": 600, "save_commit_delay_from_step": 2})
    )
    monkeypatch.setenv(ENV_VAR, str(failpoints))
    m = mesh((2, 4), ("data", "model"))
    state = make_state(m, seed=2)
    target = target_of(state, {k: v.sharding for k, v in state.items()})
    root = tmp_path / "ckpt"
    partial = root / f"2{ocp.path.atomicity_types.TMP_DIR_SUFFIX}"
    ckpt = HostCheckpointer(root)
    try:
        ckpt.save(1, state, {"step": 1})  # before the failpoint's first step: not held
        assert ckpt.wait_until_committed(timeout=WAIT_S) == 1
        with caplog.at_level(logging.WARNING, logger="worker.checkpoint"):
            ckpt.save(2, state, {"step": 2})
            wait_until(
                lambda: "checkpoint step 2: failpoint: holding its commit" in caplog.text,
                timeout_s=WAIT_S,
                what="the commit of step 2 to be held",
            )
        # Held: every shard written, only the commit left.
        assert ckpt.in_flight == 2
        assert ckpt.committed_steps() == [1] and not ckpt.is_committed(2)
        assert not (root / "2").exists() and not (partial / COMMIT_FILE).exists()
        assert {p.name for p in partial.iterdir()} >= {"state", "meta"}
        # What a gang killed here leaves behind.
        shutil.copytree(partial, tmp_path / "killed")
        failpoints.write_text("{}")  # releases the hold
        assert ckpt.wait_until_committed(timeout=WAIT_S) == 2
    finally:
        ckpt.close(timeout=WAIT_S)

    shutil.rmtree(root / "2")
    shutil.copytree(tmp_path / "killed", partial)
    reopened = HostCheckpointer(root)
    try:
        assert reopened.committed_steps() == [1]
        restored, meta = reopened.restore(1, target)
        assert meta == {"step": 1}
        assert_bitwise(restored["w"], np.asarray(state["w"]))
        reopened.save(2, state, {"step": 2})
        assert reopened.wait_until_committed(timeout=WAIT_S) == 2
        assert reopened.committed_steps() == [1, 2]
        assert not partial.exists()
        restored, meta = reopened.restore(2, target)
        assert meta == {"step": 2}
        assert_bitwise(restored["w"], np.asarray(state["w"]))
    finally:
        reopened.close(timeout=WAIT_S)


def test_bfloat16_and_int32_round_trip_exactly(ckpt):
    m = mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(11)
    bf16 = rng.standard_normal((16, 8), dtype=np.float32).astype(jnp.bfloat16)
    bf16[0, :4] = np.array([np.inf, -np.inf, 0.0, -0.0], dtype=jnp.bfloat16)
    info = np.iinfo(np.int32)
    ints = rng.integers(info.min, info.max, size=(8, 4), dtype=np.int32, endpoint=True)
    ints[0, :2] = [info.min, info.max]
    shardings = {
        "bf16": NamedSharding(m, P("model", "data")),
        "ints": NamedSharding(m, P("data", None)),
    }
    state = {
        "bf16": jax.device_put(bf16, shardings["bf16"]),
        "ints": jax.device_put(ints, shardings["ints"]),
    }
    ckpt.save(1, state, {"step": 1})
    ckpt.wait_until_committed(timeout=WAIT_S)

    restored, _ = ckpt.restore(1, target_of(state, shardings))
    assert restored["bf16"].dtype == jnp.bfloat16 and restored["ints"].dtype == jnp.int32
    assert_bitwise(restored["bf16"], bf16)
    assert_bitwise(restored["ints"], ints)


def test_restore_refuses_a_target_without_shardings(ckpt):
    state = make_state(mesh((2, 4), ("data", "model")))
    ckpt.save(2, state, {"step": 2})
    ckpt.wait_until_committed(timeout=WAIT_S)
    bare = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}
    with pytest.raises(ValueError, match="has no sharding"):
        ckpt.restore(2, bare)


def test_state_is_saved_uncompressed_and_steps_saved_compressed_still_restore(tmp_path):
    m = mesh((2, 4), ("data", "model"))
    state = make_state(m, seed=5)
    state["zeros"] = jax.device_put(np.zeros((64, 1024), np.float32), NamedSharding(m, P("data")))
    target = target_of(state, {k: v.sharding for k, v in state.items()})
    root = tmp_path / "ckpt"
    # Step 1 as the checkpointer wrote it before: orbax's standard handler, which
    # compresses every array with zstd.
    before = ocp.CheckpointManager(root, item_names=("state", "meta"))
    before.save(
        1, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(META))
    )
    before.wait_until_finished()
    before.close()
    ckpt = HostCheckpointer(root)
    try:
        ckpt.save(2, state, META)
        ckpt.wait_until_committed(timeout=WAIT_S)
        for step in (1, 2):
            restored, meta = ckpt.restore(step, target)
            assert meta == META
            for k, v in state.items():
                assert_bitwise(restored[k], np.asarray(v))
    finally:
        ckpt.close(timeout=WAIT_S)

    def stored_bytes(step: int) -> int:
        return sum(p.stat().st_size for p in (root / str(step) / "state").rglob("*") if p.is_file())

    # 256 KiB of zeros: a few bytes compressed, all of them not.
    assert stored_bytes(1) < 64 * 1024 < 256 * 1024 < stored_bytes(2)
