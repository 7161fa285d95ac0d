"""Client mistakes that the fuzz campaign (tests/integration/test_fuzz.py) found answered
INTERNAL, or that froze the controller, or that were accepted only to fail later: each
is refused with a status and a message a person can act on, at once (no processes)."""

from __future__ import annotations

import asyncio

import grpc
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from controller.core import Controller
from controller.job import JobSpec
from controller.jobs import JobRunner
from controller.journal import Journal
from controller.servicer import ControllerServicer
from protos import controller_pb2 as pb
from slicewise.common.errors import FailedPreconditionError
from slicewise.common.mesh import MeshSpec
from slicewise.common.ops import ExecOp
from tests.unit.fake_cluster import Clock, FakeCluster, FakeContext
from tests.unit.test_bad_requests import one_ready_array

V4 = "v5litepod-4"  # one host of 4 chips
MESH = MeshSpec.build({"slice": 1}, {"chip": 4})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def refused(call) -> tuple[grpc.StatusCode, str]:
    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        await call(context)
    return context.code, context.details


def plus_one() -> bytes:
    """a + 1 over float32[4], split over the gang's 4 chips."""
    sharding = NamedSharding(MESH.abstract(), P("chip"))
    exported = jax.export.export(jax.jit(lambda a: a + 1), platforms=["cpu"])(
        jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)
    )
    return bytes(exported.serialize())


@pytest.mark.parametrize(
    "inputs",
    [
        [["@-1:0"]],  # the first call: no earlier call to count back from
        [["@-1:-3"]],
        [["A"], ["@0:-1"]],  # output -1 of call 0 would be its last
        [["A"], ["@-1:0"]],
    ],
)
def test_a_batch_reference_to_a_negative_call_or_output_is_refused(inputs):
    async def scenario():
        controller, gang_id, record, channel, _ = await one_ready_array()
        program = await controller.register_program(gang_id, "plus_one", MESH, plus_one())
        servicer = ControllerServicer(controller, jobs=None)
        calls = [
            pb.CallSpec(
                program_id=program.program_id,
                inputs=[record.handle if h == "A" else h for h in call],
            )
            for call in inputs
        ]
        request = pb.ExecuteBatchRequest(gang_id=gang_id, calls=calls)
        status = await refused(lambda ctx: servicer.ExecuteBatch(request, ctx))
        return status, [op for op in channel.sent if isinstance(op, ExecOp)]

    (code, details), executed = run(scenario())
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "which comes later in the batch or does not exist; refer only to earlier" in details
    assert executed == []  # no call of the batch was queued


# -- jobs ------------------------------------------------------------------------------


def job_spec(**kw) -> JobSpec:
    base = dict(program="lm", num_slices=2, slice_type=V4, steps=4)
    return JobSpec(**(base | kw))


def runner_of(tmp_path, state: str, **kw) -> JobRunner:
    """A job runner (no controller) that knows one job, j1, in `state`."""
    journal = Journal(tmp_path / "journal.sqlite")
    journal.add_job("j1", 1, job_spec(**kw).to_json(), state, 1.0)
    return JobRunner(controller=None, journal=journal)


@pytest.mark.parametrize("directory", ["zz://a", "s3://bucket/x", "/dev/null"])
def test_keeping_a_checkpoint_in_a_directory_that_cannot_be_read_is_refused(tmp_path, directory):
    """KeyError (no filesystem for the scheme), ImportError (its package is missing) and
    NotADirectoryError came out of KeepCheckpoint as INTERNAL."""
    runner = runner_of(tmp_path, "cancelled", checkpoint_dir=directory)
    with pytest.raises(FailedPreconditionError, match="checkpoint directory .* cannot be read"):
        asyncio.run(runner.keep("j1", 1))


def test_keeping_a_checkpoint_of_a_job_of_any_length_lists_no_save_steps(tmp_path, monkeypatch):
    """The save steps of a waiting job were listed, on the controller's event loop: a job
    of 2**63 - 1 steps froze the controller for every client, for good."""
    from controller import checkpoints

    def listed(*args):
        raise AssertionError(f"save steps listed: save_steps{args}")

    monkeypatch.setattr(checkpoints, "save_steps", listed)
    runner = runner_of(
        tmp_path, "queued", steps=2**63 - 1, checkpoint_every=1, checkpoint_dir=str(tmp_path)
    )
    job = run(runner.keep("j1", 2**62))  # a save step, one of 2**63 - 1
    assert job.keep_steps == {2**62}


def test_the_save_plan_of_a_job_of_any_length_is_never_listed():
    from controller.checkpoints import SavePlan

    plan = SavePlan(0, 2**63 - 1, 50)
    assert 50 in plan and 2**63 - 1 in plan and 51 not in plan and 0 not in plan
    assert plan
    assert not SavePlan(0, 100, 50, held=frozenset({50, 100}))
    assert SavePlan(0, 100, 50, held=frozenset({50})) and 100 in SavePlan(0, 100, 50)


def test_a_job_that_can_never_fit_the_cluster_is_refused_when_submitted(tmp_path):
    """It was accepted, then failed once it queued (logged as an unexpected error)."""

    async def scenario():
        controller = Controller(backend=FakeCluster(V4, V4), clock=Clock(), simulated=True)
        await controller.refresh_inventory()
        runner = JobRunner(controller, Journal(tmp_path / "journal.sqlite"))
        servicer = ControllerServicer(controller, jobs=runner)
        request = pb.SubmitJobRequest(program="lm", num_slices=5, slice_type=V4, steps=4)
        status = await refused(lambda ctx: servicer.SubmitJob(request, ctx))
        return status, runner.jobs

    (code, details), jobs = run(scenario())
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith("asked for 5 x v5litepod-4 but the whole cluster has 2")
    assert jobs == {}
