"""Asynchronous dispatch: calls return handles at once; the gang computes behind them."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

import slicewise
from programs.demo import slow_increment

pytestmark = pytest.mark.integration

CHAIN = 50


def test_fifty_chained_calls_are_queued_faster_than_one_call_runs(two_slices):
    gang = two_slices
    mesh = gang.mesh()
    xr = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    step = gang.compile(slow_increment(mesh.abstract, axis=("slice", "chip")), xr)
    step(xr).block_until_ready()  # the workers compile on first use; keep that out of the timing

    started = time.perf_counter()
    one = step(xr).block_until_ready()
    single_s = time.perf_counter() - started
    assert single_s >= 0.1, f"the slow program took only {single_s:.3f} s; make it slower"

    started = time.perf_counter()
    current = one
    for _ in range(CHAIN):
        current = step(current)
    queued_s = time.perf_counter() - started
    print(
        f"one execution {single_s * 1e3:.0f} ms; {CHAIN} chained calls queued in "
        f"{queued_s * 1e3:.0f} ms"
    )
    assert queued_s < single_s, (
        f"queueing {CHAIN} calls took {queued_s:.3f} s, longer than one execution "
        f"({single_s:.3f} s): dispatch is not asynchronous"
    )

    np.testing.assert_array_equal(current.fetch(timeout=300), np.full(8, CHAIN + 1, np.float32))


def test_back_pressure_bounds_programs_in_flight_on_every_host(two_slices):
    """However long the queue, no host ever had more than its window of programs in flight."""
    stats = two_slices.stats()
    assert stats.dispatched >= CHAIN and stats.completed == stats.dispatched
    assert len(stats.workers) == 2
    for worker in stats.workers:
        assert 1 <= worker.max_in_flight <= worker.window, worker
        assert worker.next_sequence == stats.dispatched + 1, worker


def test_a_chain_of_calls_in_one_request(two_slices):
    gang = two_slices
    mesh = gang.mesh()
    x = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    inc = gang.compile(jax.jit(lambda a: a + 1), x)
    last = inc.chain(128, x)
    np.testing.assert_array_equal(last.fetch(), np.full(8, 128, np.float32))
    double = gang.compile(jax.jit(lambda a, b: (a * 2, a + b)), x, x)
    first, second = gang.execute_batch(
        [
            (inc, [x]),  # x + 1 = 1
            (double, [slicewise.Output(0), slicewise.Output(0)]),  # (2, 2)
        ]
    )
    np.testing.assert_array_equal(first.fetch(), np.ones(8))
    np.testing.assert_array_equal(second[0].fetch(), np.full(8, 2.0))
    np.testing.assert_array_equal(second[1].fetch(), np.full(8, 2.0))


def test_a_bad_call_in_a_batch_queues_nothing(two_slices):
    gang = two_slices
    mesh = gang.mesh()
    x = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    inc = gang.compile(jax.jit(lambda a: a + 1), x)
    before = gang.stats().dispatched
    with pytest.raises(slicewise.InvalidRequestError, match="call 2: input '@5:0' refers"):
        gang.execute_batch([(inc, [x]), (inc, [slicewise.Output(0)]), (inc, [slicewise.Output(5)])])
    assert gang.stats().dispatched == before
