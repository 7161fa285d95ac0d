"""Arrays in and out of a gang: chunked streams, every dtype, any size."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import slicewise
from protos import controller_pb2 as pb
from slicewise.testing import wait_until

pytestmark = pytest.mark.integration


def bytes_held(gang) -> int:
    return sum(w.bytes for w in gang.stats().workers)


@pytest.mark.slow
def test_one_gib_float32_round_trips_bit_identical(two_slices):
    gang = two_slices
    mesh = gang.mesh(dcn={"slice": 2}, ici={"data": 2, "model": 2})
    rows = 2**28 // 1024  # 2**28 float32 = 1 GiB
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, 1024), dtype=np.float32)
    x[0, :4] = [np.nan, np.inf, -0.0, np.finfo(np.float32).tiny]  # bit patterns, not values
    assert x.nbytes == 2**30
    before = bytes_held(gang)
    remote = gang.put(x, mesh.sharding(("slice", "data"), "model"))
    back = remote.fetch(timeout=240)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.array_equal(back.view(np.uint32), x.view(np.uint32))
    remote.delete()
    del back
    # Deletes are asynchronous.
    wait_until(
        lambda: bytes_held(gang) == before, timeout_s=60, what="the workers to free the 1 GiB"
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "uint32", "bool", "complex64"])
def test_dtypes_round_trip(two_slices, dtype):
    gang = two_slices
    mesh = gang.mesh()
    x = (np.arange(48) % 7).astype(jnp.dtype(dtype)).reshape(8, 6)
    back = gang.put(x, mesh.sharding(("slice", "chip"))).fetch()
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7, 5)])
def test_odd_shapes_replicated(two_slices, shape):
    gang = two_slices
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    back = gang.put(x).fetch()
    assert back.shape == shape
    np.testing.assert_array_equal(back, x)


def test_wait_reports_ready_and_delete_frees_worker_memory(two_slices):
    gang = two_slices
    mesh = gang.mesh()
    before = bytes_held(gang)
    arrays = [
        gang.put(np.ones((256, 256), np.float32), mesh.sharding(("slice", "chip")))
        for _ in range(3)
    ]
    assert all(a.wait().state == pb.ARRAY_STATE_READY for a in arrays)
    grown = bytes_held(gang)
    assert grown - before == 3 * 256 * 256 * 4
    slicewise.delete(arrays)
    # Deletes are asynchronous.
    wait_until(
        lambda: bytes_held(gang) == before, timeout_s=60, what=f"the workers to hold {before} bytes"
    )
