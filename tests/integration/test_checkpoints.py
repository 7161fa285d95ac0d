"""Checkpoints of a 2-slice training job: written by the workers while training goes on,
committed steps only, journalled; and a job started on the same directory resumes where
the first one ended with, step for step, the loss of an uninterrupted run, bit for bit."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from controller.jobview import TERMINAL
from programs.lm.config import SMALL_OVERRIDES
from protos import controller_pb2 as pb
from slicewise.common.checkpoints import COMMIT_FILE, committed_steps
from slicewise.testing import wait_until

pytestmark = pytest.mark.integration

# The same config for every job here: the schedule (total_steps) shapes the learning
# rate of every step, so an uninterrupted run and a resumed one must share it.
CONFIG = SMALL_OVERRIDES | {"total_steps": "40", "seed": "3"}
FIRST, RESUMED = 25, 35
EVERY = 10


def finished(client, job_id: str) -> tuple[pb.JobInfo, list[pb.StepMetrics]]:
    """The job's info and steps once it has succeeded."""

    def ended():
        info = client.job(job_id)
        return info if info.state in TERMINAL else None

    done = wait_until(ended, timeout_s=600, interval_s=0.5, what=f"job {job_id} to end")
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    return done, list(client.job_metrics(job_id).steps)


def submit_lm(client, steps: int, **kwargs) -> pb.JobInfo:
    """Submits an `lm` job of CONFIG on 2 x v5litepod-4 (other settings: `kwargs`)."""
    return client.submit_job(
        "lm", slices=2, slice_type="v5litepod-4", steps=steps, overrides=CONFIG, **kwargs
    )


def run_job(client, steps: int, **kwargs) -> tuple[pb.JobInfo, list[pb.StepMetrics]]:
    """Runs a 2 x v5litepod-4 `lm` job to its end; returns its info and its steps."""
    return finished(client, submit_lm(client, steps, **kwargs).job_id)


def assert_losses_match(steps, reference_steps, after: str) -> None:
    """Each step's loss equals, bit for bit, the reference run's loss of that step; the
    message names the steps that differ and the largest difference."""
    want = {s.step: s.loss for s in reference_steps}
    got = {s.step: s.loss for s in steps}
    differences = {s: abs(got[s] - want[s]) for s in got if got[s] != want[s]}
    assert not differences, (
        f"losses {after} differ from the uninterrupted run at steps {sorted(differences)}; "
        f"largest difference {max(differences.values()):.3e}"
    )


def watch_messages(client, job_id: str) -> tuple[threading.Thread, list[str]]:
    """Follows the job's event stream in a thread; returns it and the list its events'
    messages are appended to (join the thread once the job has ended)."""
    messages: list[str] = []
    watcher = threading.Thread(
        target=lambda: messages.extend(e.message for e in client.watch_job(job_id)),
        daemon=True,
    )
    watcher.start()
    return watcher, messages


def cli(controller, *args, cwd=None) -> str:
    """Runs `slicewise ARGS` against the controller; returns what it printed."""
    done = subprocess.run(
        [sys.executable, "-P", "-m", "controller.cli", *args]
        + ["--controller", controller.address],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def checkpointed(client, tmp_path_factory):
    """The first job: FIRST steps, a checkpoint every EVERY steps into a fresh directory."""
    directory = tmp_path_factory.mktemp("checkpoints") / "lm"
    done, steps = run_job(client, FIRST, checkpoint_every=EVERY, checkpoint_dir=str(directory))
    return directory, done, steps


@pytest.fixture(scope="module")
def uninterrupted(lm_reference):
    """The reference: CONFIG in one go, no checkpoints."""
    return lm_reference


def test_committed_steps_are_the_scheduled_ones_and_journalled(controller, checkpointed):
    directory, done, steps = checkpointed
    assert [s.step for s in steps] == list(range(FIRST))
    on_disk = sorted(p.name for p in directory.iterdir())
    assert on_disk == ["10", "20", "25"], "a partial or stray step was left behind"
    for name in on_disk:
        assert (directory / name / COMMIT_FILE).is_file()
    assert done.HasField("committed_step") and done.committed_step == FIRST
    assert (done.checkpoint_every, done.checkpoint_dir) == (EVERY, str(directory))

    assert f"last committed checkpoint: step {FIRST}" in cli(controller, "jobs", done.job_id)


def test_a_job_on_the_same_directory_resumes_with_the_uninterrupted_losses(
    controller, client, checkpointed, uninterrupted
):
    directory, first, first_steps = checkpointed
    reference, reference_steps = uninterrupted
    assert not reference.HasField("committed_step")
    want = {s.step: s.loss for s in reference_steps}
    # The runs agree where they overlap: the same seed gives the same numbers.
    assert [s.loss for s in first_steps] == [want[s] for s in range(FIRST)]

    # From the command line, naming the directory relative to where it runs.
    settings = [f"--set={k}={v}" for k, v in CONFIG.items()]
    printed = cli(
        controller,
        "train",
        "lm",
        "--slices=2",
        "--slice-type=v5litepod-4",
        f"--steps={RESUMED}",
        *settings,
        f"--checkpoint-every={EVERY}",
        f"--checkpoint-dir={directory.name}",
        "--detach",
        cwd=directory.parent,
    )
    resumed, steps = finished(client, printed.strip())
    assert resumed.checkpoint_dir == str(directory)
    assert [s.step for s in steps] == list(range(FIRST, RESUMED)), "it did not resume"
    assert_losses_match(steps, reference_steps, "after the resume")
    assert resumed.committed_step == RESUMED
    # The newest three are kept (the default), the first job's older steps included.
    assert resumed.keep_checkpoints == 3
    assert sorted(int(p.name) for p in directory.iterdir()) == [25, 30, 35]


def test_a_job_keeps_its_newest_k_checkpoints_and_the_marked_steps(controller, client, tmp_path):
    directory = tmp_path / "kept"
    done, _ = run_job(
        client,
        25,
        checkpoint_every=5,
        checkpoint_dir=str(directory),
        keep_checkpoints=2,
        keep_steps=[10],
    )
    assert (done.keep_checkpoints, list(done.keep_steps)) == (2, [10])
    assert committed_steps(directory) == [10, 20, 25]
    assert sorted(int(p.name) for p in directory.iterdir()) == [10, 20, 25]
    assert "keeping the newest 2 and step 10" in cli(controller, "jobs", done.job_id)
    # A held step can be marked afterwards; a deleted one cannot, and it says why.
    assert "step 20 will be kept" in cli(controller, "keep", done.job_id, "20")
    refused = subprocess.run(
        [sys.executable, "-P", "-m", "controller.cli", "keep", done.job_id, "15"]
        + ["--controller", controller.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1
    assert "holds no checkpoint of step 15" in refused.stderr
    assert list(client.job(done.job_id).keep_steps) == [10, 20]
