"""Asynchronous dispatch: calls return handles at once; the gang computes behind them."""

from __future__ import annotations

import os

import grpc
import jax
import numpy as np
import pytest

import slicewise
from programs.demo import slow_increment
from protos import controller_pb2 as pb
from slicewise.testing import wait_until

pytestmark = pytest.mark.integration

CHAIN = 50
# Matmuls per call of the slow program. On the 2-core machine this was written on, one
# call then ran for ~0.3 s and the chain for ~15 s, while queueing one call took ~1 ms and
# all fifty ~0.1 s: a margin of ~150x (see the test below).
SLOW_ITERS = 200


def test_fifty_chained_calls_return_before_the_chain_has_run(two_slices):
    """Each call depends on the one before, so the chain cannot finish before CHAIN calls
    of the slow program have run one after the other. Had a call waited for its result,
    the last result would be ready when the last call returned; with asynchronous
    dispatch it is still pending then. The margin is the ratio of running one call to
    queueing one call: both are CPU-bound on the same machine (so they speed up or slow
    down together) and the first is made over a hundred times the second, which no
    plausible machine could flip. No durations are measured or compared."""
    gang = two_slices
    mesh = gang.mesh()
    x = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    step = gang.compile(slow_increment(mesh.abstract, iters=SLOW_ITERS, axis=("slice", "chip")), x)
    current = x
    for _ in range(CHAIN):
        current = step(current)
    # A moment's wait: this asks for the state now, it does not wait for the result.
    state = current.wait(timeout=0.001).state
    assert state == pb.ARRAY_STATE_PENDING, (
        f"the last of {CHAIN} chained calls was already {pb.ArrayState.Name(state)} when "
        "the calls returned: dispatch waited for the results"
    )
    np.testing.assert_array_equal(current.fetch(timeout=280), np.full(8, CHAIN, np.float32))


def test_back_pressure_bounds_programs_in_flight_on_every_host(two_slices):
    """However long the queue, no host ever had more than its window of programs in flight."""
    gang = two_slices
    mesh = gang.mesh()
    x = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    inc = gang.compile(jax.jit(lambda a: a + 1), x)
    before = gang.stats()
    # Back to back: the CHAIN calls reach the controller in a few messages, many times
    # the window.
    last = x
    for _ in range(CHAIN):
        last = inc(last)
    np.testing.assert_array_equal(last.fetch(timeout=120), np.full(8, CHAIN, np.float32))

    def settled():
        stats = gang.stats()
        return stats if stats.completed == stats.dispatched else None

    stats = wait_until(settled, timeout_s=60, what="every operation dispatched to complete")
    assert stats.dispatched - before.dispatched >= CHAIN, (before, stats)
    assert len(stats.workers) == 2
    for worker in stats.workers:
        assert 1 <= worker.max_in_flight <= worker.window, worker
        assert worker.next_sequence == stats.dispatched + 1, worker


def test_a_chain_of_calls_in_one_request(two_slices):
    gang = two_slices
    mesh = gang.mesh()
    x = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    inc = gang.compile(jax.jit(lambda a: a + 1), x)
    warm = inc(x).block_until_ready()  # its load is numbered and done
    before = gang.stats()
    last = inc.chain(128, x)
    np.testing.assert_array_equal(last.fetch(), np.full(8, 128, np.float32))
    # One operation of 128 runs for the workers, and one array: the last run's.
    after = gang.stats()
    assert after.dispatched - before.dispatched == 2, (before, after)  # the chain, the fetch
    held = [(w.arrays - v.arrays) for w, v in zip(after.workers, before.workers, strict=True)]
    assert held == [1, 1], (before, after)
    del warm
    with pytest.raises(slicewise.InvalidRequestError, match="1 to 1,000,000 calls"):
        inc.chain(0, x)
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


def test_calls_issued_back_to_back_travel_together_on_the_gangs_call_stream(two_slices):
    """Two hundred calls, each returning at once, reach the controller in fewer messages
    than calls (while one message is on its way the next calls queue behind it), and
    compute what they should."""
    gang = two_slices
    mesh = gang.mesh()
    x = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    inc = gang.compile(jax.jit(lambda a: a + 1), x)
    before = gang.stats()
    y = x
    for _ in range(200):
        y = inc(y)
    assert y.handle.startswith(gang.id.partition("@")[0] + "/c")  # named by the client
    np.testing.assert_array_equal(y.fetch(timeout=120), np.full(8, 200, np.float32))
    after = gang.stats()
    calls = after.streamed_calls - before.streamed_calls
    batches = after.stream_batches - before.stream_batches
    assert calls == 200 and 1 <= batches < calls, (calls, batches)
    print(f"200 calls in {batches} stream messages")


