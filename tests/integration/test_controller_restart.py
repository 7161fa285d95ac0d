"""A controller killed outright (SIGKILL) or stopped (SIGTERM) mid-run and started again
on the same state directory and port continues its job from the last committed step
(a stopped one saves the step it reached first): it takes a new gang, restores, ends
`succeeded` with, step for step, the loss of an uninterrupted run, bit for bit. A
`slicewise watch` running in a second process re-attaches by itself and follows the job
to its end; ids go on counting. One job meets both endings, one after the other."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

import slicewise
from protos import controller_pb2 as pb
from slicewise.common.checkpoints import committed_steps
from slicewise.common.ids import ID_PATTERN, id_order
from slicewise.launch import ControllerProcess, RestartableController
from slicewise.testing import wait_until
from tests.integration.conftest import _LOG_OF, _LOGS
from tests.integration.test_checkpoints import finished, submit_lm

pytestmark = pytest.mark.integration

STEPS, EVERY = 40, 10
SIM = "2xv5litepod-4"


@pytest.fixture(scope="module")
def uninterrupted(lm_reference):
    """The reference: CONFIG in one go, no checkpoints (see `lm_reference`)."""
    return lm_reference


class Restartable(RestartableController):
    """The test's controller: its logs are shown when a test fails."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, sim=SIM)

    def start(self) -> ControllerProcess:
        path = self.log_path(self.starts + 1)
        _LOGS.append(path)  # shown also when this start fails
        proc = super().start()
        _LOG_OF[proc.pid] = path
        return proc

    def log(self, start: int) -> str:
        return self.log_path(start).read_text(errors="replace")


@pytest.fixture
def restartable(tmp_path):
    controller = Restartable(tmp_path)
    try:
        yield controller
    finally:
        controller.close()


def watch_in_another_process(address: str, job_id: str, out: Path) -> subprocess.Popen:
    """`slicewise watch JOB --plain` in a process of its own, printing into `out`."""
    with open(out, "w") as sink:
        return subprocess.Popen(
            [sys.executable, "-P", "-m", "controller.cli", "watch", job_id, "--plain"]
            + ["--controller", address, "--reconnect", "600"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def end_controller(proc, how: signal.Signals) -> None:
    if how is signal.SIGKILL:
        proc.proc.kill()
        proc.proc.wait(timeout=60)
    else:
        assert proc.stop() == 0, "the controller did not stop cleanly on SIGTERM"


def past(client, job_id: str, step: int, after_committed: int = -1) -> pb.JobInfo:
    """The job's info once it has done `step` with a checkpoint newer than
    `after_committed` committed."""
    return wait_until(
        lambda: (
            (i := client.job(job_id)).step >= step
            and i.HasField("committed_step")
            and i.committed_step > after_committed
            and i
        ),
        timeout_s=600,
        interval_s=0.05,
        what=f"job {job_id} to pass step {step} with a checkpoint after {after_committed}",
    )


@pytest.mark.timeout(1500)
def test_a_killed_then_stopped_controller_continues_its_job_after_each_restart(
    restartable, uninterrupted, tmp_path
):
    """The controller is killed outright (SIGKILL) past a random step with a committed
    checkpoint, started again, and later stopped (SIGTERM) past another random step,
    and started again: the job ends `succeeded` with the uninterrupted run's loss at
    every step; a watcher in another process follows it through both restarts."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    killed_at = rng.randint(EVERY + 2, 2 * EVERY)
    stopped_at = rng.randint(2 * EVERY + 4, STEPS - 6)
    print(f"seed {seed}: SIGKILL once step {killed_at} is done, SIGTERM at {stopped_at}")
    first = restartable.start()
    with slicewise.connect(first.address, name="restart-test") as client:
        job = submit_lm(client, STEPS, checkpoint_every=EVERY)
        assert ID_PATTERN.fullmatch(job.job_id) and job.job_id.startswith("j1-"), job.job_id
        watch_out = tmp_path / "watch.txt"
        watcher = watch_in_another_process(first.address, job.job_id, watch_out)
        try:
            info = past(client, job.job_id, killed_at)
            old_gang = info.gang_id
            end_controller(first, signal.SIGKILL)
            killed_held = committed_steps(info.checkpoint_dir)
            assert killed_held, f"nothing committed in {info.checkpoint_dir}"
            print(f"killed at step >= {info.step}; committed in storage: {killed_held}")

            second = restartable.start()
            assert second.address == first.address
            with slicewise.connect(second.address, name="restart-test") as again:
                # Resumed from a step it had committed, and saved one more since.
                resumed = past(again, job.job_id, stopped_at, max(killed_held))
                assert resumed.restarts == 1 and resumed.resumed_from_step in killed_held
                end_controller(second, signal.SIGTERM)
            stopped_held = committed_steps(info.checkpoint_dir)
            print(f"stopped at step >= {resumed.step}; committed in storage: {stopped_held}")

            third = restartable.start()
            with slicewise.connect(third.address, name="restart-test") as again:
                done, steps = finished(again, job.job_id)
                # Ids go on counting: an old id never names a new object.
                fresh = submit_lm(again, 1, checkpoint_every=0)
                assert fresh.job_id.startswith("j2-"), fresh.job_id
                finished(again, fresh.job_id)
                with pytest.raises(grpc.RpcError) as lost:
                    again.stub.GetGangStats(pb.GangStatsRequest(gang_id=old_gang), timeout=30)
                assert lost.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert "controller restarted" in lost.value.details()
                with again.allocate(slices=1, slice_type="v5litepod-4") as gang:
                    assert id_order(gang.id)[1] > id_order(old_gang)[1] + 1
            watcher.wait(timeout=120)
            assert watcher.returncode == 0, watch_out.read_text()
            watched = watch_out.read_text()
        finally:
            if watcher.poll() is None:
                os.killpg(watcher.pid, signal.SIGKILL)
                watcher.wait(timeout=30)

    reference = [s.loss for s in uninterrupted[1]]
    assert done.restarts == 2
    # Each restart's gang, on the hosts that ran the step before, never stalled in it.
    assert done.failures == 0, [r.cause for r in done.recoveries]
    assert done.committed_step == STEPS
    assert [s.step for s in steps] == list(range(STEPS))
    assert [s.loss for s in steps] == reference  # bit for bit, every step
    assert done.last.loss == uninterrupted[0].last.loss
    # Stopped, not killed: the job saved the step it had reached before the controller
    # went, and continued from exactly there.
    assert done.resumed_from_step == max(stopped_held) > max(killed_held)
    assert "the controller is stopping: saving step" in restartable.log(2)
    for start in (2, 3):
        log = restartable.log(start)
        assert (
            "continuing 1 unfinished job(s)" in log
            or "resumes after the controller restarted" in log
        ), start
        # The programs the first run exported, read back from the state directory.
        assert "exported by an earlier run of this controller; read back" in log, start
        assert "lm exported for mesh" not in log, start
    # The second process followed the job through the restarts to its end.
    assert "lost the controller" in watched, watched
    assert re.search(rf"^j1-[a-z2-7]{{13}} step {STEPS}/{STEPS} loss", watched, re.M), watched
    assert "succeeded" in watched
