"""An elastic job (`--elastic 1`) on both slices of a 2-slice cluster loses a host at a
random step with no spare slice to move to: it continues on the remaining slice from its
newest committed checkpoint, with the same global batch, and grows back to two slices at
a checkpoint once the host returns. Its loss curve stays within rtol 1e-4 of an
uninterrupted two-slice run (`lm_reference`; the one-slice steps reduce in another
order).

The test plays the cloud: it runs the simulated cluster itself (`SimulationProcess`, as
`slicewise cluster` does) and points a controller at it with --ray-address, so that it
can take a host away and bring it back.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import slicewise
from controller.simcluster import SimulationProcess
from protos import controller_pb2 as pb
from slicewise.testing import wait_until
from tests.integration.conftest import start_controller
from tests.integration.test_checkpoints import CONFIG, finished, watch_messages

pytestmark = pytest.mark.integration

# CONFIG's steps, so that `lm_reference` is the uninterrupted run. Checkpoints every 5
# steps leave the job several chances to grow back once the host has returned.
STEPS, EVERY = int(CONFIG["total_steps"]), 5


@pytest.fixture(scope="module")
def cloud():
    sim = SimulationProcess("2xv5litepod-4")
    try:
        yield sim
    finally:
        sim.stop()


@pytest.fixture(scope="module")
def elastic_client(tmp_path_factory, cloud):
    proc = start_controller(
        tmp_path_factory, "elastic-controller", ray_address=cloud.address, env=cloud.ray_env()
    )
    try:
        with slicewise.connect(proc.address, name=f"elastic-{os.getpid()}") as client:
            yield client
    finally:
        assert proc.stop() == 0


def submit(client, **kwargs) -> pb.JobInfo:
    return client.submit_job(
        "lm", slices=2, slice_type="v5litepod-4", steps=STEPS, overrides=CONFIG, **kwargs
    )


@pytest.mark.timeout(900)
def test_an_elastic_job_shrinks_to_one_slice_and_grows_back(elastic_client, cloud, lm_reference):
    client = elastic_client
    _, reference = lm_reference
    seed = int.from_bytes(os.urandom(4), "little")
    at = random.Random(seed).randint(EVERY + 1, 2 * EVERY - 2)
    print(f"seed {seed}: a host is removed once step {at} is done")

    job = submit(client, checkpoint_every=EVERY, elastic_min_slices=1)
    watcher, messages = watch_messages(client, job.job_id)
    running = wait_until(
        lambda: (i := client.job(job.job_id)).step >= at and i.HasField("committed_step") and i,
        timeout_s=300,
        interval_s=0.05,
        what=f"job {job.job_id} to pass step {at}",
    )
    assert running.elastic_min_slices == 1 and running.gang_slices == 2
    (gang,) = [g for g in client.cluster_info().gangs if g.gang_id == running.gang_id]
    victim = gang.slices[1]
    cloud.remove_host(victim, 0)

    # On one slice, past a checkpoint it saved there; then the host comes back.
    shrunk = wait_until(
        lambda: (
            (i := client.job(job.job_id)).gang_slices == 1
            and i.recoveries
            and i.recoveries[0].HasField("resumed_from_step")
            and i.committed_step > i.recoveries[0].resumed_from_step
            and i
        ),
        timeout_s=300,
        interval_s=0.05,
        what="the job to run on one slice",
    )
    assert shrunk.failures == 1 and shrunk.recoveries[0].HasField("resumed_from_step")
    cloud.add_host(victim, 0)

    done, steps = finished(client, job.job_id)
    watcher.join(timeout=60)
    assert done.state == pb.JOB_STATE_SUCCEEDED and done.gang_slices == 2
    assert done.failures == 1  # growing back is no failure
    assert any("elastic: 1 slice(s) free, continuing on 1 of 2" in m for m in messages), messages
    grew = [m for m in messages if "growing back from 1 to 2 slices" in m]
    assert grew, messages
    # Every step once; the losses follow the uninterrupted run's.
    assert [s.step for s in steps] == list(range(STEPS))
    got = np.array([s.loss for s in steps])
    want = np.array([s.loss for s in reference])
    worst = float(np.max(np.abs(got - want) / np.abs(want)))
    print(f"largest relative loss difference: {worst:.2e}")
    np.testing.assert_allclose(got, want, rtol=1e-4)
