"""`slicewise status` and the job views render what the controller reports."""

import io

from rich.console import Console

from controller.jobview import follow, step_line, step_time, summary
from controller.status import print_status
from protos import controller_pb2 as pb


def render(*args):
    out = io.StringIO()
    print_status(*args, console=Console(file=out, width=200))
    return out.getvalue()


def test_status_shows_slices_gangs_shares_queue_and_jobs():
    info = pb.ClusterInfo(
        simulated=True,
        slices=[
            pb.SliceInfo(
                name="sim-0-v5litepod-4",
                slice_type="v5litepod-4",
                topology="2x2",
                chips=4,
                state=pb.SLICE_STATE_HELD,
                holder_gang="g3",
                hosts=[pb.HostInfo(alive=True, chips=4)],
            ),
            pb.SliceInfo(
                name="sim-1-v5litepod-4",
                slice_type="v5litepod-4",
                topology="2x2",
                chips=4,
                state=pb.SLICE_STATE_BROKEN,
                hosts=[pb.HostInfo(alive=False)],
            ),
        ],
        gangs=[
            pb.GangSummary(
                gang_id="g3",
                client="alice",
                state="ready",
                priority=2,
                slice_type="v5litepod-4",
                slices=["sim-0-v5litepod-4"],
                shared_name="team",
                dispatched=10,
                completed=9,
                shares=[
                    pb.ClientShare(attachment="a1", client="alice", weight=1, programs_run=5),
                    pb.ClientShare(attachment="a2", client="bob", weight=2, programs_run=10),
                ],
            )
        ],
        queue=[
            pb.QueuedRequest(
                request_id="g4",
                client="carol",
                num_slices=2,
                slice_types=["v5litepod-4"],
                position=0,
                waited_s=12,
                reason="needs 2 free v5litepod-4 slice(s), 0 free now",
            )
        ],
    )
    jobs = [
        pb.JobInfo(
            job_id="j1",
            program="lm",
            state=pb.JOB_STATE_RUNNING,
            step=5,
            steps=10,
            num_slices=1,
            slice_type="v5litepod-4",
            last=pb.StepMetrics(loss=3.25, step_time_s=0.1, tokens_per_s=1000),
        )
    ]
    text = render(pb.HealthResponse(version="0.1.0", uptime_s=5), info, jobs)
    for expected in (
        "sim-0-v5litepod-4",
        "held",
        "broken",
        "0/1",
        "g3 (team)",
        "alice w=1 ran 5",
        "bob w=2 ran 10",
        "Admission queue",
        "carol",
        "2 x v5litepod-4",
        "0 free now",
        "12 s",
        "j1",
        "running",
        "5/10",
        "3.2500",
        "100 ms",
    ):
        assert expected in text, expected


def test_plain_follow_prints_each_step_and_state_change():
    job = pb.JobInfo(job_id="j2", steps=3, state=pb.JOB_STATE_RUNNING)
    done = pb.JobInfo(job_id="j2", steps=3, step=3, state=pb.JOB_STATE_SUCCEEDED)
    events = [
        pb.JobEvent(job=job, message="attached"),
        pb.JobEvent(
            job=job, steps=[pb.StepMetrics(step=0, loss=5.0, tokens_per_s=10, step_time_s=0.5)]
        ),
        pb.JobEvent(job=done, message="succeeded"),
    ]
    out = io.StringIO()
    final = follow(events, plain=True, out=out)
    lines = out.getvalue().splitlines()
    assert final.state == pb.JOB_STATE_SUCCEEDED
    assert lines == [
        "j2 running: attached",
        "j2 step 1/3 loss 5.0000 10 tok/s 500 ms/step",
        "j2 succeeded",
    ]
    assert step_line("j2", 3, pb.StepMetrics(step=2, loss=1.5)).startswith("j2 step 3/3")
    steps = [pb.StepMetrics(loss=5.0, tokens_per_s=10), pb.StepMetrics(loss=2.0, tokens_per_s=30)]
    assert "loss 5.0000 -> 2.0000" in summary(done, steps)


def test_step_times_read_well_from_microseconds_to_seconds():
    assert [step_time(s) for s in (0.00042, 0.0042, 0.312, 2.5)] == [
        "0.42 ms",
        "4.2 ms",
        "312 ms",
        "2.50 s",
    ]


def test_summary_throughput_is_tokens_over_time_not_the_mean_of_rates():
    job = pb.JobInfo(job_id="j3", steps=2, step=2, state=pb.JOB_STATE_SUCCEEDED)
    # 1,000 tokens per step: one step of 0.1 s and one of 0.9 s make 2,000 tokens a second.
    steps = [
        pb.StepMetrics(loss=5.0, step_time_s=0.1, tokens_per_s=10_000),
        pb.StepMetrics(loss=4.0, step_time_s=0.9, tokens_per_s=1_000 / 0.9),
    ]
    assert "2,000 tok/s over the last 2 steps" in summary(job, steps)


def test_the_live_view_names_the_end_state_once(capsys):
    """A move to a state with nothing more to say shows in the progress line only (it
    printed 'j2 succeeded: succeeded' above the line, which said 'j2 succeeded' too)."""
    job = pb.JobInfo(job_id="j2", steps=3, state=pb.JOB_STATE_RUNNING)
    done = pb.JobInfo(job_id="j2", steps=3, step=3, state=pb.JOB_STATE_SUCCEEDED)
    events = [
        pb.JobEvent(job=job, message="attached"),
        pb.JobEvent(job=job, message="running: mesh (data=2(dcn)), restored step 0"),
        pb.JobEvent(job=done, message="succeeded"),
    ]
    follow(events, plain=False)
    text = capsys.readouterr().out
    assert text.count("succeeded") == 1, text
    assert "restored step 0" in text  # a message with something to say is printed
