"""A step's MoE routing and its traffic between slices (DCN) on their way to people (pure,
no processes): into the StepMetrics message, as block bars and byte counts, as plain
`slicewise watch` lines every EXPERT_EVERY steps and on the last, below the live bar, and in
the end-of-job summary."""

from __future__ import annotations

import io

import pytest

from controller.jobview import (
    EXPERT_EVERY,
    dcn_line,
    dcn_summary,
    expert_bar,
    expert_line,
    expert_lines,
    expert_summary,
    follow,
    human_bytes,
    max_over_mean,
    shows_experts,
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
    expected.append("j3 succeeded")
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


def test_step_to_pb_carries_the_measured_dcn_traffic():
    record = StepRecord(4, 5.0, 1.0, 1e-3, 0.2, 5000.0, 100.5, (), 1.5e6, 410.5, 10)
    s = step_to_pb(record)
    assert (s.dcn_bytes, s.dcn_segments, s.dcn_window) == (1.5e6, 410.5, 10)
    unmeasured = step_to_pb(StepRecord(4, 5.0, 1.0, 1e-3, 0.2, 5000.0, 100.5))
    assert (unmeasured.dcn_bytes, unmeasured.dcn_segments, unmeasured.dcn_window) == (0, 0, 0)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (12.4, "12 B"),
        (999, "999 B"),
        (999.4, "999 B"),
        (999.6, "1.00 kB"),  # rounds up into the next unit, not to "1000 B"
        (1000, "1.00 kB"),
        (1234, "1.23 kB"),
        (9994, "9.99 kB"),
        (9996, "10.0 kB"),  # "9.996" to 2 decimals is "10.00": 4 digits, so one decimal
        (99_960, "100 kB"),
        (123_456, "123 kB"),
        (999_600, "1.00 MB"),
        (1.5e6, "1.50 MB"),
        (2.5e9, "2.50 GB"),
        (1.5e12, "1500 GB"),  # GB is the largest unit
    ],
)
def test_human_bytes_keeps_three_significant_digits(n, text):
    assert human_bytes(n) == text


PREDICTED = {"dcn_predicted": True, "dcn_bytes_predicted": 1.1e6, "dcn_messages_predicted": 96}


def test_dcn_line_shows_the_measurement_the_prediction_both_or_nothing():
    measured = pb.StepMetrics(step=9, dcn_bytes=1_234_000, dcn_segments=410.4, dcn_window=10)
    unmeasured = pb.StepMetrics(step=9, dcn_bytes=5.0)  # no window: no measurement
    job = pb.JobInfo(job_id="j3", steps=20)
    predicted = pb.JobInfo(job_id="j3", steps=20, **PREDICTED)
    assert dcn_line(job, measured) == "dcn measured 1.23 MB/step, 410 segments/step (over 10 steps)"
    assert dcn_line(predicted, unmeasured) == "dcn predicted 1.10 MB, 96 messages/step"
    assert dcn_line(predicted, measured) == (
        "dcn measured 1.23 MB/step, 410 segments/step (over 10 steps); "
        "predicted 1.10 MB, 96 messages/step"
    )
    assert dcn_line(job, unmeasured) is None
    # A prediction of nothing crossing slices is still a prediction.
    nothing = pb.JobInfo(dcn_predicted=True)
    assert dcn_line(nothing, unmeasured) == "dcn predicted 0 B, 0 messages/step"
    one = pb.StepMetrics(dcn_bytes=800, dcn_segments=2, dcn_window=1)
    assert dcn_line(job, one) == "dcn measured 800 B/step, 2 segments/step (over 1 step)"


def metered(step: int, window: int = 0) -> pb.StepMetrics:
    """A step of a model without MoE layers, measured over `window` steps when not 0."""
    return pb.StepMetrics(
        step=step,
        loss=2.0,
        tokens_per_s=1000,
        step_time_s=0.1,
        dcn_bytes=1_234_000 * bool(window),
        dcn_segments=410 * bool(window),
        dcn_window=window,
    )


def test_plain_follow_shows_dcn_on_the_expert_steps_that_measured_it_and_on_the_last():
    steps = 3 * EXPERT_EVERY + 3
    job = pb.JobInfo(job_id="j3", steps=steps, state=pb.JOB_STATE_RUNNING, **PREDICTED)
    done = pb.JobInfo(
        job_id="j3", steps=steps, step=steps, state=pb.JOB_STATE_SUCCEEDED, **PREDICTED
    )
    # Measured every 5 steps, over those 5, except at step 2 x EXPERT_EVERY.
    reported = [metered(i, 5 if (i + 1) % 5 == 0 else 0) for i in range(steps)]
    reported[2 * EXPERT_EVERY - 1].dcn_window = 0
    assert not any(shows_experts(steps, s) for s in reported)  # no routing to show
    events = [
        pb.JobEvent(job=job, message="attached"),
        pb.JobEvent(job=job, steps=reported[:7]),
        pb.JobEvent(job=job, steps=reported[7:]),
        pb.JobEvent(job=done, message="succeeded"),
    ]
    out = io.StringIO()
    follow(events, plain=True, out=out)

    both = (
        "j3   dcn measured 1.23 MB/step, 410 segments/step (over 5 steps); "
        "predicted 1.10 MB, 96 messages/step"
    )
    expected = ["j3 running: attached"]
    for i in range(steps):
        expected.append(f"j3 step {i + 1}/{steps} loss 2.0000 1,000 tok/s 100 ms/step")
        if i + 1 in (EXPERT_EVERY, 3 * EXPERT_EVERY):
            expected.append(both)
        elif i + 1 == steps:  # unmeasured, but the last: the prediction
            expected.append("j3   dcn predicted 1.10 MB, 96 messages/step")
    expected.append("j3 succeeded")
    assert out.getvalue().splitlines() == expected


