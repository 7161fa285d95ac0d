"""Training jobs driven by the controller on simulated slices: the same numbers as a
one-device reference, a loss that goes down, and jobs that outlive their clients."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from controller.jobview import TERMINAL
from programs.base import get_program, reference_train
from programs.lm.config import SMALL_OVERRIDES
from protos import controller_pb2 as pb
from slicewise.common.ids import ID_PATTERN
from slicewise.testing import wait_until

pytestmark = pytest.mark.integration

SMALL = SMALL_OVERRIDES | {"total_steps": "20"}


def wait_for(client, job_id, timeout=240.0):
    """The job, once it has ended."""

    def ended():
        job = client.job(job_id)
        return job if job.state in TERMINAL else None

    return wait_until(ended, timeout_s=timeout, interval_s=0.5, what=f"job {job_id} to end")


def read_lines(proc: subprocess.Popen) -> list[str]:
    """The lines `proc` has printed so far, kept up to date by a thread of their own, so
    that waiting for a line can time out."""
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return lines


STEP_LINE = re.compile(r"^\S+ step \d+/\d+ ")  # not "j1 running: checkpoint step 50 ..."


def steps_in(lines: list[str]) -> list[int]:
    """The step numbers of `JOB step N/TOTAL ...` lines."""
    return [int(ln.split()[2].split("/")[0]) for ln in list(lines) if STEP_LINE.match(ln)]


def cli(controller, *args):
    return [sys.executable, "-P", "-m", "controller.cli", *args, "--controller", controller.address]


def test_sharded_training_matches_a_single_device_reference(client):
    """DP over DCN (2 slices) x FSDP and tensor parallelism over ICI, 20 steps."""
    job = client.submit_job(
        "lm",
        slices=2,
        slice_type="v5litepod-4",
        steps=20,
        overrides=SMALL,
        dcn={"data": 2},
        ici={"fsdp": 2, "tensor": 2},
    )
    done = wait_for(client, job.job_id)
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    assert [a.name for a in done.mesh.axes] == ["data", "fsdp", "tensor"]
    steps = client.job_metrics(job.job_id).steps
    assert [s.step for s in steps] == list(range(20))
    program = get_program("lm")
    reference = reference_train(program, program.make_config(SMALL), 20)
    np.testing.assert_allclose([s.loss for s in steps], reference, rtol=1e-4)
    assert done.flops_per_step > 0


# 60 steps of the small model at a higher learning rate: the loss falls from about 5.6 to
# about 2.7 (the mean of the last 10 steps), well past the threshold below.
TRAINS = SMALL_OVERRIDES | {"total_steps": "60", "learning_rate": "1e-2"}


def test_lm_trains_and_a_second_process_watches_live(client, controller):
    job = client.submit_job("lm", slices=2, slice_type="v5litepod-4", steps=60, overrides=TRAINS)
    watcher = subprocess.Popen(
        cli(controller, "watch", job.job_id, "--plain"), stdout=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    live: list[pb.JobInfo] = []  # the job as it was when the watcher showed step 20

    def read():
        for line in watcher.stdout:
            lines.append(line.strip())
            if line.startswith(f"{job.job_id} step 20/60 "):
                live.append(client.job(job.job_id))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        done = wait_for(client, job.job_id, timeout=600)
        assert watcher.wait(timeout=60) == 0
        reader.join(timeout=10)
    finally:
        watcher.kill()
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    steps = client.job_metrics(job.job_id).steps
    first, last = steps[0].loss, float(np.mean([s.loss for s in steps[-10:]]))
    assert first > 5.0 and last < 3.2, (first, last)
    step_lines = [ln for ln in lines if STEP_LINE.match(ln)]
    assert len(step_lines) == 60, lines[-5:]
    # Live: the watcher showed step 20 while the job was still running, 40 steps from
    # its end, not all the steps once it had ended.
    assert live, "the watcher never showed step 20"
    assert live[0].state == pb.JOB_STATE_RUNNING and live[0].step < 60, live[0]
    summary = [ln for ln in lines if ln.startswith(f"{job.job_id} succeeded after ")]
    assert summary and summary[0].startswith(f"{job.job_id} succeeded after 60/60 steps"), lines
    # Under it, what crossed the DCN: the gradient all-reduce between the two slices.
    assert lines[-1].startswith("dcn ") and "measured over" in lines[-1], lines[-3:]


def test_detach_kill_the_client_rewatch_then_cancel_frees_the_gang(client, controller):
    # --detach returns the id without waiting for the job: here a job that cannot even
    # start, as long as the test holds both v5litepod-4 slices.
    with client.allocate(slices=2, slice_type="v5litepod-4", timeout=120):
        detached = subprocess.run(
            cli(
                controller,
                "train",
                "lm",
                "--slices",
                "1",
                "--slice-type",
                "v5litepod-4",
                "--steps",
                "3",
                "--detach",
                *[f"--set={k}={v}" for k, v in SMALL.items()],
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert detached.returncode == 0, detached.stderr
        short_id = detached.stdout.strip()
        assert ID_PATTERN.fullmatch(short_id) and short_id.startswith("j"), detached.stdout
        assert client.job(short_id).state == pb.JOB_STATE_QUEUED

    # A following client that gets killed: the job goes on.
    follower = subprocess.Popen(
        cli(
            controller,
            "train",
            "lm",
            "--slices",
            "2",
            "--slice-type",
            "v5litepod-4",
            "--steps",
            "100000",
            "--plain",
            *[f"--set={k}={v}" for k, v in SMALL.items()],
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        followed = read_lines(follower)
        wait_until(lambda: followed, timeout_s=60, what="the follower to say what it submitted")
        job_id = followed[0].split()[1].rstrip(":")
        # It queues behind the detached job, then runs.
        wait_until(lambda: steps_in(followed), timeout_s=180, what="the follower to show a step")
    finally:
        follower.send_signal(signal.SIGKILL)
        follower.wait(timeout=30)
    at_kill = client.job(job_id).step

    def moved_on():
        job = client.job(job_id)
        return job if job.step > at_kill or job.state in TERMINAL else None

    running = wait_until(moved_on, timeout_s=60, what=f"job {job_id} to take another step")
    assert running.state == pb.JOB_STATE_RUNNING and running.step > at_kill

    # Re-attach from another process: the stream resumes where the job is now.
    watcher = subprocess.Popen(
        cli(controller, "watch", job_id, "--plain"), stdout=subprocess.PIPE, text=True
    )
    try:
        watched = read_lines(watcher)  # the recent history first, then live steps
        wait_until(
            lambda: any(step > running.step + 3 for step in steps_in(watched)),
            timeout_s=60,
            what=f"the watcher to show step {running.step + 4}",
        )
    finally:
        watcher.kill()
        watcher.wait(timeout=30)
    seen = steps_in(watched)
    assert seen == sorted(seen), seen

    gang_id = client.job(job_id).gang_id
    cancel = subprocess.run(
        cli(controller, "cancel", job_id), capture_output=True, text=True, timeout=60
    )
    assert cancel.returncode == 0, cancel.stderr
    final = wait_for(client, job_id, timeout=120)
    assert final.state == pb.JOB_STATE_CANCELLED

    # The gang leaves the gang list as its release begins, and frees its slices once its
    # workers have stopped: wait for both.
    def released():
        info = client.cluster_info()
        return all(g.gang_id != gang_id for g in info.gangs) and all(
            s.holder_gang != gang_id for s in info.slices
        )

    wait_until(
        released, timeout_s=60, interval_s=0.5, what="the cancelled job's gang to be released"
    )
    assert wait_for(client, short_id).state == pb.JOB_STATE_SUCCEEDED


def test_a_job_on_a_gang_the_client_holds_leaves_it_held(client):
    from slicewise.common.errors import FailedPreconditionError, InvalidRequestError

    with client.allocate(slices=1, slice_type="v5litepod-4", timeout=300) as gang:
        # 10 steps: the last is one the DCN traffic of a job of several slices is read on.
        job = client.submit_job("lm", steps=10, overrides=SMALL, gang=gang)
        with pytest.raises(FailedPreconditionError, match=f"already running job {job.job_id}"):
            client.submit_job("lm", steps=3, overrides=SMALL, gang=gang)
        done = wait_for(client, job.job_id)
        assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
        assert done.gang_id == gang.id and done.num_slices == 1
        assert done.slice_type == "v5litepod-4"
        # One slice has no DCN: no step carries a measurement of it.
        steps = client.job_metrics(job.job_id).steps
        assert len(steps) == 10 and not [s.step for s in steps if s.dcn_window]
        # Still held, and still usable by its owner.
        assert any(g.gang_id == gang.id for g in client.cluster_info().gangs)
        x = gang.put(
            np.arange(4, dtype=np.float32), gang.mesh(dcn={"s": 1}, ici={"c": 4}).sharding(None)
        )
        np.testing.assert_array_equal(x.fetch(), np.arange(4, dtype=np.float32))
    with pytest.raises((FailedPreconditionError, InvalidRequestError), match="released"):
        client.submit_job("lm", steps=3, overrides=SMALL, gang=gang)
