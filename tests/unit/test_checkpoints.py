"""The controller's side of checkpoints (pure, no processes): the save schedule, commit
markers in storage, where a job resumes, the journal's committed step (and its migration
from journals written before it existed), and how the job loop journals commits."""

from __future__ import annotations

import asyncio
import sqlite3
from types import SimpleNamespace

import orbax.checkpoint as ocp
import pytest

from controller.checkpoints import resume_step, save_steps, yield_save
from controller.job import DEFAULT_CHECKPOINT_EVERY, Job, JobSpec, _spec_from_json
from controller.jobs import JobRunner
from controller.journal import Journal
from slicewise.common.checkpoints import COMMIT_FILE, committed_steps, is_committed
from slicewise.common.errors import FailedPreconditionError, InvalidRequestError


def spec(**kw):
    base = dict(program="lm", num_slices=2, slice_type="v5litepod-4", steps=25)
    return JobSpec(**(base | kw))


def commit(directory, step):
    (directory / str(step)).mkdir(parents=True)
    (directory / str(step) / COMMIT_FILE).write_text("committed")


def test_the_marker_is_the_one_orbax_writes():
    assert COMMIT_FILE == ocp.path.atomicity_types.COMMIT_SUCCESS_FILE


@pytest.mark.parametrize(
    ("first", "last", "every", "saves"),
    [
        (0, 25, 10, [10, 20, 25]),  # every 10th, and the last
        (0, 20, 10, [10, 20]),  # the last is one of them anyway
        (25, 35, 10, [30, 35]),  # resumed: counts from step 0, not from the resume
        (20, 20, 10, []),  # nothing left to train: nothing new to save
        (0, 25, 0, []),  # off
        (0, 3, 50, [3]),  # shorter than the interval: only the last
    ],
)
def test_the_save_schedule(first, last, every, saves):
    assert save_steps(first, last, every) == saves


def test_only_steps_with_the_marker_are_committed(tmp_path):
    directory = tmp_path / "ckpt"
    assert committed_steps(directory) == []  # not created yet: nothing committed
    commit(directory, 10)
    commit(directory, 20)
    (directory / "30").mkdir()  # written, never committed
    (directory / "40.orbax-checkpoint-tmp-1733000000").mkdir()  # a save cut short
    (directory / "notes").mkdir()
    assert committed_steps(directory) == [10, 20]
    assert is_committed(directory, 20)
    assert not is_committed(directory, 30)
    assert not is_committed(directory, 40)


def test_a_job_resumes_from_the_newest_committed_step_within_its_steps():
    assert resume_step([], None, 25) is None
    assert resume_step([10, 20], None, 25) == 20  # another job's steps count too
    assert resume_step([10, 20], 10, 25) == 20  # storage may be ahead of the journal
    assert resume_step([10, 20, 30], None, 25) == 20  # 30 is past this job's end
    assert resume_step([10, 25], 25, 25) == 25  # all done: restore and train nothing
    with pytest.raises(FailedPreconditionError, match="no longer holds it"):
        resume_step([10], 20, 25)


def test_an_interrupted_job_resumes_no_later_than_its_recorded_steps_when_it_can():
    # Recorded metrics up to step 23; 20 and 24 committed: from 20, so 20-23 run again
    # and record their metrics rather than leave a gap.
    assert resume_step([10, 20, 24], 24, 40, recorded=23) == 20
    assert resume_step([10, 20, 24], 24, 40, recorded=24) == 24
    # Retention deleted everything up to the recorded step: the newest held it is.
    assert resume_step([24, 30], 30, 40, recorded=23) == 30
    assert resume_step([], None, 40, recorded=23) is None


def test_a_job_told_to_yield_saves_the_step_it_reached_unless_saved_already():
    assert yield_save(17, [10]) == 17
    assert yield_save(20, [10, 20]) is None  # its periodic save is queued or committed
    assert yield_save(0, []) is None  # the initial state: nothing to save
    assert yield_save(3, []) == 3


def test_checkpoint_settings_are_checked_and_kept(tmp_path):
    assert spec().checkpoint_every == DEFAULT_CHECKPOINT_EVERY == 50
    with pytest.raises(InvalidRequestError, match="checkpoint_every must be >= 0"):
        spec(checkpoint_every=-1)
    with pytest.raises(InvalidRequestError, match="is relative"):
        spec(checkpoint_dir="ckpt/lm")
    spec(checkpoint_dir="gs://bucket/lm")  # a bucket is fine
    kept = spec(checkpoint_every=10, checkpoint_dir=str(tmp_path))
    assert _spec_from_json(kept.to_json()) == kept
    old = {k: v for k, v in kept.to_json().items() if not k.startswith("checkpoint")}
    assert _spec_from_json(old).checkpoint_every == 0  # journalled before checkpoints