def test_a_refused_call_raises_at_fetch_and_at_the_next_use_naming_the_call(two_slices):
    """A call on an array deleted behind this client's back (here by a raw request)
    returns at once like any other; the controller's refusal comes back on its output:
    raised by a wait or fetch of it, and by the next call that reads it, naming the
    refused call. The calls around it are not affected."""
    gang = two_slices
    mesh = gang.mesh()
    x = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    inc = gang.compile(jax.jit(lambda a: a + 1), x)
    gone = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    gang.client.stub.DeleteArrays(pb.DeleteArraysRequest(handles=[gone.handle]), timeout=60)
    before = inc(x)
    refused = inc(gone)  # returns: nothing has been checked yet
    after = inc(x)
    with pytest.raises(
        slicewise.NotFoundError, match=r"call \d+ on gang .* was refused: .*deleted"
    ):
        refused.block_until_ready()
    with pytest.raises(slicewise.NotFoundError, match="was deleted"):
        refused.fetch()
    with pytest.raises(slicewise.NotFoundError, match="was deleted"):
        inc(refused)  # the next use: raised before anything is sent
    np.testing.assert_array_equal(before.fetch(), np.ones(8))
    np.testing.assert_array_equal(after.fetch(), np.ones(8))


def test_mistakes_the_client_can_see_are_raised_at_the_call(client, two_slices):
    """Wrong inputs, deleted inputs and another gang's arrays: raised at once, with the
    status the controller would give, and nothing is sent."""
    gang = two_slices
    mesh = gang.mesh()
    x = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    inc = gang.compile(jax.jit(lambda a: a + 1), x)
    deleted = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    deleted.delete()
    before = gang.stats().streamed_calls
    with client.allocate(slices=1, slice_type="v5litepod-16", timeout=120) as other:
        elsewhere = other.put(np.zeros(8, np.float32))
        with pytest.raises(slicewise.FailedPreconditionError, match="lives on gang") as e:
            inc(elsewhere)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(slicewise.NotFoundError, match="was deleted"):
        inc(deleted)
    with pytest.raises(slicewise.InvalidRequestError, match="takes 1 input"):
        inc(x, x)
    with pytest.raises(slicewise.InvalidRequestError, match=r"expected float32\[8\], got int32"):
        inc(gang.put(np.zeros(8, np.int32), mesh.sharding(("slice", "chip"))))
    np.testing.assert_array_equal(inc(x).fetch(), np.ones(8))
    assert gang.stats().streamed_calls == before + 1


SCHED_IDLE = 5  # the policy field of a /proc stat line (field 41)
DISPATCH = {"in-order-executor", "control-receiver", "control-sender"}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_a_simulated_hosts_dispatch_threads_go_after_its_devices(two_slices):
    """Each worker's executor and the control channel's receiver and sender run under
    SCHED_IDLE (worker/sched.py); its other Python threads (the heartbeat, the watcher)
    do not, nor do the native ones it did not start: XLA's devices', gloo's, Ray's.
    (Threads the executor starts inherit its policy: the thread that compiles programs
    ahead, started by the first load, and XLA's compiler threads, named llvm-worker-N,
    started by the first compile.)"""
    from benchmarks.common import attached_to_ray, thread_stats

    gang = two_slices
    mesh = gang.mesh()
    x = gang.put(np.zeros(8, np.float32), mesh.sharding(("slice", "chip")))
    inc = gang.compile(jax.jit(lambda a: a + 1), x)
    np.testing.assert_array_equal(inc(x).fetch(timeout=120), np.ones(8, np.float32))
    workers = gang.stats().workers
    with attached_to_ray(gang.client):
        import ray

        names = [
            ray.get(ray.get_actor(w.actor_name, namespace="slicewise").thread_names.remote())
            for w in workers
        ]
    for worker, python_names in zip(workers, names, strict=True):
        threads = thread_stats(worker.pid)
        idle = {
            python_names.get(tid, name)
            for tid, (name, fields) in threads.items()
            if int(fields[38]) == SCHED_IDLE
        }
        idle = {n for n in idle if not n.startswith(("llvm-worker", "compile-ahead"))}
        assert idle == DISPATCH, f"worker {worker.process_id}: {idle}"
        assert len(threads) > len(idle) + 4, "a worker has its devices' threads too"
