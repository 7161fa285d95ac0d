"""The benchmarks' CPU meters (benchmarks/common.py) on this process's own threads."""

from __future__ import annotations

import os
import threading

from benchmarks.common import ThreadCpuMeter, thread_cpu_seconds
from benchmarks.dispatch import NATIVE, cpu_bound, thread_group

SPIN_S = 0.05  # CPU seconds the spinning thread uses: five clock ticks


def test_cpu_per_thread_is_summed_by_what_the_thread_is():
    spun, release = threading.Event(), threading.Event()

    def spin():
        me = threading.get_native_id()
        while thread_cpu_seconds(os.getpid()).get(me, 0.0) < SPIN_S:
            sum(range(1000))
        spun.set()
        release.wait(60)  # alive (so its /proc entry is there) until the meter is read

    spinner = threading.Thread(target=spin, name="in-order-executor")
    meter = ThreadCpuMeter([os.getpid()])
    try:
        with meter:
            spinner.start()
            assert spun.wait(60)
        names = {os.getpid(): {t.native_id: t.name for t in threading.enumerate()}}
    finally:
        release.set()
        spinner.join(timeout=60)
    grouped = meter.grouped(names, thread_group)
    assert grouped["executor"] >= SPIN_S
    assert set(grouped) <= {"executor", "other Python", NATIVE}


def test_a_thread_python_does_not_know_is_native():
    assert thread_group(None) == NATIVE
    assert thread_group("control-sender") == "control send"
    assert thread_group("Dummy-1") == "other Python"


def test_the_cpu_bound_ceiling_counts_the_workers_at_their_own_loops_cost():
    cpu = {
        "slicewise": {"client": 100.0, "controller": 500.0, "workers": 3400.0},
        "multi_controller": {"client": 0.0, "controller": 0.0, "workers": 2400.0},
    }
    bound = cpu_bound(cpu, {"slicewise": 2.0, "multi_controller": 1.2}, 1000, 2, 0.4)
    assert bound["cores_busy"] == {"slicewise": 2.0, "multi_controller": 2.0}
    assert bound["opbyop_vs_multi_controller_from_cpu"] == 2400 / 4000
    assert bound["opbyop_ceiling_with_workers_at_their_loop"] == 2400 / 3000
    assert bound["opbyop_needed_for_2x_plain_ray"] == 0.8
