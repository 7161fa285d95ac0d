"""A worker of a 2-slice training job is SIGKILLed at a random step: the job notices (its
gang fails, the host named), recovers by itself (RECOVERING, a new gang, the newest
committed step restored), ends `succeeded`, and its loss at every step equals the loss of
an uninterrupted run, bit for bit."""

from __future__ import annotations

import os
import random
import signal

import pytest

from protos import controller_pb2 as pb
from slicewise.testing import wait_until
from tests.integration.test_checkpoint_crash import worker_pids
from tests.integration.test_checkpoints import finished, run_job, submit_lm, watch_messages

pytestmark = pytest.mark.integration

STEPS, EVERY = 40, 10


@pytest.fixture(scope="module")
def uninterrupted(client):
    """The reference: STEPS steps in one go, no checkpoints."""
    return run_job(client, STEPS, checkpoint_every=0)


@pytest.mark.timeout(900)
def test_a_job_whose_worker_is_killed_recovers_by_itself_with_the_same_losses(
    client, uninterrupted
):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    at, victim = rng.randint(EVERY + 1, STEPS - 5), rng.randrange(2)
    print(f"seed {seed}: worker {victim} is killed once step {at} is done")
    job = submit_lm(
        client,
        STEPS,
        checkpoint_every=EVERY,
    )
    watcher, messages = watch_messages(client, job.job_id)
    info = wait_until(
        lambda: (i := client.job(job.job_id)).step >= at and i.HasField("committed_step") and i,
        timeout_s=300,
        interval_s=0.05,
        what=f"job {job.job_id} to pass step {at} with a committed checkpoint",
    )
    failed_gang = info.gang_id
    os.kill(worker_pids(client, failed_gang)[victim], signal.SIGKILL)

    done, steps = finished(client, job.job_id)
    watcher.join(timeout=60)
    assert done.failures == 1 and done.max_failures == 3
    assert done.gang_id != failed_gang
    assert done.HasField("resumed_from_step") and done.resumed_from_step % EVERY == 0
    assert done.resumed_from_step >= info.committed_step
    recovering = [m for m in messages if "recovering (1/3)" in m]
    assert recovering and f"gang {failed_gang} failed" in recovering[0], messages
    assert "the worker process died or was killed" in recovering[0]
    # Every step once, each with the uninterrupted run's loss, bit for bit.
    assert [s.step for s in steps] == list(range(STEPS))
    assert [s.loss for s in steps] == [s.loss for s in uninterrupted[1]]
    assert done.state == pb.JOB_STATE_SUCCEEDED and done.committed_step == STEPS
