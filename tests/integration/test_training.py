"""Training jobs driven by the controller on simulated slices: the same numbers as a
one-device reference, a loss that goes down, and jobs that outlive their clients."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from controller.jobview import TERMINAL
from programs.base import get_program, reference_train
from protos import controller_pb2 as pb

pytestmark = pytest.mark.integration

SMALL = {
    "d_model": "64",
    "n_layers": "2",
    "n_heads": "4",
    "d_ff": "128",
    "seq_len": "32",
    "batch_size": "8",
    "warmup_steps": "5",
    "total_steps": "20",
}


def wait_for(client, job_id, timeout=600.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.job(job_id)
        if job.state in TERMINAL:
            return job
        time.sleep(0.5)
    raise AssertionError(
        f"job {job_id} did not finish within {timeout:.0f} s: {client.job(job_id)}"
    )


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


@pytest.mark.slow
def test_default_lm_trains_and_a_second_process_watches_live(client, controller):
    job = client.submit_job("lm", slices=2, slice_type="v5litepod-4", steps=200)
    watcher = subprocess.Popen(
        cli(controller, "watch", job.job_id, "--plain"), stdout=subprocess.PIPE, text=True
    )
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), ln.strip()) for ln in watcher.stdout),
        daemon=True,
    )
    reader.start()
    try:
        done = wait_for(client, job.job_id, timeout=900)
        finished_at = time.monotonic()
        assert watcher.wait(timeout=60) == 0
        reader.join(timeout=10)
    finally:
        watcher.kill()
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    steps = client.job_metrics(job.job_id).steps
    first, last = steps[0].loss, float(np.mean([s.loss for s in steps[-10:]]))
    print(
        f"default lm: loss {first:.3f} -> {last:.3f} (mean of last 10 of 200 steps), "
        f"median step {1e3 * np.median([s.step_time_s for s in steps[1:]]):.0f} ms, "
        f"{np.median([s.tokens_per_s for s in steps[1:]]):,.0f} tok/s"
    )
    assert first > 5.0 and last < 3.0, (first, last)
    step_lines = [(t, ln) for t, ln in lines if " step " in ln]
    assert len(step_lines) == 200, lines[-5:]
    # Live: the watcher saw steps well before the job ended, not all at the end.
    early = [t for t, ln in step_lines if ln.startswith(f"{job.job_id} step 50/200 ")]
    assert early and early[0] < finished_at - 5, "the watcher only saw the steps at the end"
    assert lines[-1][1].startswith(f"{job.job_id} succeeded after 200/200 steps")


def test_detach_kill_the_client_rewatch_then_cancel_frees_the_gang(client, controller):
    # --detach: the id comes back at once.
    started = time.monotonic()
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
    assert time.monotonic() - started < 30
    short_id = detached.stdout.strip()
    assert short_id.startswith("j") and short_id[1:].isdigit(), detached.stdout

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
    job_id = follower.stdout.readline().split()[1].rstrip(":")
    for line in follower.stdout:
        if " step " in line:
            break
    follower.send_signal(signal.SIGKILL)
    follower.wait(timeout=30)
    at_kill = client.job(job_id).step
    time.sleep(3)
    running = client.job(job_id)
    assert running.state == pb.JOB_STATE_RUNNING and running.step > at_kill

    # Re-attach from another process: the stream resumes where the job is now.
    watcher = subprocess.Popen(
        cli(controller, "watch", job_id, "--plain"), stdout=subprocess.PIPE, text=True
    )
    seen = []
    for line in watcher.stdout:  # the recent history first, then live steps
        if " step " in line:
            seen.append(int(line.split()[2].split("/")[0]))
            if seen[-1] > running.step + 3:
                break
    watcher.kill()
    assert seen and seen[-1] > running.step + 3, (seen[-5:], running.step)
    assert seen == sorted(seen)

    gang_id = client.job(job_id).gang_id
    cancel = subprocess.run(
        cli(controller, "cancel", job_id), capture_output=True, text=True, timeout=60
    )
    assert cancel.returncode == 0, cancel.stderr
    final = wait_for(client, job_id, timeout=120)
    assert final.state == pb.JOB_STATE_CANCELLED
    deadline = time.monotonic() + 60
    while any(g.gang_id == gang_id for g in client.cluster_info().gangs):
        assert time.monotonic() < deadline, "the cancelled job's gang was not released"
        time.sleep(0.5)
    assert wait_for(client, short_id).state == pb.JOB_STATE_SUCCEEDED
    assert all(s.holder_gang != gang_id for s in client.cluster_info().slices)


def test_a_job_on_a_gang_the_client_holds_leaves_it_held(client):
    from slicewise.common.errors import FailedPreconditionError, InvalidRequestError

    with client.allocate(slices=1, slice_type="v5litepod-4", timeout=300) as gang:
        job = client.submit_job("lm", steps=3, overrides=SMALL, gang=gang)
        with pytest.raises(FailedPreconditionError, match=f"already running job {job.job_id}"):
            client.submit_job("lm", steps=3, overrides=SMALL, gang=gang)
        done = wait_for(client, job.job_id)
        assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
        assert done.gang_id == gang.id and done.num_slices == 1
        assert done.slice_type == "v5litepod-4"
        # Still held, and still usable by its owner.
        assert any(g.gang_id == gang.id for g in client.cluster_info().gangs)
        x = gang.put(
            np.arange(4, dtype=np.float32), gang.mesh(dcn={"s": 1}, ici={"c": 4}).sharding(None)
        )
        np.testing.assert_array_equal(x.fetch(), np.arange(4, dtype=np.float32))
    with pytest.raises((FailedPreconditionError, InvalidRequestError), match="released"):
        client.submit_job("lm", steps=3, overrides=SMALL, gang=gang)
