"""The benchmarks' CPU meters (benchmarks/common.py) on this process's own threads."""

from __future__ import annotations

import os
import threading

import pytest

from benchmarks import wakeups
from benchmarks.common import (
    CpuMeter,
    ThreadCpuMeter,
    cpu_seconds,
    interleaved,
    thread_cpu_seconds,
)
from benchmarks.dispatch import (
    NATIVE,
    _sweep_rounds,
    break_even,
    break_even_from_cpu,
    cpu_bound,
    length_cpu,
    sweep_iters,
    thread_group,
)

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


def _spin(seconds: float) -> None:
    """Uses `seconds` of CPU on this thread, as both the process's and the thread's
    figures count it (they are rounded apart)."""
    pid, me = os.getpid(), threading.get_native_id()

    def used() -> tuple[float, float]:
        return cpu_seconds(pid), thread_cpu_seconds(pid)[me]

    start = used()
    while min(b - a for a, b in zip(start, used(), strict=True)) < seconds:
        sum(range(1000))


def test_a_meter_used_for_several_blocks_sums_them():
    meter = CpuMeter({"me": [os.getpid()]})
    threads = ThreadCpuMeter([os.getpid()])
    for _ in range(2):
        with meter, threads:
            _spin(SPIN_S)
    # Each block used SPIN_S and well under 2 * SPIN_S (the spin ends a clock tick or
    # two after reaching it): only both together reach 2 * SPIN_S.
    assert meter.used["me"] >= 2 * SPIN_S
    assert sum(threads.used.values()) >= 2 * SPIN_S


def test_rounds_alternate_their_order_and_keep_each_measures_rates():
    calls: list[str] = []

    def measure(name: str, rate: float):
        def run() -> float:
            calls.append(name)
            return rate + len(calls)

        return run

    rates = interleaved(3, {"a": measure("a", 100), "b": measure("b", 200)})
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert rates == {"a": [101, 104, 105], "b": [202, 203, 206]}


def test_a_length_of_the_sweep_is_judged_by_its_cpu_per_call():
    # Multi-controller: 2 cores busy for 1 s, 1,000 calls of 2,000 us each, all in the
    # workers; slicewise: 2,500 us per call, 500 us of it beyond the workers' loop.
    point = length_cpu(
        {
            "multi_controller": {"client": 0.0, "controller": 0.0, "workers": 2.0},
            "slicewise": {"client": 0.1, "controller": 0.2, "workers": 2.2},
        },
        {"multi_controller": 1.0, "slicewise": 1.25},
        1000,
    )
    assert point["cpu_per_call_us"]["slicewise"] == pytest.approx(
        {"client": 100.0, "controller": 200.0, "workers": 2200.0}
    )
    assert point["cores_busy"] == pytest.approx({"multi_controller": 2.0, "slicewise": 2.0})
    assert point["ratio_from_cpu"] == pytest.approx(0.8)
    assert point["extra_us"] == pytest.approx(500.0)
    assert point["extra_allowed_us"] == pytest.approx(2000 / 0.95 - 2000)


def _point(length_ms: float, mc_us: float, ours: dict[str, float]) -> dict:
    cpu = {"multi_controller": {"client": 0.0, "controller": 0.0, "workers": mc_us}}
    cpu["slicewise"] = ours
    total = sum(ours.values())
    return {
        "length_ms": length_ms,
        "cpu_per_call_us": cpu,
        "ratio_from_cpu": mc_us / total,
        "extra_us": total - mc_us,
        "extra_allowed_us": mc_us * (1 / 0.95 - 1),
    }


