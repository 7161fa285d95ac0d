"""Sharded programs run on real workers: one jax.distributed cluster across slices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from programs.demo import dcn_sum_matmul, dcn_sum_matmul_reference

pytestmark = pytest.mark.integration


def _run_dcn_sum_matmul(gang, mesh, rows_per_slice: int):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows_per_slice * gang.num_slices, 48), dtype=np.float32)
    w = rng.standard_normal((48, 16), dtype=np.float32)
    xr = gang.put(x, mesh.sharding(("slice", "data"), None))
    wr = gang.put(w, mesh.sharding(None, "model"))
    step = gang.compile(dcn_sum_matmul(mesh.abstract), xr, wr)
    z = step(xr, wr).fetch()
    np.testing.assert_allclose(
        z, dcn_sum_matmul_reference(x, w, gang.num_slices), rtol=1e-4, atol=1e-4
    )
    return z


def test_dcn_psum_and_ici_matmul_on_two_slices(two_slices):
    gang = two_slices
    assert (gang.num_slices, gang.hosts_per_slice, gang.chips_per_host) == (2, 1, 4)
    mesh = gang.mesh(dcn={"slice": 2}, ici={"data": 2, "model": 2})
    _run_dcn_sum_matmul(gang, mesh, rows_per_slice=16)


def test_dcn_psum_and_ici_matmul_on_one_multi_host_slice(client):
    with client.allocate(slices=1, slice_type="v5litepod-16", timeout=120) as gang:
        assert (gang.num_slices, gang.hosts_per_slice, gang.chips_per_host) == (1, 4, 4)
        mesh = gang.mesh(dcn={"slice": 1}, ici={"data": 4, "model": 4})
        _run_dcn_sum_matmul(gang, mesh, rows_per_slice=32)


def test_hybrid_axis_spans_slices_and_chips(two_slices):
    """One `data` axis of 8 = 2 slices x 4 chips: a global mean crosses DCN and ICI."""
    gang = two_slices
    mesh = gang.mesh(dcn={"data": 2}, ici={"data": 4})
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    xr = gang.put(x, mesh.sharding("data", None))
    centered = gang.compile(jax.jit(lambda a: a - a.mean(axis=0)), xr)
    np.testing.assert_allclose(centered(xr).fetch(), x - x.mean(axis=0), rtol=1e-6)


def test_outputs_chain_into_the_next_call_and_multiple_outputs(two_slices):
    gang = two_slices
    mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
    sharding = mesh.sharding(("slice", "chip"))
    x = np.linspace(0, 1, 32, dtype=np.float32)
    xr = gang.put(x, sharding)
    f = gang.compile(jax.jit(lambda a: (a * 2, a.sum()), out_shardings=(sharding, None)), xr)
    doubled, total = f(xr)
    again, total2 = f(doubled)
    np.testing.assert_allclose(again.fetch(), x * 4, rtol=1e-6)
    np.testing.assert_allclose(total.fetch(), x.sum(), rtol=1e-5)
    np.testing.assert_allclose(total2.fetch(), 2 * x.sum(), rtol=1e-5)


def test_input_with_another_sharding_is_resharded_on_the_workers(two_slices):
    """A replicated upload fed to a program that expects it split still gives the answer."""
    gang = two_slices
    mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
    x = np.arange(16, dtype=np.float32)
    replicated = gang.put(x, mesh.sharding())
    split_spec = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=mesh.sharding(("slice", "chip")))
    square = gang.compile(jax.jit(lambda a: a * a), split_spec)
    np.testing.assert_array_equal(square(replicated).fetch(), x * x)


def test_numpy_arguments_are_uploaded_with_the_programs_input_sharding(two_slices):
    gang = two_slices
    mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
    spec = jax.ShapeDtypeStruct((8, 3), jnp.int32, sharding=mesh.sharding(("slice", "chip")))
    add_one = gang.compile(jax.jit(lambda a: a + 1), spec)
    x = np.arange(24, dtype=np.int32).reshape(8, 3)
    np.testing.assert_array_equal(add_one(x).fetch(), x + 1)


def test_bfloat16_program(two_slices):
    gang = two_slices
    mesh = gang.mesh()
    x = np.arange(8, dtype=np.float32).astype(jnp.bfloat16)
    xr = gang.put(x, mesh.sharding(("slice", "chip")))
    halve = gang.compile(jax.jit(lambda a: a / 2), xr)
    out = halve(xr).fetch()
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), np.arange(8, dtype=np.float32) / 2)


def test_shard_map_over_both_axes_with_explicit_collectives(two_slices):
    """psum over ICI inside each slice, then over DCN across slices."""
    gang = two_slices
    mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})

    def two_level_sum(block):
        return jax.lax.psum(jax.lax.psum(block, "chip"), "slice")

    fn = jax.jit(
        jax.shard_map(
            two_level_sum, mesh=mesh.abstract, in_specs=P(("slice", "chip")), out_specs=P()
        )
    )
    x = np.arange(8, dtype=np.float32)
    xr = gang.put(x, mesh.sharding(("slice", "chip")))
    np.testing.assert_allclose(gang.compile(fn, xr)(xr).fetch(), [x.sum()], rtol=1e-6)


def test_pytree_arguments_and_results(two_slices):
    """Dicts and tuples in, dicts out: the artifact's tree structure is kept both ways."""
    gang = two_slices
    mesh = gang.mesh()
    split = mesh.sharding(("slice", "chip"))
    params = {"w": np.arange(8, dtype=np.float32), "b": np.ones(8, np.float32)}
    remote = {k: gang.put(v, split) for k, v in params.items()}

    def affine(p, xs):
        x, scale = xs
        return {"y": p["w"] * x * scale + p["b"], "norm": jax.numpy.sum(p["w"] ** 2)}

    x = gang.put(np.full(8, 2.0, np.float32), split)
    scale = gang.put(np.float32(0.5))
    program = gang.compile(jax.jit(affine), remote, (x, scale))
    out = program(remote, (x, scale))
    assert set(out) == {"y", "norm"}
    np.testing.assert_allclose(out["y"].fetch(), params["w"] * 2 * 0.5 + 1)
    np.testing.assert_allclose(out["norm"].fetch(), np.sum(params["w"] ** 2))


