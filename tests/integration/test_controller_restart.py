"""A controller killed outright (SIGKILL) or stopped (SIGTERM) mid-run and started again
on the same state directory and port continues its job from the last committed step:
it takes a new gang, restores, ends `succeeded` with, step for step, the loss of an
uninterrupted run, bit for bit. A `slicewise watch` running in a second process
re-attaches by itself and follows the job to its end; ids go on counting."""

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
        proc = super().start()
        path = self.log_path(self.starts)
        _LOGS.append(path)
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


def interrupted_run(restartable: Restartable, how: signal.Signals, tmp_path: Path):
    """Runs the job on a fresh controller; once it is past a random step with a
    committed checkpoint, ends the controller with `how` and starts it again. Returns
    the job's final info and steps, the step it was at when the controller went and
    the newest step committed in storage then, and what the watcher printed."""
    seed = int.from_bytes(os.urandom(4), "little")
    at = random.Random(seed).randint(EVERY + 2, STEPS - 8)
    print(f"seed {seed}: the controller goes once step {at} is done ({how.name})")
    first = restartable.start()
    with slicewise.connect(first.address, name="restart-test") as client:
        job = submit_lm(
            client,
            STEPS,
            checkpoint_every=EVERY,
        )
        assert ID_PATTERN.fullmatch(job.job_id) and job.job_id.startswith("j1-"), job.job_id
        watch_out = tmp_path / "watch.txt"
        watcher = watch_in_another_process(first.address, job.job_id, watch_out)
        try:
            info = wait_until(
                lambda: (
                    (i := client.job(job.job_id)).step >= at and i.HasField("committed_step") and i
                ),
                timeout_s=600,
                interval_s=0.05,
                what=f"job {job.job_id} to pass step {at} with a committed checkpoint",
            )
            old_gang = info.gang_id
            if how is signal.SIGKILL:
                first.proc.kill()
                first.proc.wait(timeout=60)
            else:
                assert first.stop() == 0, "the controller did not stop cleanly on SIGTERM"
            reached = info.step
            directory = info.checkpoint_dir
            held = committed_steps(directory)
            assert held, f"nothing committed in {directory}"
            print(f"controller ended at step >= {reached}; committed in storage: {held}")

            second = restartable.start()
            assert second.address == first.address
            with slicewise.connect(second.address, name="restart-test") as again:
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
            return done, steps, held, watch_out.read_text()
        finally:
            if watcher.poll() is None:
                os.killpg(watcher.pid, signal.SIGKILL)
                watcher.wait(timeout=30)


def check_continued(done, steps, held, watched, uninterrupted, restartable) -> None:
    reference = [s.loss for s in uninterrupted[1]]
    assert done.restarts == 1
    assert done.committed_step == STEPS
    assert done.resumed_from_step in held, (done.resumed_from_step, held)
    assert [s.step for s in steps] == list(range(STEPS))
    assert [s.loss for s in steps] == reference  # bit for bit, every step
    assert done.last.loss == uninterrupted[0].last.loss
    log = restartable.log(2)
    assert (
        "continuing 1 unfinished job(s)" in log or "resumes after the controller restarted" in log
    )
    # The second process followed the job through the restart to its end.
    assert "lost the controller" in watched
    assert re.search(rf"^j1-[a-z2-7]{{13}} step {STEPS}/{STEPS} loss", watched, re.M), watched
    assert "succeeded" in watched


@pytest.mark.timeout(1500)
def test_a_killed_controller_continues_its_job_after_a_restart(
    restartable, uninterrupted, tmp_path
):
    done, steps, held, watched = interrupted_run(restartable, signal.SIGKILL, tmp_path)
    check_continued(done, steps, held, watched, uninterrupted, restartable)


@pytest.mark.timeout(1500)
def test_a_stopped_controller_saves_and_continues_its_job_after_a_restart(
    restartable, uninterrupted, tmp_path
):
    done, steps, held, watched = interrupted_run(restartable, signal.SIGTERM, tmp_path)
    check_continued(done, steps, held, watched, uninterrupted, restartable)
    # Stopped, not killed: the job saved the step it had reached before the controller
    # went, and continued from exactly there.
    assert done.resumed_from_step == max(held)
    assert "the controller is stopping: saving step" in restartable.log(1)
