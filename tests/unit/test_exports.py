"""Exported training programs kept in the state directory (controller/exports.py): read
back as written, named by everything they depend on, and never read back half-written."""

from __future__ import annotations

from jax.sharding import PartitionSpec

from controller import exports
from controller.jobs import ExportedTraining
from slicewise.common.mesh import MeshSpec

MESH = MeshSpec.build({"data": 2}, {"fsdp": 4})
EXPORTED = ExportedTraining(
    init=b"init-bytes",
    step=b"step-bytes",
    flops=9.0e7,
    state_specs=[PartitionSpec("fsdp"), PartitionSpec()],
    stat_shapes={"tokens_by_slice": (2, 2)},
)


def test_an_export_is_read_back_as_kept(tmp_path):
    key = exports.key_of("lm", (("seed", "3"),), MESH, "cpu")
    assert exports.load(tmp_path, key) is None
    exports.store(tmp_path, key, EXPORTED)
    assert exports.load(tmp_path, key) == EXPORTED
    assert [p.suffix for p in tmp_path.iterdir()] == [exports.SUFFIX]  # no temporary left


def test_the_name_follows_every_input():
    base = exports.key_of("lm", (("seed", "3"),), MESH, "cpu")
    assert exports.key_of("lm", (("seed", "3"),), MESH, "cpu") == base
    others = {
        exports.key_of("moe", (("seed", "3"),), MESH, "cpu"),
        exports.key_of("lm", (("seed", "4"),), MESH, "cpu"),
        exports.key_of("lm", (("seed", "3"),), MeshSpec.build({"data": 2}, {"fsdp": 2}), "cpu"),
        exports.key_of("lm", (("seed", "3"),), MESH, "tpu"),
    }
    assert base not in others and len(others) == 4


def test_an_edited_program_is_exported_again(monkeypatch):
    base = exports.key_of("lm", (), MESH, "cpu")
    monkeypatch.setattr(exports, "code_fingerprint", lambda: "another source")
    assert exports.key_of("lm", (), MESH, "cpu") != base


def test_an_unreadable_export_is_made_again(tmp_path):
    key = exports.key_of("lm", (), MESH, "cpu")
    (tmp_path / f"{key}{exports.SUFFIX}").write_bytes(b"torn")
    assert exports.load(tmp_path, key) is None
