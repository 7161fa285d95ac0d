"""The benchmarks' CPU meters (benchmarks/common.py) on this process's own threads."""

from __future__ import annotations

import os
import threading

from benchmarks.common import ThreadCpuMeter, thread_cpu_seconds
from benchmarks.dispatch import NATIVE, thread_group

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
