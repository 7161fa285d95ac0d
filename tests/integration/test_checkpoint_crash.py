"""Every worker of a 2-slice training job is killed while an asynchronous checkpoint save
is in flight (held by a failpoint after all its shards are written, just before its
commit). The job may not recover by itself (`max_failures=0`): it fails saying why, the
partial step is never taken for a committed one,
and nothing committed is lost. A new job on the same directory restores the last fully
committed step, saves the interrupted step again over orbax's leftover, and from there
trains with the loss of an uninterrupted run at every step, bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

import slicewise
from controller.jobview import TERMINAL
from protos import controller_pb2 as pb
from slicewise.common.checkpoints import COMMIT_FILE, committed_steps
from slicewise.common.failpoints import ENV_VAR
from slicewise.testing import wait_until
from tests.integration.conftest import controller_log, start_controller
from tests.integration.test_checkpoints import (
    assert_losses_match,
    finished,
    submit_lm,
    watch_messages,
)

pytestmark = pytest.mark.integration

STEPS, EVERY = 40, 10
# The save whose commit is held, and the one before it, which commits.
HELD, COMMITTED = 20, 10
# orbax writes a step under this name and renames it to `<step>` to commit it (POSIX).
PARTIAL = f"{HELD}.orbax-checkpoint-tmp"


@pytest.fixture(scope="module")
def failpoints(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("failpoints") / "failpoints.json"
    path.write_text("{}")
    return path


@pytest.fixture(scope="module")
def crash_controller(tmp_path_factory, failpoints):
    """A controller of its own: the test kills its workers and sets its failpoints."""
    controller = start_controller(
        tmp_path_factory,
        "checkpoint-crash",
        sim="2xv5litepod-4",
        env={ENV_VAR: str(failpoints)},
    )
    try:
        yield controller
    finally:
        controller.stop()


@pytest.fixture(scope="module")
def crash_client(crash_controller):
    with slicewise.connect(crash_controller.address, name="checkpoint-crash") as c:
        yield c


@pytest.fixture(scope="module")
def uninterrupted(lm_reference):
    """The reference: CONFIG in one go, no checkpoints."""
    return lm_reference


def file_digests(path: Path) -> dict[str, str]:
    """sha256 of every file under `path`, by relative name."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def worker_stderr(pid: int) -> str:
    """What a live worker process has written to its stderr (a file in Ray's session
    log directory, which Ray opened for it)."""
    return Path(os.readlink(f"/proc/{pid}/fd/2")).read_text(errors="replace")


def worker_pids(client, gang_id: str) -> list[int]:
    stats = client.stub.GetGangStats(pb.GangStatsRequest(gang_id=gang_id), timeout=60)
    return [w.pid for w in sorted(stats.workers, key=lambda w: w.process_id)]


@pytest.fixture(scope="module")
def crashed(crash_client, failpoints, tmp_path_factory):
    """Runs the checkpointed job until the commit of step HELD is held, snapshots step
    COMMITTED, SIGKILLs every worker of the gang and waits for the job to end. Returns
    the directory, the job's final info and steps, and the snapshot."""
    client = crash_client
    directory = tmp_path_factory.mktemp("checkpoint-crash") / "lm"
    failpoints.write_text(
        json.dumps({"save_commit_delay_s": 900, "save_commit_delay_from_step": HELD})
    )
    try:
        job = submit_lm(
            client,
            STEPS,
            checkpoint_every=EVERY,
            checkpoint_dir=str(directory),
            max_failures=0,
        )

        def held():
            """The pids of the gang's workers once step COMMITTED is journalled and
            process 0, the one that commits, holds the commit of step HELD."""
            info = client.job(job.job_id)
            if info.state in TERMINAL:
                raise AssertionError(f"job {job.job_id} ended before the kill: {info.error}")
            if not (info.HasField("committed_step") and info.committed_step == COMMITTED):
                return None
            pids = worker_pids(client, info.gang_id)
            holding = f"checkpoint step {HELD}: failpoint: holding its commit"
            return pids if holding in worker_stderr(pids[0]) else None

        pids = wait_until(
            held, timeout_s=300, interval_s=0.2, what=f"the commit of step {HELD} to be held"
        )
        # In flight: every shard written, under the temporary name, without the marker.
        assert (directory / PARTIAL / "state").is_dir()
        assert not (directory / PARTIAL / COMMIT_FILE).exists()
        assert not (directory / str(HELD)).exists()
        before = file_digests(directory / str(COMMITTED))
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

        def ended():
            info = client.job(job.job_id)
            return info if info.state in TERMINAL else None

        done = wait_until(ended, timeout_s=300, interval_s=0.2, what=f"job {job.job_id} to end")
    finally:
        failpoints.write_text("{}")
    return directory, done, list(client.job_metrics(job.job_id).steps), before


def test_the_killed_job_fails_and_keeps_exactly_the_committed_step(crashed, uninterrupted):
    directory, done, steps, before = crashed
    assert done.state == pb.JOB_STATE_FAILED
    assert "failure budget is spent (0 of 0 recoveries used" in done.error
    assert "closed its control channel (the worker process died or was killed)" in done.error
    # Journal and storage agree: step COMMITTED is the newest committed step.
    assert done.HasField("committed_step") and done.committed_step == COMMITTED
    assert committed_steps(directory) == [COMMITTED]
    # The partial step is left as the kill found it: never renamed, never marked.
    assert sorted(p.name for p in directory.iterdir()) == [str(COMMITTED), PARTIAL]
    assert not (directory / PARTIAL / COMMIT_FILE).exists()
    # Nothing committed was touched.
    assert file_digests(directory / str(COMMITTED)) == before
    assert (directory / str(COMMITTED) / COMMIT_FILE).is_file()
    # What it did record before the kill is what an uninterrupted run computes.
    want = {s.step: s.loss for s in uninterrupted[1]}
    assert len(steps) >= COMMITTED and [s.step for s in steps] == list(range(len(steps)))
    assert [s.loss for s in steps] == [want[s.step] for s in steps]


def test_a_new_job_restores_the_last_committed_step_and_saves_over_the_partial_one(
    crash_controller, crash_client, crashed, uninterrupted
):
    client = crash_client
    directory, _, _, before = crashed
    job = submit_lm(
        client,
        STEPS,
        checkpoint_every=EVERY,
        checkpoint_dir=str(directory),
        keep_checkpoints=0,
    )
    watcher, messages = watch_messages(client, job.job_id)
    done, steps = finished(client, job.job_id)
    watcher.join(timeout=60)

    restored = f"restored step {COMMITTED} from {directory}"
    assert any(restored in m for m in messages), messages
    assert any(
        f"job {job.job_id}" in line and restored in line
        for line in controller_log(crash_controller).splitlines()
    )
    assert not done.HasField("resumed_from_step")  # a restore, not a preemption's resume
    assert [s.step for s in steps] == list(range(COMMITTED, STEPS)), "it did not restore"
    assert_losses_match(steps, uninterrupted[1], "after the restore")
    # Step HELD saved again and committed over orbax's leftover, which is gone.
    assert done.committed_step == STEPS
    assert committed_steps(directory) == [10, 20, 30, 40]
    assert sorted(p.name for p in directory.iterdir()) == ["10", "20", "30", "40"]
    assert file_digests(directory / str(COMMITTED)) == before
