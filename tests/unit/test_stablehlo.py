"""The controller's reading of a program's StableHLO: custom calls outside JAX's stable
list are refused (host callbacks above all), and a per-device memory lower bound, from
the inputs' and outputs' shards and the largest value, is held to a v5e chip's HBM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from controller.programs import load_program
from controller.stablehlo import ModuleFacts, _shard_factors, check_module
from slicewise.common.errors import CapacityError, InvalidRequestError
from slicewise.common.mesh import MeshSpec
from slicewise.common.topology import HBM_BYTES_PER_CHIP

MESH = MeshSpec.build(ici={"x": 2, "y": 4})


def exported(fn, *shapes, dtype=jnp.float32, **export_kwargs):
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return export.export(jax.jit(fn), **export_kwargs)(*args)


def load(exp, name="p"):
    return load_program(bytes(exp.serialize()), name, MESH)


def test_per_device_bytes_follow_the_shardings_of_inputs_and_outputs():
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    fn = jax.jit(
        lambda a, b: (a * 2, b.sum()),
        in_shardings=(NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P(None, "y"))),
        out_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P())),
    )
    exp = export.export(fn)(
        jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
        jax.ShapeDtypeStruct((64, 256), jnp.bfloat16),
    )
    facts = check_module(exp.mlir_module(), exp.nr_devices, "p")
    # a: 4 MiB over 8 devices; b: 32 KiB over the 4 of "y"; the outputs: whole.
    assert facts.input_bytes == 4 * 2**20 // 8 + 64 * 256 * 2 // 4
    assert facts.output_bytes == 4 * 2**20 + 2  # b.sum() stays bfloat16
    assert facts.largest_value_bytes == 4 * 2**20
    assert facts.num_devices == 8
    assert facts.device_bytes == facts.output_bytes


def test_the_bound_is_the_largest_of_inputs_outputs_and_the_spread_largest_value():
    facts = ModuleFacts(input_bytes=10, output_bytes=20, largest_value_bytes=801, num_devices=8)
    assert facts.device_bytes == 101
    assert ModuleFacts(30, 20, 80, 8).device_bytes == 30


def test_older_gspmd_sharding_attributes_are_read_too():
    attrs = {"mhlo.sharding": "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"}
    assert _shard_factors(attrs, 2, {}) == [2, 1]
    sdy = {"sdy.sharding": '#sdy.sharding<@mesh, [{"x", "y"}, {"z":(1)2}]>'}
    assert _shard_factors(sdy, 2, {"mesh": {"x": 2, "y": 4, "z": 8}}) == [8, 2]
    assert _shard_factors(None, 3, {}) == [1, 1, 1]


def test_a_program_whose_inputs_cannot_fit_on_a_chip_is_refused_naming_the_sizes():
    exp = exported(lambda a: a + 1, (2**32 + 8,))  # 16 GiB + 32 bytes of f32, unsharded
    with pytest.raises(CapacityError, match="needs at least 16 GiB on each of its 1") as info:
        load(exp, "too-big")
    assert "inputs' shards take 16 GiB" in str(info.value)


def test_the_same_inputs_sharded_over_eight_devices_fit():
    mesh = jax.make_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    fn = jax.jit(lambda a: a + 1, in_shardings=sharding, out_shardings=sharding)
    exp = export.export(fn)(jax.ShapeDtypeStruct((2**32 + 8,), jnp.float32))
    program = load_program(bytes(exp.serialize()), "sharded", MeshSpec.build(ici={"x": 8}))
    assert program.device_bytes == (2**32 + 8) * 4 // 8
    assert program.device_bytes < HBM_BYTES_PER_CHIP


def test_a_program_with_a_value_too_large_for_all_its_chips_is_refused():
    exp = exported(lambda a: (a[:, None] * a[None, :]).sum(), (100_000,))  # 37 GiB outer
    with pytest.raises(CapacityError, match="largest value 37.3 GiB"):
        load(exp, "outer")


@pytest.mark.parametrize("target", ["xla_ffi_python_cpu_callback", "xla_python_cpu_callback"])
def test_host_callbacks_and_unknown_custom_calls_are_refused(target):
    fn = lambda a: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((4,), jnp.float32))(a)  # noqa: E731
    exp = exported(fn, (4,), disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])
    with pytest.raises(InvalidRequestError, match=f"uses custom call '{target}'"):
        load(exp, "callback")


def test_custom_calls_jax_guarantees_stable_are_allowed():
    program = load(exported(lambda a: jnp.linalg.qr(a)[0], (64, 64)), "qr")
    assert program.device_bytes == 64 * 64 * 4


def test_text_that_is_no_stablehlo_module_is_refused():
    with pytest.raises(InvalidRequestError, match="does not parse"):
        check_module("module { this is not mlir", 1, "garbage")
    with pytest.raises(InvalidRequestError, match="no public function @main"):
        check_module("module {}", 1, "empty")


def test_every_program_of_the_examples_passes(tmp_path):
    # What users register: a jitted function with shardings, a scan, a while loop.
    for fn, shapes in (
        (lambda a: jax.lax.scan(lambda c, x: (c + x, c), 0.0, a), [(16,)]),
        (lambda a: jax.lax.while_loop(lambda v: v.sum() < 100, lambda v: v * 2, a), [(4,)]),
        (lambda a, b: jax.nn.softmax(a @ b), [(8, 16), (16, 4)]),
    ):
        program = load(exported(fn, *shapes))
        assert 0 < program.device_bytes < 2**20
    assert np.isfinite(program.device_bytes)