def test_retention_settings_are_checked_and_journalled(tmp_path):
    assert spec().keep_checkpoints == 3
    with pytest.raises(InvalidRequestError, match="keep_checkpoints must be >= 0"):
        spec(keep_checkpoints=-1)
    with pytest.raises(InvalidRequestError, match="saves steps 1 to 25"):
        spec(keep_steps=(26,))
    kept = spec(keep_checkpoints=0, keep_steps=(5, 20), checkpoint_dir=str(tmp_path))
    assert _spec_from_json(kept.to_json()) == kept
    old = {k: v for k, v in kept.to_json().items() if not k.startswith("keep")}
    assert _spec_from_json(old).keep_checkpoints == 0  # journalled before retention


def test_a_checkpoint_step_can_be_marked_to_keep_if_it_is_held_or_coming(tmp_path):
    directory = tmp_path / "ckpt"
    commit(directory, 10)
    journal = Journal(tmp_path / "j.sqlite")
    job_spec = spec(checkpoint_every=10, checkpoint_dir=str(directory))
    journal.add_job("j1", 1, job_spec.to_json(), "running", 1.0)
    journal.update_job("j1", 2.0, step=12)
    runner = JobRunner(controller=None, journal=journal)
    job = runner.jobs["j1"]

    async def marks():
        await runner.keep("j1", 10)  # committed and held
        await runner.keep("j1", 20)  # to be saved
        await runner.keep("j1", 25)  # its last step is always saved
        with pytest.raises(FailedPreconditionError, match="will not save one"):
            await runner.keep("j1", 15)
        with pytest.raises(InvalidRequestError, match="saves steps 1 to 25"):
            await runner.keep("j1", 0)

    asyncio.run(marks())
    assert job.keep_steps == {10, 20, 25}
    again = JobRunner(controller=None, journal=journal)  # journalled
    assert again.jobs["j1"].keep_steps == {10, 20, 25}


OLD_SCHEMA = """
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
    step INTEGER NOT NULL DEFAULT 0, gang_id TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '', epoch INTEGER NOT NULL DEFAULT 0,
    flops_per_step REAL NOT NULL DEFAULT 0, created_at REAL NOT NULL, updated_at REAL NOT NULL
);
INSERT INTO jobs (job_id, seq, spec, state, created_at, updated_at)
VALUES ('j1', 1, '{"program": "lm", "num_slices": 1, "slice_type": "v5litepod-4",
                  "steps": 5, "overrides": {}, "mesh": []}', 'succeeded', 1.0, 1.0);
"""


def test_a_journal_from_before_checkpoints_gains_the_column(tmp_path):
    path = tmp_path / "j.sqlite"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.close()

    journal = Journal(path)
    (old,) = journal.jobs()
    assert old["committed_step"] is None
    journal.add_job("j2", 2, spec().to_json(), "running", 2.0)
    journal.update_job("j2", 3.0, committed_step=20)
    journal.close()

    again = Journal(path)  # opening it twice adds nothing twice
    assert {j["job_id"]: j["committed_step"] for j in again.jobs()} == {"j1": None, "j2": 20}
    runner = JobRunner(controller=None, journal=again, state_dir=tmp_path / "state")
    assert runner.jobs["j2"].committed_step == 20
    assert runner.jobs["j1"].committed_step is None
    assert runner.checkpoint_root == tmp_path / "state" / "checkpoints"


def done_ticket(error=None):
    future = asyncio.get_running_loop().create_future()
    future.set_result(error)
    return SimpleNamespace(done=future)


def test_the_loop_journals_saves_once_their_marker_is_in_storage(tmp_path):
    journal = Journal(":memory:")
    runner = JobRunner(controller=None, journal=journal)
    job = Job("j3", spec(checkpoint_every=10, checkpoint_dir=str(tmp_path)))
    journal.add_job(job.job_id, 3, job.spec.to_json(), "running", 1.0)

    async def scenario():
        copying = asyncio.get_running_loop().create_future()  # workers still copying
        job.saving.extend(
            [(10, done_ticket()), (20, done_ticket()), (25, SimpleNamespace(done=copying))]
        )
        commit(tmp_path, 10)
        await runner._check_commits(job)
        assert job.committed_step == 10 and [s for s, _ in job.saving] == [20, 25]
        await runner._check_commits(job)  # 20 has not committed yet: nothing changes
        assert job.committed_step == 10
        commit(tmp_path, 20)
        commit(tmp_path, 25)
        await runner._check_commits(job)  # 25's save op is not done: not looked at
        assert job.committed_step == 20 and [s for s, _ in job.saving] == [25]
        copying.set_result("RuntimeError: disk full")
        with pytest.raises(FailedPreconditionError, match="checkpoint of step 25 failed"):
            await runner._check_commits(job)

    asyncio.run(scenario())
    assert journal.jobs()[0]["committed_step"] == 20
