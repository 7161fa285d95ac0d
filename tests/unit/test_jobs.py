"""The job state machine, job specs and the SQLite journal (pure, no processes)."""

import pytest

from controller.jobs import InvalidTransitionError, Job, JobRunner, JobSpec, JobState
from controller.journal import Journal, StepRecord
from slicewise.common.errors import InvalidRequestError, ProgramMismatchError
from slicewise.common.mesh import GangShape, MeshAxis


def spec(**kw):
    base = dict(program="lm", num_slices=2, slice_type="v5litepod-4", steps=10)
    return JobSpec(**(base | kw))


def test_the_normal_life_of_a_job():
    job = Job("j1", spec())
    for state in (JobState.ADMITTED, JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED):
        job.transition(state)
    assert job.state is JobState.SUCCEEDED and job.epoch == 1


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


def test_a_restarted_controller_marks_unfinished_jobs_failed(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    journal.add_job("j1", 1, spec().to_json(), "running", 100.0)
    journal.add_job("j2", 2, spec().to_json(), "succeeded", 100.0)
    journal.add_steps("j1", [StepRecord(0, 5.5, 1.0, 1e-3, 0.2, 5000.0, 100.5)])
    runner = JobRunner(controller=None, journal=journal)
    assert runner.jobs["j1"].state is JobState.FAILED
    assert runner.jobs["j1"].error == "the controller restarted"
    assert runner.jobs["j2"].state is JobState.SUCCEEDED
    assert runner.jobs["j1"].last.loss == 5.5
    assert {j["job_id"]: j["state"] for j in journal.jobs()} == {"j1": "failed", "j2": "succeeded"}
