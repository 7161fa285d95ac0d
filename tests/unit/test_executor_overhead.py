"""benchmarks/executor_overhead.py on the test process's 8 CPU devices: every way runs
its operations and is measured on the thread that did the work."""

from __future__ import annotations

import gc

from benchmarks import executor_overhead


def test_each_way_is_measured_on_its_own_thread_in_every_round():
    try:
        result = executor_overhead.run(ops=40, rounds=2)
    finally:
        gc.unfreeze()  # a first call froze this test process's heap (slicewise/common/heap.py)
    assert list(result["median"]) == list(executor_overhead.WAYS)
    for way, median in result["median"].items():
        # Each way made 40 calls of a real program: its thread used CPU for them.
        assert median["thread_us_per_op"] > 0, way
    assert set(result["beyond_own_loop_us_per_op"]) == {"executor", "minimal"}
    assert "own loop" in executor_overhead.report(result)
