"""The soak benchmark's pure parts (benchmarks/soak.py): its fault plan, its goodput
accounting and its loss comparison."""

from __future__ import annotations

import pytest

from benchmarks.soak import (
    BUCKETS,
    STEP_OFFSETS,
    account,
    busy_time,
    compare_losses,
    plan_faults,
)
from controller.chaos import KINDS


def test_the_plan_has_a_fault_every_interval_that_begins_within_the_soak():
    plan = plan_faults(seed=0, minutes=30, every_min=2, num_processes=2)
    assert [f.due_s for f in plan] == [120.0 * n for n in range(1, 15)]
    assert all(f.kind in KINDS and f.process in (0, 1) for f in plan)
    assert all(STEP_OFFSETS[0] <= f.offset <= STEP_OFFSETS[1] for f in plan)


def test_the_plan_is_the_seeds_and_draws_every_kind_in_a_long_soak():
    assert plan_faults(7, 30, 2, 2) == plan_faults(7, 30, 2, 2)
    assert plan_faults(7, 30, 2, 2) != plan_faults(8, 30, 2, 2)
    assert {f.kind for f in plan_faults(0, 240, 2, 2)} == set(KINDS)


@pytest.mark.parametrize(("minutes", "every"), [(0, 2), (30, 0), (-1, 1)])
def test_a_plan_needs_a_positive_length_and_interval(minutes, every):
    with pytest.raises(ValueError, match="must be > 0"):
        plan_faults(0, minutes, every, 2)


def test_goodput_is_kept_step_time_over_wall_time_and_the_badput_adds_up():
    steps = [(20.0 + 0.2 * (n + 1), 0.2) for n in range(400)]  # 80 s of steps
    faults = [
        {
            "steps_lost": 0,
            "first_step_time_s": 0.5,
            "phases_s": {
                "detect": 0.1,
                "controller restart": 0.0,
                "release": 0.2,
                "new gang": 2.8,
                "restore": 1.9,
                "first step": 6.5,
            },
        },
        {
            "steps_lost": 5,
            "first_step_time_s": 0.4,
            "phases_s": {
                "detect": 0.3,
                "controller restart": 3.0,
                "release": 0.0,
                "new gang": 2.0,
                "restore": 2.0,
                "first step": 4.4,
            },
        },
    ]
    result = account(steps, faults, wall_s=100.0, startup_s=5.0)
    assert result["goodput"] == pytest.approx(0.8)
    badput = result["badput_s"]
    assert list(badput) == list(BUCKETS)
    assert badput["detection"] == pytest.approx(0.4)
    assert badput["controller restart"] == pytest.approx(3.0)
    assert badput["new gang"] == pytest.approx(5.0)
    assert badput["restore"] == pytest.approx(3.9)
    assert badput["program compile"] == pytest.approx(6.0 + 4.0)
    assert badput["progress lost"] == pytest.approx(1.0)
    assert badput["startup"] == 5.0
    assert sum(badput.values()) + result["productive_s"] == pytest.approx(100.0)
    # The first steps after the faults ran 0.3 s and 0.2 s over the 0.2-s median step.
    assert result["first_steps_excess_s"] == pytest.approx(0.5)
    assert result["goodput_first_steps_at_median"] == pytest.approx((80.0 - 0.5) / 100.0)


def test_steps_in_flight_are_counted_once():
    # Three steps of 1 s each, ending 0.5 s apart: busy from 0 to 2 s.
    assert busy_time([(1.0, 1.0), (1.5, 1.0), (2.0, 1.0)]) == pytest.approx(2.0)
    # A gap between two steps is not counted, nor is the order of the records.
    assert busy_time([(10.0, 1.0), (2.0, 2.0)]) == pytest.approx(3.0)
    assert busy_time([]) == 0.0


def test_losses_must_match_the_reference_bit_for_bit_at_every_step():
    ref = {0: 5.5, 1: 5.25, 2: 5.0}
    assert compare_losses({0: 5.5, 1: 5.25, 2: 5.0}, ref) == (True, [])
    assert compare_losses({0: 5.5, 1: 5.250000001, 2: 5.0}, ref) == (
        False,
        [(1, 5.250000001, 5.25)],
    )
    assert compare_losses({0: 5.5, 3: 4.9}, ref) == (False, [(3, 4.9, None)])
    assert compare_losses({}, ref) == (False, [])
