"""Protobuf messages for the controller's own records (arrays, steps, jobs); the shared
vocabulary's conversions are in `slicewise.wire`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.arrays import ArrayRecord, ArrayState
from controller.journal import StepRecord
from protos import controller_pb2 as pb
from slicewise.wire import mesh_to_pb, spec_to_pb

if TYPE_CHECKING:
    from controller.job import Job

_STATES = {
    ArrayState.PENDING: pb.ARRAY_STATE_PENDING,
    ArrayState.READY: pb.ARRAY_STATE_READY,
    ArrayState.FAILED: pb.ARRAY_STATE_FAILED,
}


def array_to_pb(record: ArrayRecord) -> pb.ArrayInfo:
    return pb.ArrayInfo(
        handle=record.handle,
        spec=spec_to_pb(record.spec),
        state=_STATES[record.state],
        error=record.error,
    )


def step_to_pb(record: StepRecord) -> pb.StepMetrics:
    return pb.StepMetrics(
        step=record.step,
        loss=record.loss,
        grad_norm=record.grad_norm,
        learning_rate=record.learning_rate,
        step_time_s=record.step_time_s,
        tokens_per_s=record.tokens_per_s,
        wall_time=record.wall_time,
        experts=[
            pb.ExpertLoad(
                layer=e.layer,
                tokens_per_expert=e.tokens_per_expert,
                dropped_fraction=e.dropped_fraction,
                local_fraction=e.local_fraction,
                tokens_by_slice=[n for row in e.tokens_by_slice for n in row],
            )
            for e in record.experts
        ],
        dcn_bytes=record.dcn_bytes,
        dcn_segments=record.dcn_segments,
        dcn_window=record.dcn_window,
    )


def job_to_pb(job: Job) -> pb.JobInfo:
    spec = job.spec
    info = pb.JobInfo(
        job_id=job.job_id,
        program=spec.program,
        state=pb.JobState.Value(f"JOB_STATE_{job.state.name}"),
        step=job.step,
        steps=spec.steps,
        gang_id=job.gang_id,
        error=job.error,
        num_slices=spec.num_slices,
        slice_type=spec.slice_type,
        overrides=dict(spec.overrides),
        client=spec.client,
        created_at=job.created_at,
        updated_at=job.updated_at,
        flops_per_step=job.flops_per_step,
        checkpoint_every=spec.checkpoint_every,
        checkpoint_dir=spec.checkpoint_dir,
    )
    if job.committed_step is not None:
        info.committed_step = job.committed_step
    info.preemptions = job.preemptions
    info.restarts = job.restarts
    info.failures = job.failures
    info.max_failures = job.spec.max_failures
    info.elastic_min_slices = job.spec.elastic_min_slices
    info.gang_slices = job.gang_slices
    info.peer_recovery = bool(job.spec.peer_recovery)
    if job.spec.max_preemptions is not None:
        info.max_preemptions = job.spec.max_preemptions
    info.keep_checkpoints = job.spec.keep_checkpoints
    info.keep_steps.extend(sorted(job.keep_steps))
    if job.resumed_from is not None:
        info.resumed_from_step = job.resumed_from
    for r in job.recoveries:
        recovery = info.recoveries.add(
            cause=r.cause,
            failed_at_step=r.failed_at_step,
            fault_at=r.fault_at,
            detected_at=r.detected_at,
            resumed_at=r.resumed_at,
            steps_lost=r.steps_lost,
            source=r.source,
        )
        if r.resumed_from is not None:
            recovery.resumed_from_step = r.resumed_from
    if job.mesh is not None:
        info.mesh.CopyFrom(mesh_to_pb(job.mesh))
    if job.last is not None:
        info.last.CopyFrom(step_to_pb(job.last))
    if job.dcn_predicted is not None:
        info.dcn_predicted = True
        info.dcn_bytes_predicted = job.dcn_predicted.bytes
        info.dcn_messages_predicted = job.dcn_predicted.messages
    return info
