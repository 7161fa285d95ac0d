"""The job state machine, job specs, step records and the SQLite journal (pure, no
processes)."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import REGISTRY

from controller.gangstate import GangState
from controller.job import Job, JobSpec, JobState
from controller.jobs import JobRunner, check_preemption_budget, step_record, step_seconds
from controller.journal import Journal, StepRecord
from slicewise.common.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    InvalidTransitionError,
    ProgramMismatchError,
)
from slicewise.common.mesh import GangShape, MeshAxis


def spec(**kw):
    base = dict(program="lm", num_slices=2, slice_type="v5litepod-4", steps=10)
    return JobSpec(**(base | kw))


@pytest.mark.parametrize(
    "kw, on",
    [
        ({}, True),  # two slices, data parallel over them by default
        ({"mesh": (("data", 2, 1), ("fsdp", 1, 4))}, True),
        ({"num_slices": 1}, False),  # no other slice to hold a replica
        ({"mesh": (("expert", 2, 4),)}, False),  # experts split over the slices
        ({"elastic_min_slices": 1}, False),  # continues from its checkpoint instead
        ({"gang_id": "g1-abc"}, False),  # the client's gang
        ({"peer_recovery": False}, False),  # said so
    ],
    ids=["default", "data-mesh", "one-slice", "experts", "elastic", "held-gang", "off"],
)
def test_peer_recovery_is_on_whenever_every_slice_holds_a_replica(kw, on):
    assert spec(**kw).peer_recovery is on


def test_peer_recovery_asked_for_where_no_slice_holds_a_replica_is_refused():
    with pytest.raises(InvalidRequestError, match="only the 'data' axis may span slices"):
        spec(mesh=(("expert", 2, 4),), peer_recovery=True)


def test_the_normal_life_of_a_job():
    job = Job("j1", spec())
    for state in (JobState.ADMITTED, JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED):
        job.transition(state)
    assert job.state is JobState.SUCCEEDED and job.epoch == 1


def test_the_step_deadlines_follow_the_slowest_of_the_latest_steps_not_of_all():
    from controller.job import DEADLINE_STEPS

    job = Job("j1", spec())
    job.compiled_at = 0
    job.note_step_time(0, 9.0)  # the start's first step: it compiled the program
    assert job.slowest_step_s == 0.0
    job.note_step_time(1, 1.1)  # slowed once, beside a recovery's last work
    for step in range(2, 2 + DEADLINE_STEPS - 1):
        job.note_step_time(step, 0.15)
    assert job.slowest_step_s == 1.1  # still among the latest
    job.note_step_time(DEADLINE_STEPS + 1, 0.2)
    assert job.slowest_step_s == 0.2  # forgotten once older than the latest


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ((), JobState.RUNNING),  # queued cannot run
        ((JobState.ADMITTED,), JobState.SUCCEEDED),  # nor succeed unstarted
        ((JobState.CANCELLED,), JobState.RUNNING),  # terminal states are final
        (
            (JobState.ADMITTED, JobState.STARTING, JobState.RUNNING, JobState.FAILED),
            JobState.RECOVERING,
        ),
    ],
)
def test_transitions_outside_the_table_are_refused(path, bad):
    job = Job("j1", spec())
    for state in path:
        job.transition(state)
    with pytest.raises(InvalidTransitionError):
        job.transition(bad)


def test_a_preempted_job_waits_queued_and_starts_again_in_a_new_epoch():
    job = Job("j1", spec())
    for state in (JobState.ADMITTED, JobState.STARTING, JobState.RUNNING, JobState.QUEUED):
        job.transition(state)
    job.transition(JobState.ADMITTED)
    job.transition(JobState.STARTING)
    assert job.epoch == 2
    job.transition(JobState.QUEUED)  # preempted again before it ran
    job.transition(JobState.CANCELLED)  # a waiting job can be cancelled
    with pytest.raises(InvalidTransitionError):
        job.transition(JobState.QUEUED)


def test_each_start_bumps_the_epoch_and_stale_epochs_are_ignored():
    job = Job("j1", spec())
    job.transition(JobState.ADMITTED)
    job.transition(JobState.STARTING)
    job.transition(JobState.RUNNING)
    job.transition(JobState.RECOVERING)
    job.transition(JobState.STARTING)
    assert job.epoch == 2
    job.transition(JobState.FAILED, epoch=1)  # a late reply from the first start
    assert job.state is JobState.STARTING
    job.transition(JobState.RUNNING, epoch=2)
    assert job.state is JobState.RUNNING


def test_job_specs_refuse_what_cannot_run():
    with pytest.raises(InvalidRequestError, match="steps must be at least 1"):
        spec(steps=0)
    with pytest.raises(InvalidRequestError, match="at least 1 slice"):
        spec(num_slices=0)
    with pytest.raises(InvalidRequestError, match="mesh axis 'model' has no role"):
        spec(mesh=(("model", 1, 4),))


def test_default_mesh_is_data_over_slices_and_fsdp_inside():
    mesh = spec().mesh_for(GangShape(2, 1, 4))
    assert mesh.axes == (MeshAxis("data", 2, 1), MeshAxis("fsdp", 1, 4))
    custom = spec(mesh=(("data", 2, 1), ("fsdp", 1, 2), ("tensor", 1, 2))).mesh_for(
        GangShape(2, 1, 4)
    )
    assert custom.shape == (2, 2, 2)
    with pytest.raises(ProgramMismatchError, match="ICI parts to 4"):
        spec(mesh=(("data", 2, 1), ("fsdp", 1, 8))).mesh_for(GangShape(2, 1, 4))


def test_a_mesh_given_only_across_or_only_inside_slices_gets_the_default_for_the_other():
    def axes(mesh):
        return [(a.name, a.dcn, a.ici) for a in spec(mesh=mesh).mesh_for(GangShape(2, 1, 4)).axes]

    assert axes((("expert", 2, 1),)) == [("expert", 2, 1), ("fsdp", 1, 4)]
    assert axes((("tensor", 1, 4),)) == [("data", 2, 1), ("tensor", 1, 4)]
    # An axis that spans both is left as given: the gang must then match it exactly.
    assert axes((("expert", 2, 4),)) == [("expert", 2, 4)]
    with pytest.raises(ProgramMismatchError, match="ICI parts to 4"):
        spec(mesh=(("expert", 2, 2),)).mesh_for(GangShape(2, 1, 4))
    with pytest.raises(InvalidRequestError, match="'expert' \\(expert parallel\\)"):
        spec(mesh=(("experts", 2, 1),))


def test_journal_keeps_jobs_and_steps(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    assert journal.next_job_number() == 1
    journal.add_job("j1", 1, spec().to_json(), "queued", 100.0)
    journal.update_job("j1", 101.0, state="running", step=2, gang_id="g4")
    journal.add_steps(
        "j1",
        [
            StepRecord(0, 5.5, 1.0, 1e-3, 0.2, 5000.0, 100.5),
            StepRecord(1, 5.0, 0.9, 2e-3, 0.1, 10000.0, 100.6),
        ],
    )
    journal.close()

    again = Journal(tmp_path / "j.sqlite")  # a new process would see the same
    (record,) = again.jobs()
    assert record["state"] == "running" and record["step"] == 2 and record["gang_id"] == "g4"
    assert record["spec"]["program"] == "lm" and record["updated_at"] == 101.0
    assert [s.loss for s in again.steps("j1")] == [5.5, 5.0]
    assert [s.step for s in again.steps("j1", since=1)] == [1]
    assert again.next_job_number() == 2
    with pytest.raises(ValueError, match="unknown job fields"):
        again.update_job("j1", 102.0, colour="red")


def test_a_restarted_controller_queues_unfinished_jobs_to_continue(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    journal.add_job("j1", 1, spec().to_json(), "running", 100.0)
    journal.update_job("j1", 101.0, step=7, committed_step=5, preemptions=1)
    journal.add_job("j2", 2, spec().to_json(), "succeeded", 100.0)
    journal.add_job("j3", 3, spec(gang_id="g2").to_json(), "running", 100.0)
    journal.add_steps("j1", [StepRecord(0, 5.5, 1.0, 1e-3, 0.2, 5000.0, 100.5)])
    runner = JobRunner(controller=None, journal=journal)
    j1 = runner.jobs["j1"]
    assert j1.state is JobState.QUEUED and j1.restarts == 1
    assert (j1.step, j1.committed_step, j1.preemptions) == (7, 5, 1)
    assert j1.last.loss == 5.5
    assert runner.jobs["j2"].state is JobState.SUCCEEDED
    # A job on a gang its client held cannot continue: that gang died with the controller.
    assert runner.jobs["j3"].state is JobState.FAILED
    assert (
        "gang g2" in runner.jobs["j3"].error and "submit the job again" in runner.jobs["j3"].error
    )
    assert {j["job_id"]: (j["state"], j["restarts"]) for j in journal.jobs()} == {
        "j1": ("queued", 1),
        "j2": ("succeeded", 0),
        "j3": ("failed", 0),
    }
    assert runner._unfinished == [j1]
    assert JobRunner(controller=None, journal=journal).jobs["j1"].restarts == 2


def test_journal_counters_and_gangs_survive_a_reopen(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    assert [journal.next_number("gang") for _ in range(3)] == [1, 2, 3]
    assert journal.next_number("other") == 1
    journal.add_gang("g1", "alice", ["slice-0", "slice-1"], 100.0)
    journal.add_gang("g2", "bob", ["slice-2"], 101.0)
    journal.end_gang("g1", "was released", 102.0)
    journal.end_gang("g1", "a second end is ignored", 103.0)
    journal.close()

    again = Journal(tmp_path / "j.sqlite")
    assert again.next_number("gang") == 4
    assert again.running_gangs() == [("g2", "bob")]
    assert again.ended_gangs(10) == [("g1", "was released")]
    again.end_gang("g2", "was lost", 104.0)
    assert again.ended_gangs(10) == [("g1", "was released"), ("g2", "was lost")]
    assert again.ended_gangs(1) == [("g2", "was lost")]


MS = 1_000_000  # nanoseconds


def test_a_steps_time_is_the_longest_any_host_ran_it_each_by_its_own_clock():
    # Host 1's clock is 5 s ahead of host 0's; only intervals are compared.
    ran = {0: (1_000 * MS, 1_300 * MS), 1: (6_050 * MS, 6_310 * MS)}
    assert step_seconds(ran) == pytest.approx(0.3)
    assert step_seconds({0: (0, 250 * MS)}) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="no worker reported"):
        step_seconds({})


def test_a_step_record_is_the_reported_metrics_and_the_workers_time():
    ran = {0: (10_000 * MS, 10_400 * MS), 1: (10_100 * MS, 10_450 * MS)}
    record = step_record(7, np.array([1.5, 3e-4, 2.25], np.float32), ran, tokens=8192)
    assert (record.step, record.grad_norm, record.loss) == (7, 1.5, 2.25)
    assert record.learning_rate == pytest.approx(3e-4)
    assert record.step_time_s == pytest.approx(0.4)
    assert record.tokens_per_s == pytest.approx(8192 / 0.4)
    assert record.wall_time == pytest.approx(10.45)  # when the last host finished


def test_the_runner_records_the_workers_step_time_however_late_the_completion_came():
    journal = Journal(":memory:")
    runner = JobRunner(controller=None, journal=journal)
    job = Job("j9", spec())
    runner.jobs[job.job_id] = job
    before = REGISTRY.get_sample_value("slicewise_step_seconds_sum") or 0.0

    async def scenario():
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)  # the controller may read it any time after the step ran
        ticket = SimpleNamespace(
            done=done,
            values=(np.array([1.0, 1e-3, 4.0], np.float32),),
            ran={0: (0, 300 * MS), 1: (5 * MS, 290 * MS)},
        )
        await runner._record(job, 0, ticket, tokens=600)

    asyncio.run(scenario())
    (record,) = journal.steps("j9")
    assert record == job.last
    assert (record.step_time_s, record.tokens_per_s) == (pytest.approx(0.3), pytest.approx(2000))
    assert job.step == 1
    after = REGISTRY.get_sample_value("slicewise_step_seconds_sum")
    assert after - before == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("state", "stopping_to", "epoch", "lost"),
    [
        (GangState.PREEMPTING, None, 1, False),  # told, still running: it may yield
        (GangState.STOPPING, GangState.PREEMPTED, 1, True),  # the grace ran out
        (GangState.PREEMPTED, None, 1, True),
        (GangState.READY, None, 2, True),  # stopped and started again meanwhile
        (GangState.FAILED, None, 1, False),  # a failure is not a preemption
    ],
)
def test_a_gang_stopped_by_preemption_makes_its_job_resume(state, stopping_to, epoch, lost):
    runner = JobRunner(controller=None, journal=Journal(":memory:"))
    gang = SimpleNamespace(
        gang_id="g2", state=state, stopping_to=stopping_to, epoch=epoch, preempted_by="g3"
    )
    assert runner._lost_to_preemption(Job("j1", spec()), gang, 1) is lost


def test_a_job_on_a_gang_its_client_holds_fails_clearly_when_that_gang_is_preempted():
    runner = JobRunner(controller=None, journal=Journal(":memory:"))
    gang = SimpleNamespace(
        gang_id="g2", state=GangState.PREEMPTED, stopping_to=None, epoch=1, preempted_by="g3"
    )
    job = Job("j1", spec(gang_id="g2"), committed_step=20)
    with pytest.raises(FailedPreconditionError, match="its client holds, was preempted by g3"):
        runner._lost_to_preemption(job, gang, 1)


def test_a_job_recovers_from_its_own_gangs_failures_until_its_budget_is_spent(tmp_path):
    runner = JobRunner(controller=None, journal=Journal(tmp_path / "j.sqlite"))
    failed = SimpleNamespace(state=GangState.FAILED, why="host 1 of slice s1 was lost")
    job = Job("j1", spec(max_failures=2))
    assert runner._recoverable(job, failed, RuntimeError("step 7 failed")) == failed.why
    # Not for a gang that did not fail (the job's own error), a cancel, a stopping
    # controller, or a gang its client holds.
    ready = SimpleNamespace(state=GangState.READY, why="")
    assert runner._recoverable(job, ready, RuntimeError("bad config")) is None
    for changed in (
        {"cancel_requested": True},
        {"interrupted": True},
        {"spec": spec(gang_id="g3")},
    ):
        other = Job("j2", spec())
        for name, value in changed.items():
            setattr(other, name, value)
        assert runner._recoverable(other, failed, RuntimeError()) is None
    job.failures = 2
    with pytest.raises(FailedPreconditionError, match=r"budget is spent \(2 of 2 .*s1 was lost"):
        runner._recoverable(job, failed, RuntimeError())
    with pytest.raises(InvalidRequestError, match="max_failures must be >= 0"):
        spec(max_failures=-1)


def test_a_job_can_recover_from_starting_or_running_but_not_once_ended():
    for path in (
        (JobState.ADMITTED, JobState.STARTING),
        (JobState.ADMITTED, JobState.STARTING, JobState.RUNNING),
    ):
        job = Job("j1", spec())
        for state in path:
            job.transition(state)
        job.transition(JobState.RECOVERING)
        job.transition(JobState.STARTING)
        assert job.epoch == 2


def test_an_elastic_jobs_data_axis_spans_the_slices_its_gang_has():
    elastic = spec(num_slices=4, elastic_min_slices=2)
    assert [(a.name, a.dcn, a.ici) for a in elastic.mesh_for(GangShape(2, 1, 4)).axes] == [
        ("data", 2, 1),
        ("fsdp", 1, 4),
    ]
    explicit = spec(num_slices=4, elastic_min_slices=1, mesh=(("data", 4, 2), ("tensor", 1, 2)))
    assert [(a.name, a.dcn, a.ici) for a in explicit.mesh_for(GangShape(3, 1, 4)).axes] == [
        ("data", 3, 2),
        ("tensor", 1, 2),
    ]


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"elastic_min_slices": 3}, "between 1 and the job's 2 slice"),
        ({"elastic_min_slices": 1, "checkpoint_every": 0}, "needs checkpoints"),
        ({"elastic_min_slices": 1, "gang_id": "g1"}, "a gang of its own"),
        (
            {"elastic_min_slices": 1, "mesh": (("data", 1, 2), ("fsdp", 2, 2))},
            "mesh axis 'fsdp' spans 2",
        ),
    ],
)
def test_an_elastic_job_that_cannot_shrink_is_refused(kw, words):
    with pytest.raises(InvalidRequestError, match=words):
        spec(**kw)


@pytest.mark.parametrize(
    ("state", "free", "minimum", "take"),
    [
        (JobState.QUEUED, 1, 1, 4),  # a first start asks for all
        (JobState.RECOVERING, 4, 1, 4),  # enough free: all
        (JobState.RECOVERING, 3, 1, 3),  # one lost, no spare: the rest
        (JobState.RECOVERING, 1, 2, 2),  # fewer free than its minimum: waits for that
        (JobState.RECOVERING, 0, 0, 4),  # not elastic: all
    ],
)
def test_an_elastic_job_recovers_on_the_slices_that_are_free(state, free, minimum, take):
    scheduler = SimpleNamespace(free_slices=lambda stype: [f"s{i}" for i in range(free)])
    runner = JobRunner(controller=SimpleNamespace(scheduler=scheduler), journal=Journal(":memory:"))
    job = Job("j1", spec(num_slices=4, elastic_min_slices=minimum), state)
    assert runner._slices_to_take(job) == take


def test_a_job_preempted_past_its_budget_fails_saying_so():
    job = Job("j1", spec(max_preemptions=2), JobState.RUNNING, committed_step=20)
    job.preemptions = 2
    check_preemption_budget(job, "g7")  # its second preemption: within the budget
    job.preemptions = 3
    with pytest.raises(FailedPreconditionError, match=r"preempted 3 times \(last by g7\)"):
        check_preemption_budget(job, "g7")
    unlimited = Job("j2", spec(), JobState.RUNNING)
    unlimited.preemptions = 1000
    check_preemption_budget(unlimited, "g7")


def test_a_negative_preemption_budget_is_refused():
    with pytest.raises(InvalidRequestError, match="max_preemptions must be >= 0"):
        spec(max_preemptions=-1)


def test_steps_done_count_the_completed_ones_queued_behind_the_recorded_step():
    from controller.jobs import completed_steps

    class Ticket:
        def __init__(self, done: bool):
            self.done = type("F", (), {"done": lambda _self, d=done: d})()

    assert completed_steps(9, []) == 10
    ahead = [(10, Ticket(True)), (11, Ticket(True)), (12, Ticket(False)), (13, Ticket(True))]
    # Up to the first step not done: a later one done out of order does not count yet.
    assert completed_steps(9, ahead) == 12
