"""A step's MoE routing on its way to people (pure, no processes): into the StepMetrics
message, as block bars, as plain `slicewise watch` lines every EXPERT_EVERY steps and on
the last, and in the end-of-job summary."""

from __future__ import annotations

import io

import pytest

from controller.jobview import (
    EXPERT_EVERY,
    expert_bar,
    expert_line,
    expert_lines,
    expert_summary,
    follow,
    max_over_mean,
    summary,
)
from controller.journal import ExpertLoad, StepRecord
from controller.messages import step_to_pb
from protos import controller_pb2 as pb


def test_step_to_pb_carries_each_layers_routing():
    record = StepRecord(
        4,
        5.0,
        1.0,
        1e-3,
        0.2,
        5000.0,
        100.5,
        (ExpertLoad(0, (12, 30, 7, 0), 0.021, 0.63), ExpertLoad(1, (5, 5), 0.0, 1.0)),
    )
    first, second = step_to_pb(record).experts
    assert (first.layer, list(first.tokens_per_expert)) == (0, [12, 30, 7, 0])
    assert (first.dropped_fraction, first.local_fraction) == (0.021, 0.63)
    assert (second.layer, list(second.tokens_per_expert)) == (1, [5, 5])
    assert step_to_pb(StepRecord(4, 5.0, 1.0, 1e-3, 0.2, 5000.0, 100.5)).experts == []


@pytest.mark.parametrize(
    ("counts", "bar"),
    [
        ([0, 4, 8], "▁▄█"),
        ([1, 2, 3, 4, 5, 6, 7, 8], "▁▂▃▄▅▆▇█"),
        ([1, 13, 99, 100], "▁▂██"),  # 13/100 is past an eighth: "▂"; 99/100 is "█"
        ([12, 30, 7, 0], "▄█▂▁"),  # 8 x 12 / 30 = 3.2 -> 4th block; 8 x 7 / 30 = 1.9 -> 2nd
        ([0, 0, 0], "▁▁▁"),
        ([], ""),
    ],
)
def test_expert_bar_is_each_count_in_eighths_of_the_largest_rounded_up(counts, bar):
    assert expert_bar(counts) == bar


def test_max_over_mean_and_a_layer_that_served_nothing():
    assert max_over_mean([0, 4, 8]) == 2.0
    assert max_over_mean([5, 5, 5, 5]) == 1.0
    assert max_over_mean([0, 0]) is None
    idle = pb.ExpertLoad(layer=2, tokens_per_expert=[0, 0, 0], dropped_fraction=1.0)
    assert expert_line(idle) == "moe2 load ▁▁▁ max/mean - drop 100.0% local 0%"


def test_expert_line_reads_bar_balance_drops_and_locality():
    load = pb.ExpertLoad(
        layer=1, tokens_per_expert=[0, 4, 8], dropped_fraction=0.021, local_fraction=0.63
    )
    assert expert_line(load) == "moe1 load ▁▄█ max/mean 2.0 drop 2.1% local 63%"
    step = pb.StepMetrics(step=9, experts=[load, load])
    assert expert_lines("j3", step) == ["j3   moe1 load ▁▄█ max/mean 2.0 drop 2.1% local 63%"] * 2


def routed(step: int, dropped: float = 0.01) -> pb.StepMetrics:
    return pb.StepMetrics(
        step=step,
        loss=2.0,
        tokens_per_s=1000,
        step_time_s=0.1,
        experts=[
            pb.ExpertLoad(
                layer=0, tokens_per_expert=[2, 4], dropped_fraction=dropped, local_fraction=1.0
            ),
            pb.ExpertLoad(
                layer=1, tokens_per_expert=[4, 4], dropped_fraction=0.0, local_fraction=0.5
            ),
        ],
    )


def test_plain_follow_shows_routing_every_expert_every_steps_and_on_the_last():
    steps = 2 * EXPERT_EVERY + 3
    job = pb.JobInfo(job_id="j3", steps=steps, state=pb.JOB_STATE_RUNNING)
    done = pb.JobInfo(job_id="j3", steps=steps, step=steps, state=pb.JOB_STATE_SUCCEEDED)
    reported = [routed(i) for i in range(steps)]
    # A step at a multiple of EXPERT_EVERY without routing shows nothing more.
    del reported[2 * EXPERT_EVERY - 1].experts[:]
    events = [
        pb.JobEvent(job=job, message="attached"),
        pb.JobEvent(job=job, steps=reported[:5]),
        pb.JobEvent(job=job, steps=reported[5:]),
        pb.JobEvent(job=done, message="succeeded"),
    ]
    out = io.StringIO()
    follow(events, plain=True, out=out)
    lines = out.getvalue().splitlines()

    routing = [
        "j3   moe0 load ▄█ max/mean 1.3 drop 1.0% local 100%",
        "j3   moe1 load ██ max/mean 1.0 drop 0.0% local 50%",
    ]
    expected = ["j3 running: attached"]
    for i in range(steps):
        expected.append(f"j3 step {i + 1}/{steps} loss 2.0000 1,000 tok/s 100 ms/step")
        if i + 1 in (EXPERT_EVERY, steps):
            expected.extend(routing)
    expected.append("j3 succeeded: succeeded")
    assert lines == expected


def test_the_summary_adds_each_layers_last_routing_and_mean_drop():
    job = pb.JobInfo(job_id="j3", steps=3, step=3, state=pb.JOB_STATE_SUCCEEDED)
    steps = [routed(0, 0.02), routed(1, 0.04), routed(2, 0.06)]
    first, *layers = summary(job, steps).splitlines()
    assert first.startswith("j3 succeeded after 3/3 steps; loss 2.0000 -> 2.0000")
    assert layers == [
        "  moe0 load ▄█ max/mean 1.3 drop 6.0% local 100% at step 3; mean drop 4.0% over 3 steps",
        "  moe1 load ██ max/mean 1.0 drop 0.0% local 50% at step 3; mean drop 0.0% over 3 steps",
    ]
    plain = [pb.StepMetrics(loss=5.0, tokens_per_s=10), pb.StepMetrics(loss=2.0)]
    assert expert_summary(plain) == []
    assert "\n" not in summary(job, plain)


def test_the_live_view_shows_the_latest_steps_routing_below_the_bar(capsys):
    job = pb.JobInfo(job_id="j3", steps=2, step=1, state=pb.JOB_STATE_RUNNING, last=routed(0))
    done = pb.JobInfo(job_id="j3", steps=2, step=2, state=pb.JOB_STATE_SUCCEEDED)
    done.last.CopyFrom(routed(1, dropped=0.5))
    follow([pb.JobEvent(job=job), pb.JobEvent(job=done)], plain=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [
        "  moe0 load ▄█ max/mean 1.3 drop 50.0% local 100%",
        "  moe1 load ██ max/mean 1.0 drop 0.0% local 50%",
    ]
