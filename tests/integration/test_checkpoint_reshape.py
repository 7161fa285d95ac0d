"""A checkpoint saved by a job on 2 x v5litepod-4 (two 1-host slices) restores onto
1 x v5litepod-16 (one slice of 4 hosts): another slice count, host count and mesh shape
(data=2 x fsdp=4 becomes fsdp=8 x tensor=2), the same global batch. Training goes on from
the saved step with the losses of an uninterrupted run on the first shape, to fp32 rtol
1e-5 (the mesh change reorders the reductions)."""

from __future__ import annotations

import numpy as np
import pytest

from protos import controller_pb2 as pb
from slicewise.common.checkpoints import committed_steps
from tests.integration.conftest import controller_log
from tests.integration.test_checkpoints import CONFIG, finished

pytestmark = pytest.mark.integration

# CONFIG's schedule runs to total_steps=40: the resumed job and the reference share it.
SAVED, STEPS, EVERY = 20, 40, 10
RTOL = 1e-5


def run_lm(client, slices: int, slice_type: str, steps: int, **kwargs):
    job = client.submit_job(
        "lm", slices=slices, slice_type=slice_type, steps=steps, overrides=CONFIG, **kwargs
    )
    return finished(client, job.job_id)


@pytest.fixture(scope="module")
def saved(client, tmp_path_factory):
    """Job A: SAVED steps on 2 x v5litepod-4, a checkpoint every EVERY steps."""
    directory = tmp_path_factory.mktemp("reshape") / "lm"
    done, steps = run_lm(
        client, 2, "v5litepod-4", SAVED, checkpoint_every=EVERY, checkpoint_dir=str(directory)
    )
    return directory, done, steps


def mesh_axes(info: pb.JobInfo) -> dict[str, tuple[int, int]]:
    return {a.name: (a.dcn, a.ici) for a in info.mesh.axes}


def test_a_checkpoint_of_2_slices_restores_on_a_4_host_slice_with_the_uninterrupted_losses(
    controller, client, saved, lm_reference
):
    directory, first, first_steps = saved
    _, reference_steps = lm_reference
    assert first.committed_step == SAVED
    assert committed_steps(str(directory)) == [10, 20]
    assert mesh_axes(first) == {"data": (2, 1), "fsdp": (1, 4)}
    want = {s.step: s.loss for s in reference_steps}
    assert [s.loss for s in first_steps] == [want[s] for s in range(SAVED)]

    resumed, steps = run_lm(
        client,
        1,
        "v5litepod-16",
        STEPS,
        checkpoint_every=EVERY,
        checkpoint_dir=str(directory),
        ici={"fsdp": 8, "tensor": 2},
    )
    assert resumed.state == pb.JOB_STATE_SUCCEEDED, resumed.error
    assert mesh_axes(resumed) == {"fsdp": (1, 8), "tensor": (1, 2)}
    running = [
        line
        for line in controller_log(controller).splitlines()
        if f"job {resumed.job_id} running:" in line
    ]
    assert len(running) == 1 and f"restored step {SAVED} from {directory}" in running[0], running
    assert [s.step for s in steps] == list(range(SAVED, STEPS)), "it did not resume"

    got = np.array([s.loss for s in steps])
    ref = np.array([want[s] for s in range(SAVED, STEPS)])
    relative = np.abs(got - ref) / np.abs(ref)
    print(
        f"largest relative loss difference on 1 x v5litepod-16 after restoring step {SAVED}: "
        f"{relative.max():.3e}" + (" (exactly 0)" if relative.max() == 0 else "")
    )
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=0)
    assert resumed.committed_step == STEPS
    # The newest three are kept (the default), the first shape's step 10 is gone.
    assert committed_steps(str(directory)) == [20, 30, 40]