def test_the_break_even_by_cpu_is_read_off_the_sweep_at_the_papers_length():
    ours = {"client": 50.0, "controller": 150.0, "workers": 0.0}
    sweep = [
        _point(1.0, 2000.0, {**ours, "workers": 2300.0}),
        _point(4.0, 8000.0, {**ours, "workers": 8300.0}),
        _point(16.0, 32000.0, {**ours, "workers": 32300.0}),
    ]
    even = break_even_from_cpu(sweep, 2.0)
    # 500 us beyond the loop: 0.94 of 8,000 us at 4 ms, 0.985 of 32,000 at 16 ms.
    assert even["break_even_ms"] == 16.0
    # Halfway between 1 and 4 ms on a log scale: halfway between 105 and 421 us allowed.
    assert even["extra_allowed_us_at_target"] == pytest.approx((2000 + 8000) / 2 * (1 / 0.95 - 1))
    assert break_even_from_cpu(sweep, 3.0)["nearest_ms"] == 4.0
    even = break_even_from_cpu(sweep, 1.5)
    assert even["nearest_ms"] == 1.0
    assert even["extra_us_at_nearest"] == pytest.approx(500.0)
    assert even["extra_by_group_us_at_nearest"] == pytest.approx(
        {"client": 50.0, "controller": 150.0, "workers": 300.0}
    )
    assert break_even_from_cpu([{"length_ms": 1.0, "ratio": 0.5}], 2.0) is None


def test_the_break_even_is_the_shortest_length_reaching_95_percent_and_where_it_holds_on():
    sweep = [
        {"length_ms": length, "ratio": ratio}
        for length, ratio in [(4.0, 0.96), (1.0, 0.8), (2.0, 0.951), (3.0, 0.94), (8.0, 0.99)]
    ]
    # 2 ms reached it, 3 ms did not: held on from 4 ms (the sweep's order does not matter).
    assert break_even(sweep) == {"break_even_ms": 2.0, "break_even_sustained_ms": 4.0}
    sweep[-1]["ratio"] = 0.9  # the longest fell short: it never holds on
    assert break_even(sweep) == {"break_even_ms": 2.0, "break_even_sustained_ms": None}
    assert break_even([{"length_ms": 1.0, "ratio": 0.5}]) == {
        "break_even_ms": None,
        "break_even_sustained_ms": None,
    }


def test_sweep_lengths_are_placed_on_the_line_through_two_measured_ones():
    # 1.0 ms with no work, 0.05 ms more per iteration: 2.3 ms takes 26 iterations.
    assert sweep_iters(1.0, 0.05, (0.5, 1.0, 2.3, 3.0, 3.01)) == [0, 26, 40]
    assert sweep_iters(2.0, 0.01, (1.0, 2.3, 100.0)) == [0, 30, 9800]


def test_a_calibration_that_measured_noise_is_refused():
    with pytest.raises(ValueError, match="calibration failed"):
        sweep_iters(1.2, -0.001, (2.3,))


def test_lengths_near_the_papers_break_even_get_more_rounds_unless_quick():
    assert _sweep_rounds(6, 2.3, quick=False) == 10
    assert _sweep_rounds(6, 4.5, quick=False) == 10  # within a factor of 2 of 2.3 ms
    assert _sweep_rounds(6, 1.1, quick=False) == 6
    assert _sweep_rounds(6, 5.0, quick=False) == 6
    assert _sweep_rounds(2, 2.3, quick=True) == 2
    assert _sweep_rounds(12, 2.3, quick=False) == 12


def test_every_way_of_waking_is_measured_in_a_process_of_its_own_and_reported():
    result = wakeups.run(periods=(0.001,), count=5)
    assert list(result) == list(wakeups.WAYS)
    assert all(set(by_period) == {"1"} for by_period in result.values())
    # Each receiver used some CPU for its five messages (the figures vary by machine).
    assert all(us > 0 for by_period in result.values() for us in by_period.values())
    line = wakeups.report(result)
    assert line.startswith("CPU per wake-up for a message after a sleep of 1 ms: ")
    assert all(way in line for way in wakeups.WAYS)


def test_an_unknown_way_of_waking_is_refused():
    with pytest.raises(ValueError, match="unknown way 'poll'"):
        wakeups.measure("poll", 0.001, count=1)
