"""A worker that dies takes its gang down cleanly: clear errors, nothing hangs, the
slices can be allocated again."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import pytest

import slicewise
from slicewise.testing import wait_until

pytestmark = pytest.mark.integration


def test_killed_worker_fails_the_gang_with_a_clear_error_and_frees_its_slices(client):
    gang = client.allocate(slices=2, slice_type="v5litepod-4", timeout=120)
    try:
        mesh = gang.mesh()
        x = gang.put(np.ones(8, np.float32), mesh.sharding(("slice", "chip")))
        inc = gang.compile(jax.jit(lambda a: a + 1), x)
        assert inc(x).fetch().tolist() == [2.0] * 8
        victim = gang.stats().workers[1].pid
        os.kill(victim, signal.SIGKILL)

        def failed():
            try:
                inc(x).fetch(timeout=60)
            except slicewise.SlicewiseError as exc:
                return exc
            return None

        wait_until(failed, timeout_s=60, what="the gang to fail after one of its workers died")
        with pytest.raises(
            slicewise.FailedPreconditionError,
            match=f"gang {gang.id} failed .*release it and allocate a new one",
        ):
            inc(x).fetch()  # the call returns; its refusal comes back on its output
    finally:
        gang.release()
    with client.allocate(slices=2, slice_type="v5litepod-4", timeout=120) as again:
        mesh = again.mesh()
        y = again.put(np.arange(8, dtype=np.float32), mesh.sharding(("slice", "chip")))
        assert again.compile(jax.jit(lambda a: a * 2), y)(y).fetch().tolist() == list(
            np.arange(8, dtype=np.float32) * 2
        )