def test_programs_that_cannot_fit_or_call_the_host_are_refused_before_any_worker(
    two_slices, client
):
    from jax import export

    from slicewise.common.errors import SlicewiseError

    gang = two_slices
    mesh = gang.mesh()
    before = [w.programs for w in gang.stats().workers]
    # 8 chips: an unsharded 17 GiB input puts all of it on each one.
    big = export.export(jax.jit(lambda a: a + 1), platforms=["cpu"])(
        jax.ShapeDtypeStruct((17 * 2**28,), jnp.float32, sharding=mesh.sharding())
    )
    target = "xla_ffi_python_cpu_callback"
    callback = export.export(
        jax.jit(lambda a: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((8,), jnp.float32))(a)),
        platforms=["cpu"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(target)],
    )(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=mesh.sharding()))
    for exported, code, match in (
        (big, "RESOURCE_EXHAUSTED", "needs at least 17 GiB on each of its 8 devices"),
        (callback, "INVALID_ARGUMENT", f"uses custom call '{target}'"),
    ):
        with pytest.raises(SlicewiseError, match=match) as info:
            gang.load(exported, mesh)
        assert info.value.code.name == code
    assert [w.programs for w in gang.stats().workers] == before
    # The gang runs what it may.
    x = gang.put(np.arange(8, dtype=np.float32), mesh.sharding())
    np.testing.assert_array_equal(
        gang.compile(jax.jit(lambda a: a * 3), x)(x).fetch(), np.arange(8) * 3
    )