def test_plain_follow_puts_the_dcn_line_under_the_routing_and_omits_what_is_missing():
    steps = EXPERT_EVERY + 1
    job = pb.JobInfo(job_id="j3", steps=steps, state=pb.JOB_STATE_RUNNING)  # no prediction
    reported = [routed(i) for i in range(steps)]
    reported[EXPERT_EVERY - 1].MergeFrom(metered(EXPERT_EVERY - 1, window=EXPERT_EVERY))
    out = io.StringIO()
    follow([pb.JobEvent(job=job, steps=reported)], plain=True, out=out)

    routing = [
        "j3   moe0 load ▄█ max/mean 1.3 drop 1.0% local 100%",
        "j3   moe1 load ██ max/mean 1.0 drop 0.0% local 50%",
    ]
    expected = []
    for i in range(steps):
        expected.append(f"j3 step {i + 1}/{steps} loss 2.0000 1,000 tok/s 100 ms/step")
        if i + 1 == EXPERT_EVERY:
            expected += [
                *routing,
                "j3   dcn measured 1.23 MB/step, 410 segments/step (over 10 steps)",
            ]
        elif i + 1 == steps:  # the last step, with nothing measured or predicted
            expected += routing
    assert out.getvalue().splitlines() == expected


def test_the_summary_adds_the_mean_measured_dcn_traffic_and_the_prediction():
    job = pb.JobInfo(job_id="j3", steps=30, step=30, state=pb.JOB_STATE_SUCCEEDED)
    steps = [metered(i) for i in range(30)]
    steps[9].MergeFrom(pb.StepMetrics(dcn_bytes=1e6, dcn_segments=100, dcn_window=10))
    steps[19].MergeFrom(pb.StepMetrics(dcn_bytes=2e6, dcn_segments=400, dcn_window=20))
    first, dcn = summary(job, steps).splitlines()
    assert first.startswith("j3 succeeded after 30/30 steps")
    # Weighted by window: (10 x 1 MB + 20 x 2 MB) / 30, (10 x 100 + 20 x 400) / 30.
    assert dcn == "  dcn 1.67 MB/step measured over 30 steps (300 segments/step)"
    predicted = pb.JobInfo(job_id="j3", steps=30, step=30, **PREDICTED)
    assert dcn_summary(predicted, steps) == f"{dcn}; predicted 1.10 MB, 96 messages/step"
    unmeasured = [metered(i) for i in range(30)]
    assert dcn_summary(predicted, unmeasured) is None  # a prediction alone adds no line
    assert "\n" not in summary(predicted, unmeasured)
    routed_and_measured = [routed(0), routed(1)]
    routed_and_measured[1].MergeFrom(metered(1, window=2))
    *_, layer1, line = summary(job, routed_and_measured).splitlines()
    assert layer1.startswith("  moe1 ") and line.startswith("  dcn 1.23 MB/step measured over 2 ")


def test_the_live_view_keeps_the_latest_measurement_below_the_routing(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # a terminal wide enough not to wrap the dcn line
    job = pb.JobInfo(job_id="j3", steps=3, step=1, state=pb.JOB_STATE_RUNNING, **PREDICTED)
    first = routed(0)
    first.MergeFrom(metered(0, window=1))
    job.last.CopyFrom(first)
    later = pb.JobInfo()
    later.CopyFrom(job)
    later.step = 2
    # The routing is the latest step's; it measured nothing, so the dcn line stays the first's.
    later.last.CopyFrom(routed(1, dropped=0.5))
    follow([pb.JobEvent(job=job), pb.JobEvent(job=later)], plain=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:] == [
        "  moe0 load ▄█ max/mean 1.3 drop 50.0% local 100%",
        "  moe1 load ██ max/mean 1.0 drop 0.0% local 50%",
        "  dcn measured 1.23 MB/step, 410 segments/step (over 1 step); "
        "predicted 1.10 MB, 96 messages/step",
    ]


def test_the_live_view_shows_a_prediction_before_any_measurement(capsys):
    job = pb.JobInfo(job_id="j3", steps=3, state=pb.JOB_STATE_RUNNING, **PREDICTED)
    follow([pb.JobEvent(job=job)], plain=False)
    assert capsys.readouterr().out.splitlines()[-1] == "  dcn predicted 1.10 MB, 96 messages/step"
