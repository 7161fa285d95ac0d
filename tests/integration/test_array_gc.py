"""Remote arrays a client drops without `delete()` are freed on the workers."""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from slicewise.testing import wait_until

pytestmark = pytest.mark.integration

ROWS = 256  # float32 over 8 chips: 1 KiB an array


def live_arrays(gang) -> int:
    """The gang's arrays in the controller's table."""
    return next(g.live_arrays for g in gang.client.cluster_info().gangs if g.gang_id == gang.id)


def held(gang) -> list[tuple[int, int]]:
    """(arrays, bytes on its devices) of each worker, as the worker reports them."""
    return [(w.arrays, w.bytes) for w in gang.stats().workers]


def settled(gang) -> list[tuple[int, int]]:
    """`held`, once every worker holds exactly the arrays the controller knows of (the
    deletes sent so far have reached the workers)."""
    gang.flush_deletes()
    live = live_arrays(gang)

    def agreed() -> list[tuple[int, int]] | None:
        now = held(gang)
        return now if all(n == live for n, _ in now) else None

    return wait_until(
        agreed,
        timeout_s=60,
        what=f"the workers of gang {gang.id} to hold the controller's {live} arrays",
    )


@pytest.fixture(scope="module")
def setup(two_slices):
    gang = two_slices
    mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
    sharding = mesh.sharding(("slice", "chip"))
    x = gang.put(np.zeros(ROWS, np.float32), sharding)
    step = gang.compile(jax.jit(lambda a: a + 1, out_shardings=sharding), x)
    step(x).fetch()  # compiled on the workers
    return gang, sharding, x, step


def test_a_thousand_dropped_arrays_are_freed_on_the_workers(setup):
    gang, sharding, x, step = setup
    before, before_live = settled(gang), live_arrays(gang)
    arrays = [gang.put(np.full(ROWS, i, np.float32), sharding) for i in range(500)]
    arrays += [step(x) for _ in range(500)]
    grown = [(n + 1000, b + 1000 * ROWS * 4 // len(before)) for n, b in before]
    wait_until(lambda: held(gang) == grown, timeout_s=120, what=f"the workers to hold {grown}")

    del arrays
    gc.collect()
    assert live_arrays(gang) == before_live + 1000  # nothing is sent from a finalizer
    assert gang.flush_deletes() == 1000
    assert live_arrays(gang) == before_live
    assert settled(gang) == before
    assert x.fetch().sum() == 0


def test_dropping_the_input_of_queued_calls_is_safe(setup):
    gang, sharding, x, step = setup
    before = settled(gang)
    values = np.arange(ROWS, dtype=np.float32)
    a = gang.put(values, sharding)
    outs = [step(a) for _ in range(50)]  # queued; some may not have run yet
    del a
    assert gang.flush_deletes() == 1
    # A chain is one call of 20 runs: none of its intermediate outputs is ever kept.
    last = step.chain(20, outs[-1])
    uploaded = step(values)  # the upload of `values` is dropped at once
    assert gang.flush_deletes() == 1
    np.testing.assert_array_equal(uploaded.fetch(), values + 1)
    np.testing.assert_array_equal(last.fetch(), values + 21)
    for out in outs:
        np.testing.assert_array_equal(out.fetch(), values + 1)

    del outs, out, last, uploaded
    assert gang.flush_deletes() == 52
    assert settled(gang) == before
