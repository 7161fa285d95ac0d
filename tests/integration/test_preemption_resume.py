"""A 2-slice training job whose gang is preempted by a higher-priority request saves
its state within the grace period, yields the gang, waits, and when re-admitted on new
workers resumes from the step it saved; one that overruns its grace period is stopped
under it and resumes from its last committed periodic checkpoint. Either way its loss
at every step equals, bit for bit, the loss of an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import threading

import pytest

import slicewise
from protos import controller_pb2 as pb
from slicewise.common.checkpoints import COMMIT_FILE, committed_steps
from slicewise.testing import wait_until
from tests.integration.conftest import controller_log, start_controller
from tests.integration.test_checkpoints import (
    assert_losses_match,
    cli,
    finished,
    submit_lm,
    watch_messages,
)

pytestmark = pytest.mark.integration

STEPS, EVERY = 40, 10
# The grace period of the controller whose jobs overrun it, and by how much they do.
SHORT_GRACE_S, YIELD_DELAY_S = 2, 6


@pytest.fixture(scope="module")
def uninterrupted(lm_reference):
    """The reference: CONFIG in one go, no checkpoints."""
    return lm_reference


@pytest.fixture(scope="module")
def slow_controller(tmp_path_factory):
    """A controller of its own whose jobs take longer to yield than the grace period."""
    failpoints = tmp_path_factory.mktemp("failpoints") / "failpoints.json"
    failpoints.write_text(json.dumps({"yield_delay_s": YIELD_DELAY_S}))
    controller = start_controller(
        tmp_path_factory,
        "preemption-overrun",
        sim="2xv5litepod-4",
        env={"SLICEWISE_FAILPOINTS": str(failpoints)},
        extra_args=("--preemption-grace", str(SHORT_GRACE_S)),
    )
    try:
        yield controller
    finally:
        controller.stop()


def random_step() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    at = random.Random(seed).randint(5, 25)
    print(f"seed {seed}: the higher-priority request comes once step {at} is done")
    return at


def preempted_run(controller, client, directory, at: int):
    """Runs the checkpointed job; once it has done step `at`, a second client takes its
    slices with a higher priority, holds them until the job is seen waiting, and lets
    go. Returns the job's final info, its steps and the messages of its event stream."""
    job = submit_lm(
        client,
        STEPS,
        checkpoint_every=EVERY,
        checkpoint_dir=str(directory),
        keep_checkpoints=0,  # every step it saved stays, for the checks on storage
    )
    watcher, messages = watch_messages(client, job.job_id)
    wait_until(
        lambda: client.job(job.job_id).step >= at,
        timeout_s=300,
        interval_s=0.05,
        what=f"job {job.job_id} to reach step {at}",
    )
    with slicewise.connect(controller.address, name="preemptor") as high_client:
        granted: list = []

        def ask():
            try:
                granted.append(
                    high_client.allocate(
                        slices=2, slice_type="v5litepod-4", priority=10, timeout=300
                    )
                )
            except Exception as exc:  # noqa: BLE001 - reported by the assertions below
                granted.append(exc)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        waiting = wait_until(
            lambda: (i := client.job(job.job_id)).state == pb.JOB_STATE_QUEUED and i,
            timeout_s=120,
            interval_s=0.1,
            what=f"job {job.job_id} to give up its gang and wait",
        )
        assert waiting.preemptions == 1
        asker.join(timeout=300)
        assert granted and isinstance(granted[0], slicewise.Gang), granted
        assert client.job(job.job_id).state == pb.JOB_STATE_QUEUED  # while the gang is away
        granted[0].release()
    done, steps = finished(client, job.job_id)
    watcher.join(timeout=60)
    assert done.preemptions == 1 and done.HasField("resumed_from_step")
    assert done.committed_step == STEPS
    print(f"preempted after step {at}; resumed from step {done.resumed_from_step}")
    return done, steps, messages


def assert_same_losses(steps, reference_steps, resumed: int, unrecorded: int = 0) -> None:
    """Every step recorded once with the uninterrupted loss, except the `unrecorded` steps
    just before `resumed`: they ran on the stopped gang, but their metrics went with it."""
    gap = range(resumed - unrecorded, resumed)
    assert [s.step for s in steps] == [s for s in range(STEPS) if s not in gap]
    assert_losses_match(steps, reference_steps, f"(resumed from {resumed})")


def test_a_preempted_job_yields_and_resumes_with_the_uninterrupted_losses(
    controller, client, uninterrupted, tmp_path
):
    at = random_step()
    directory = tmp_path / "lm"
    done, steps, messages = preempted_run(controller, client, directory, at)
    resumed = done.resumed_from_step
    # It saved the step it had reached when told to yield, not an older periodic one.
    assert at <= resumed < STEPS
    assert (directory / str(resumed) / COMMIT_FILE).is_file()
    assert_same_losses(steps, uninterrupted[1], resumed)

    assert any(m.startswith("preempted by") for m in messages), messages
    assert any(f"resumed from step {resumed} after preemption" in m for m in messages), messages
    assert f"preempted 1 time, resumed from step {resumed}" in cli(controller, "jobs", done.job_id)


def test_a_job_that_overruns_its_grace_resumes_from_its_last_periodic_checkpoint(
    slow_controller, uninterrupted, tmp_path
):
    at = random_step()
    directory = tmp_path / "lm"
    with slicewise.connect(slow_controller.address, name="overrun") as client:
        done, steps, messages = preempted_run(slow_controller, client, directory, at)
    resumed = done.resumed_from_step
    log = controller_log(slow_controller)
    assert f"gang {done.gang_id} was stopped for" in log  # not yielded: stopped under it
    assert f"gang {done.gang_id} yielded" not in log
    # Stopped before it could save where it was: only periodic steps were ever committed.
    assert resumed % EVERY == 0 and resumed < STEPS
    assert set(committed_steps(directory)) <= {10, 20, 30, 40}
    # The stopped gang may have run (and committed) steps past the last one the job
    # recorded; it then resumes from that later checkpoint and says which steps' metrics
    # were lost, rather than running everything again from the initial state.
    recorded = {s.step for s in steps if s.step < resumed}
    unrecorded = resumed - len(recorded)
    assert recorded == set(range(resumed - unrecorded)), sorted(recorded)
    if unrecorded:
        lost = f"steps {resumed - unrecorded}-{resumed - 1} ran before it, but their metrics"
        assert any(lost in m for m in messages), messages
    assert_same_losses(steps, uninterrupted[1], resumed, unrecorded)
