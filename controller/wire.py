"""Conversions between protobuf messages and the controller's own types, both ways.

Client and servicer both use these, so the two ends cannot drift apart."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.arrays import ArrayRecord, ArraySpec, ArrayState
from controller.journal import StepRecord
from controller.mesh import MeshAxis, MeshSpec, ShardingSpec
from protos import controller_pb2 as pb

if TYPE_CHECKING:
    from controller.jobs import Job

# Chunk size for array and program streams: well under gRPC's 4 MiB default limit.
CHUNK_BYTES = 2 * 2**20


def mesh_to_pb(mesh: MeshSpec) -> pb.MeshSpec:
    return pb.MeshSpec(axes=[pb.MeshAxis(name=a.name, dcn=a.dcn, ici=a.ici) for a in mesh.axes])


def mesh_from_pb(msg: pb.MeshSpec) -> MeshSpec:
    return MeshSpec(tuple(MeshAxis(a.name, a.dcn, a.ici) for a in msg.axes))


def sharding_to_pb(sharding: ShardingSpec) -> pb.ShardingSpec:
    return pb.ShardingSpec(mesh=mesh_to_pb(sharding.mesh),
                           dims=[pb.PartitionDim(axes=list(d)) for d in sharding.dims])


def sharding_from_pb(msg: pb.ShardingSpec) -> ShardingSpec:
    return ShardingSpec(mesh_from_pb(msg.mesh), tuple(tuple(d.axes) for d in msg.dims))


def spec_to_pb(spec: ArraySpec) -> pb.ArraySpec:
    return pb.ArraySpec(shape=list(spec.shape), dtype=spec.dtype)


def spec_from_pb(msg: pb.ArraySpec) -> ArraySpec:
    return ArraySpec.of(tuple(msg.shape), msg.dtype)


_STATES = {
    ArrayState.PENDING: pb.ARRAY_STATE_PENDING,
    ArrayState.READY: pb.ARRAY_STATE_READY,
    ArrayState.FAILED: pb.ARRAY_STATE_FAILED,
}


def array_to_pb(record: ArrayRecord) -> pb.ArrayInfo:
    return pb.ArrayInfo(handle=record.handle, spec=spec_to_pb(record.spec),
                        state=_STATES[record.state], error=record.error)


def chunks(data: memoryview, size: int = CHUNK_BYTES):
    """Yields `data` in pieces of at most `size` bytes, without copying."""
    data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    for start in range(0, len(data), size):
        yield data[start:start + size]


def step_to_pb(record: StepRecord) -> pb.StepMetrics:
    return pb.StepMetrics(step=record.step, loss=record.loss, grad_norm=record.grad_norm,
                          learning_rate=record.learning_rate, step_time_s=record.step_time_s,
                          tokens_per_s=record.tokens_per_s, wall_time=record.wall_time)


def job_to_pb(job: Job) -> pb.JobInfo:
    spec = job.spec
    info = pb.JobInfo(
        job_id=job.job_id, program=spec.program,
        state=pb.JobState.Value(f"JOB_STATE_{job.state.name}"), step=job.step,
        steps=spec.steps, gang_id=job.gang_id, error=job.error, num_slices=spec.num_slices,
        slice_type=spec.slice_type, overrides=dict(spec.overrides), client=spec.client,
        created_at=job.created_at, updated_at=job.updated_at,
        flops_per_step=job.flops_per_step)
    if job.mesh is not None:
        info.mesh.CopyFrom(mesh_to_pb(job.mesh))
    if job.last is not None:
        info.last.CopyFrom(step_to_pb(job.last))
    return info
