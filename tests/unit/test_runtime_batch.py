"""The worker runtime's BatchOp on a mesh of 8 CPU devices in one process (tier b): the
arrays it stores are the program's own batch rows, a program's first batch on a host
(its data read and digested) counts as one-time setup for the step watchdog, and data
loaded ahead (prepare_data) is what the first batch uses."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from programs.lm import PROGRAM as LM
from slicewise.common.mesh import GangShape, MeshSpec, ShardingSpec
from slicewise.common.ops import BatchOp
from worker.runtime import JaxRuntime

GANG = GangShape(2, 1, 4)
MESH = MeshSpec.build({"data": 2}, {"fsdp": 4})
ROWS = ShardingSpec(MESH, (("data", "fsdp"),))


@pytest.fixture
def runtime():
    rt = JaxRuntime(GANG, 0)
    # What initialize() finds in a one-process "gang": every device is local.
    rt._devices = sorted(jax.devices(), key=lambda d: d.id)
    return rt


def test_a_programs_first_batch_loads_its_data_as_setup(runtime, tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 40)
    overrides = (("corpus", str(tmp_path / "*.txt")), ("seq_len", "16"))
    seen = []
    digest = type(LM).data_fingerprint

    def recording(self, config):
        seen.append(runtime.compiling)
        return digest(self, config)

    monkeypatch.setattr(type(LM), "data_fingerprint", recording)
    for seq, step in ((1, 0), (2, 1)):
        runtime.apply(BatchOp(seq, "lm", overrides, step, ROWS, (f"b{step}",)))
        assert runtime.compiling == ""
    assert seen == ["loading the data of lm"]  # the second batch: no setup
    config = LM.make_config(dict(overrides))
    for step in (0, 1):
        np.testing.assert_array_equal(
            np.asarray(runtime.buffers.get(f"b{step}")), LM.global_batch(config, step)["tokens"]
        )


def test_data_loaded_ahead_is_what_the_first_batch_uses(runtime, tmp_path, monkeypatch):
    """prepare_data reads the data on a thread of its own, before any batch asks for it;
    the first batch then takes that load instead of reading the data again."""
    import threading

    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 40)
    overrides = (("corpus", str(tmp_path / "*.txt")), ("seq_len", "16"))
    loads = []
    loaded = threading.Event()
    digest = type(LM).data_fingerprint

    def recording(self, config):
        loads.append((threading.current_thread().name, runtime.compiling))
        result = digest(self, config)
        loaded.set()
        return result

    monkeypatch.setattr(type(LM), "data_fingerprint", recording)
    runtime.prepare_data("lm", overrides)
    assert loaded.wait(timeout=60), "prepare_data did not load the data by itself"
    runtime.apply(BatchOp(1, "lm", overrides, 0, ROWS, ("b0",)))
    assert loads == [("data-load", "")]  # once, and while no batch waited for it
    config = LM.make_config(dict(overrides))
    np.testing.assert_array_equal(
        np.asarray(runtime.buffers.get("b0")), LM.global_batch(config, 0)["tokens"]
    )


def test_a_failed_data_load_is_tried_again_by_the_next_batch(runtime, tmp_path):
    overrides = (("corpus", str(tmp_path / "*.txt")), ("seq_len", "16"))
    runtime.prepare_data("lm", overrides)  # no such files yet
    with pytest.raises(Exception, match="matched no files"):
        runtime.apply(BatchOp(1, "lm", overrides, 0, ROWS, ("b0",)))
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 40)
    runtime.apply(BatchOp(2, "lm", overrides, 0, ROWS, ("b0",)))
    config = LM.make_config(dict(overrides))
    np.testing.assert_array_equal(
        np.asarray(runtime.buffers.get("b0")), LM.global_batch(config, 0)["tokens"]
    )
