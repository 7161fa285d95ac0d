"""The ordinary case of a restart: a new gang on hosts that ran the same program before.

A controller with exactly two v5litepod-4 slices (no spare), so every gang of a 2-slice
job lands on the same hosts as the one before it: the same `lm` program submitted as
three jobs one after another, the second losing a worker at a random step (its new
gang takes the same two hosts). Each job ends `succeeded` with no gang failure but
the one injected (a step stuck in a collective would fail its gang within the short
step watchdog here, and count), and the uninterrupted run's loss at every step, bit for
bit. The controller keeps its workers' compiled programs in a directory of its own:
the first job's workers compile the step and keep it, and every gang after it reads
it back. Jobs that ran like this hung in their collectives when the executables kept
were the ones XLA compiled, whose loop runs its collectives in no fixed order with the
ones around it once read back (docs/restarts.md). The third scenario, a controller
killed and started again on the same state directory, is test_controller_restart.py.
"""

from __future__ import annotations

import os
import random

import pytest

import slicewise
from protos import controller_pb2 as pb
from tests.integration.conftest import chaos_controller_on
from tests.integration.test_checkpoints import assert_losses_match, finished, submit_lm

pytestmark = pytest.mark.integration

STEPS, EVERY = 30, 10
STEP_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """Where the module's workers keep their compiled programs."""
    return tmp_path_factory.mktemp("restarts-kept")


@pytest.fixture(scope="module")
def two_slices(tmp_path_factory, kept):
    with chaos_controller_on(
        tmp_path_factory,
        "restarts-controller",
        "2xv5litepod-4",
        STEP_TIMEOUT_S,
        "--compilation-cache",
        str(kept),
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(two_slices):
    with slicewise.connect(two_slices.address, name=f"restarts-{os.getpid()}") as c:
        yield c


@pytest.mark.timeout(900)
def test_the_same_program_three_times_on_the_same_hosts_the_second_losing_a_worker(
    client, lm_reference, kept
):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    at, victim = rng.randint(EVERY + 1, STEPS - 8), rng.randrange(2)
    print(f"seed {seed}: job 2 loses the worker of process {victim} once step {at} is done")
    for run in (1, 2, 3):
        job = submit_lm(client, STEPS, checkpoint_every=EVERY)
        if run == 2:
            client.inject_fault(job.job_id, "kill-worker", at_step=at, process=victim)
        done, steps = finished(client, job.job_id)
        assert done.state == pb.JOB_STATE_SUCCEEDED and done.committed_step == STEPS, run
        causes = [r.cause for r in done.recoveries]
        if run == 2:
            # The kill, and nothing after it: the new gang's steps never stalled.
            assert done.failures == 1 and "closed its control channel" in causes[0], causes
        else:
            assert done.failures == 0, (run, causes)
        assert [s.step for s in steps] == list(range(STEPS)), run
        assert_losses_match(steps, lm_reference[1], after=f"job {run} on the same hosts")
        if run == 1:  # what every later gang reads back: the step, for both processes
            files = [p.name for p in (kept / "slicewise-executables").iterdir()]
            assert [n for n in files if "-n2-p0-" in n] and [n for n in files if "-n2-p1-" in n]
