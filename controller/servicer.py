"""The gRPC edge of the controller: protobuf in, calls into `Controller`, protobuf out.

Errors become status codes here and nowhere else, by the table in
slicewise/common/errors.py (each error class names its code); an unexpected error
becomes INTERNAL for that one call and the controller keeps serving everyone else.
Request bytes that do not parse reach the servicer too (see `TolerantParsing`), and are
refused as INVALID_ARGUMENT like any other client mistake.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any, cast

import grpc
import numpy as np

from controller import messages, metrics
from controller.auth import current_identity, may_see
from controller.core import VERSION, Controller, DirectTransfer, StreamProgress
from controller.gang import Gang, worker_name
from controller.job import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_KEEP_CHECKPOINTS,
    DEFAULT_MAX_FAILURES,
    JobSpec,
)
from controller.jobs import JobRunner
from controller.logs import JOB_LOG, set_log_context
from controller.programs import ProgramUpload
from protos import controller_pb2 as pb
from protos import controller_pb2_grpc as pb_grpc
from slicewise import wire
from slicewise.common.errors import FailedPreconditionError, InvalidRequestError, SlicewiseError
from slicewise.common.limits import check_seconds

log = logging.getLogger(__name__)

# The newest lines of each source `slicewise logs` sends unless it asks for another number.
DEFAULT_LOG_TAIL = 200


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The status an error travels as: its class's (slicewise/common/errors.py), or
    INTERNAL for anything that is not one of ours (a bug)."""
    if isinstance(exc, SlicewiseError):
        return grpc.StatusCode[exc.status]
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code = status_code_for(exc)
    metrics.FAILURES.labels(f"rpc_{code.name.lower()}").inc()
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed unexpectedly", method)
        message = f"internal error in {method}: {type(exc).__name__}: {exc}"
    else:
        log.info("%s refused (%s): %s", method, code.name, exc)
        message = str(exc)
    await context.abort(code, message)


class MalformedMessage:
    """Stands in for a request message whose bytes did not parse (see TolerantParsing)."""

    def __init__(self, error: str) -> None:
        self.error = error


class TolerantParsing(grpc.aio.ServerInterceptor):
    """Hands the servicer a MalformedMessage for request bytes that do not parse, so that
    they are refused as INVALID_ARGUMENT: grpc.aio parses a unary request before any
    handler runs and answers UNKNOWN when that fails, and it parses each message of a
    request stream inside the handler's loop, where the failure would be INTERNAL."""

    def __init__(self) -> None:
        # method -> (the handler it resolved to, its tolerant version): one entry per
        # method of the service, however many handlers other interceptors make.
        self._tolerant: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._tolerant.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._tolerant[method] = (handler, _tolerant(handler))
        return cached[1]


def _tolerant(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever a parser raises
            return MalformedMessage(f"{type(exc).__name__}: {exc}")

    if handler.request_streaming and handler.response_streaming:
        make, behaviour = grpc.stream_stream_rpc_method_handler, handler.stream_stream
    elif handler.request_streaming:
        make, behaviour = grpc.stream_unary_rpc_method_handler, handler.stream_unary
    elif handler.response_streaming:
        make, behaviour = grpc.unary_stream_rpc_method_handler, handler.unary_stream
    else:
        make, behaviour = grpc.unary_unary_rpc_method_handler, handler.unary_unary
    return make(
        behaviour,
        request_deserializer=deserialize,
        response_serializer=handler.response_serializer,
    )


def _parsed(request: Any, method: str) -> Any:
    """The request, refused if it did not parse; a request stream is checked as its
    messages arrive."""
    if isinstance(request, MalformedMessage):
        raise _malformed(method, request)
    if hasattr(request, "__aiter__"):
        return _parsed_stream(request, method)
    return request


async def _parsed_stream(messages: AsyncIterator[Any], method: str) -> AsyncIterator[Any]:
    async for message in messages:
        if isinstance(message, MalformedMessage):
            raise _malformed(method, message)
        yield message


def _malformed(method: str, message: MalformedMessage) -> InvalidRequestError:
    return InvalidRequestError(
        f"{method} received bytes that are not a valid request message ({message.error}); "
        "build requests with the stubs generated from protos/controller.proto"
    )


def _unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    timer = metrics.RPC_SECONDS.labels(fn.__name__)

    @functools.wraps(fn)
    async def wrapper(
        self: ControllerServicer, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        started = time.perf_counter()
        set_log_context(gang=getattr(request, "gang_id", ""))
        try:
            request = _parsed(request, fn.__name__)
            return await fn(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never crashes the server
            await _abort(context, fn.__name__, exc)
        finally:
            timer.observe(time.perf_counter() - started)

    return wrapper


def _streaming(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    @functools.wraps(fn)
    async def wrapper(
        self: ControllerServicer, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            request = _parsed(request, fn.__name__)
            # Closed with this stream, not whenever it is collected: a client that went
            # away leaves nothing held (a fetch's array) behind.
            body = cast(AsyncGenerator[Any, None], fn(self, request, context))
            async with contextlib.aclosing(body) as stream:
                async for item in stream:
                    yield item
        except Exception as exc:  # noqa: BLE001
            await _abort(context, fn.__name__, exc)

    return wrapper


@contextlib.contextmanager
def _holding(kind: str) -> Iterator[Callable[[int], None]]:
    """Counts the bytes a transfer holds (`hold(n)` as they arrive) in the
    TRANSFER_BYTES gauge until the transfer ends, however it ends: also when its client
    goes away (the call is cancelled) or sends garbage."""
    gauge = metrics.TRANSFER_BYTES.labels(kind)
    held = 0

    def hold(nbytes: int) -> None:
        nonlocal held
        held += nbytes
        gauge.inc(nbytes)

    try:
        yield hold
    finally:
        gauge.dec(held)


def _transfer_to_pb(transfer: DirectTransfer) -> pb.DirectTransfer:
    return pb.DirectTransfer(
        transfer_id=transfer.transfer_id,
        expires_unix_s=transfer.expires_unix_s,
        hosts=[
            pb.HostTransfer(
                process_id=h.process_id,
                data_address=h.address,
                capability=h.capability,
                pieces=[
                    pb.PieceIndex(ranges=[pb.IndexRange(start=a, stop=b) for a, b in piece])
                    for piece in h.pieces
                ],
            )
            for h in transfer.hosts
        ],
        array=messages.array_to_pb(transfer.record) if transfer.record else None,
    )


def gang_to_pb(gang: Gang, gang_id: str) -> pb.GangInfo:
    """What a client learns about the gang it allocated (under the id it should use)."""
    return pb.GangInfo(
        gang_id=gang_id,
        slice_type=gang.slice_type.name,
        num_slices=gang.shape.num_slices,
        hosts_per_slice=gang.shape.hosts_per_slice,
        chips_per_host=gang.shape.chips_per_host,
        slices=[s.name for s in gang.slices],
        platform=gang.platform,
        topology=gang.slice_type.topology,
    )


def shares_to_pb(gang: Gang) -> list[pb.ClientShare]:
    waiting = gang.dispatcher.shares()
    return [
        pb.ClientShare(
            attachment=a,
            client=client,
            weight=weight,
            programs_run=gang.programs_run[a],
            waiting=waiting.get(a, (0, 0, 0))[2],
        )
        for a, (client, weight) in gang.attachments.items()
    ]


class ControllerServicer(pb_grpc.ControllerServicer):
    """Implements the Controller service of protos/controller.proto."""

    def __init__(
        self,
        controller: Controller,
        jobs: JobRunner,
        *,
        simulation_pid: int = 0,
        ray_address: str = "",
        ray_auth_token_path: str = "",
    ) -> None:
        self.controller = controller
        self.jobs = jobs
        self.simulation_pid = simulation_pid
        self.ray_address = ray_address
        self.ray_auth_token_path = ray_auth_token_path

    @_unary
    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:
        c = self.controller
        return pb.HealthResponse(
            version=VERSION,
            simulated=c.simulated,
            uptime_s=time.time() - c.started_at,
            num_gangs=len(c.gangs),
            simulation_pid=self.simulation_pid,
            ray_address=self.ray_address,
            ray_auth_token_path=self.ray_auth_token_path,
        )

    @_unary
    async def GetClusterInfo(self, request: pb.ClusterInfoRequest, context: Any) -> pb.ClusterInfo:
        c = self.controller
        info = pb.ClusterInfo(simulated=c.simulated, platform="cpu" if c.simulated else "tpu")
        for s in sorted(c.scheduler.inventory.values(), key=lambda s: s.name):
            holder = c.scheduler.holder(s.name) or ""
            state = (
                pb.SLICE_STATE_HELD
                if holder
                else pb.SLICE_STATE_FREE
                if s.intact
                else pb.SLICE_STATE_BROKEN
            )
            info.slices.append(
                pb.SliceInfo(
                    name=s.name,
                    slice_type=s.type.name,
                    topology=s.type.topology,
                    chips=s.type.chips,
                    state=state,
                    holder_gang=holder,
                    hosts=[
                        pb.HostInfo(
                            node_id=h.node_id,
                            address=h.address,
                            worker_id=h.worker_id,
                            chips=h.chips,
                            alive=h.alive,
                        )
                        for h in s.hosts
                    ],
                )
            )
        info.slice_types.extend(sorted({s.type.name for s in c.scheduler.inventory.values()}))
        for gang in c.gangs.values():
            if not may_see(gang.tenant):
                continue
            info.gangs.append(
                pb.GangSummary(
                    gang_id=gang.gang_id,
                    client=gang.client,
                    slice_type=gang.slice_type.name,
                    slices=[s.name for s in gang.slices],
                    dispatched=gang.dispatcher.dispatched,
                    completed=gang.dispatcher.completed,
                    live_arrays=c.arrays.count(gang.gang_id),
                    state=gang.state.value,
                    priority=gang.priority,
                    shared_name=gang.shared_name,
                    shares=shares_to_pb(gang),
                )
            )
        now = c.scheduler.clock()
        for queued in c.scheduler.queue_snapshot():
            r = queued.request
            info.queue.append(
                pb.QueuedRequest(
                    request_id=r.request_id,
                    client=r.client,
                    num_slices=r.num_slices,
                    slice_types=[t.name for t in r.slice_types],
                    priority=r.priority,
                    position=queued.position,
                    waited_s=now - r.submitted_at,
                    reason=queued.reason,
                )
            )
        return info

    @_unary
    async def AllocateGang(self, request: pb.AllocateGangRequest, context: Any) -> pb.GangInfo:
        gang, gang_id = await self.controller.allocate(
            request.num_slices,
            request.slice_type,
            timeout_s=check_seconds(
                "AllocateGangRequest.timeout_s",
                request.timeout_s,
                "0 means the controller's default",
            ),
            client=request.client or (context.peer() or ""),
            priority=request.priority,
            max_wait_s=check_seconds(
                "AllocateGangRequest.max_wait_s", request.max_wait_s, "0 means no limit"
            )
            or None,
            alternatives=list(request.alternatives),
            same_type=not request.mixed_types,
            shared=request.shared,
            weight=request.weight or 1.0,
        )
        return gang_to_pb(gang, gang_id)

    @_unary
    async def ReleaseGang(
        self, request: pb.ReleaseGangRequest, context: Any
    ) -> pb.ReleaseGangResponse:
        await self.controller.release(request.gang_id, requeue=request.requeue)
        return pb.ReleaseGangResponse()

    @_streaming
    async def WatchGang(
        self, request: pb.WatchGangRequest, context: Any
    ) -> AsyncIterator[pb.GangEvent]:
        gang = self.controller.get_gang(request.gang_id, usable=False)
        queue = gang.watch()
        try:
            while True:
                kind, message = await queue.get()
                now = self.controller.scheduler.clock()
                grace = max(0.0, gang.preempt_deadline - now) if kind == "preempt" else 0.0
                yield pb.GangEvent(kind=kind, message=message, grace_s=grace)
                if kind == "released":
                    return
        finally:
            gang.unwatch(queue)

    @_unary
    async def RegisterProgram(
        self, request_iterator: AsyncIterator[pb.ProgramChunk], context: Any
    ) -> pb.ProgramInfo:
        header: pb.ProgramHeader | None = None
        upload: ProgramUpload | None = None
        with _holding("program") as hold:
            async for chunk in request_iterator:
                if upload is None:
                    if not chunk.HasField("header"):
                        raise InvalidRequestError(
                            "RegisterProgram's first message must be a header"
                        )
                    header = chunk.header
                    self.controller.get_gang(header.gang_id)  # fail fast, before the bytes
                    upload = ProgramUpload(header.name, header.total_bytes)
                elif chunk.HasField("header"):
                    raise InvalidRequestError(
                        "RegisterProgram received a second header; send one header, then data"
                    )
                else:
                    upload.add(chunk.data)
                    hold(len(chunk.data))
            if header is None or upload is None:
                raise InvalidRequestError("RegisterProgram received no messages")
            program = await self.controller.register_program(
                header.gang_id, header.name, wire.mesh_from_pb(header.mesh), upload.serialized()
            )
        return pb.ProgramInfo(
            program_id=program.program_id,
            name=program.name,
            inputs=[wire.spec_to_pb(s) for s in program.inputs],
            outputs=[wire.spec_to_pb(s) for s in program.outputs],
            num_devices=program.num_devices,
        )

    @_unary
    async def PutArray(
        self, request_iterator: AsyncIterator[pb.PutChunk], context: Any
    ) -> pb.ArrayInfo:
        target = None
        offset = 0
        started = time.perf_counter()
        with _holding("put") as hold:
            async for chunk in request_iterator:
                if target is None:
                    if not chunk.HasField("header"):
                        raise InvalidRequestError("PutArray's first message must be a header")
                    h = chunk.header
                    target = self.controller.begin_put(
                        h.gang_id, wire.spec_from_pb(h.spec), wire.sharding_from_pb(h.sharding)
                    )
                    hold(len(target.buffer))
                    continue
                if chunk.HasField("header"):
                    raise InvalidRequestError(
                        "PutArray received a second header; send one header, then data"
                    )
                data = chunk.data
                if offset + len(data) > len(target.buffer):
                    raise InvalidRequestError(
                        f"PutArray sent more than the {len(target.buffer)} bytes a "
                        f"{target.spec} array has"
                    )
                target.buffer[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
                offset += len(data)
            if target is None:
                raise InvalidRequestError("PutArray received no messages")
            if offset != len(target.buffer):
                raise InvalidRequestError(
                    f"PutArray sent {offset} bytes, but a {target.spec} array has "
                    f"{len(target.buffer)}"
                )
            log.debug("PutArray received %d bytes in %.3f s", offset, time.perf_counter() - started)
            return messages.array_to_pb(await self.controller.finish_put(target))

    @_unary
    async def Execute(self, request: pb.ExecuteRequest, context: Any) -> pb.ExecuteResponse:
        seq, outputs = self.controller.execute(
            request.gang_id, request.program_id, list(request.inputs)
        )
        return pb.ExecuteResponse(outputs=[messages.array_to_pb(r) for r in outputs], sequence=seq)

    @_unary
    async def ExecuteBatch(
        self, request: pb.ExecuteBatchRequest, context: Any
    ) -> pb.ExecuteBatchResponse:
        results = self.controller.execute_batch(
            request.gang_id, [(c.program_id, list(c.inputs)) for c in request.calls]
        )
        return pb.ExecuteBatchResponse(
            results=[
                pb.ExecuteResponse(outputs=[messages.array_to_pb(r) for r in outputs], sequence=seq)
                for seq, outputs in results
            ]
        )

    @_streaming
    async def Calls(
        self, request: AsyncIterator[pb.CallBatch], context: Any
    ) -> AsyncIterator[pb.CallEvent]:
        stream = ""
        try:
            async with contextlib.aclosing(self._calls(request, context)) as events:
                async for event in events:
                    if isinstance(event, str):
                        stream = event
                        continue
                    yield event
        finally:
            if stream:
                self.controller.stream_closed(stream)

    async def _calls(
        self, request: AsyncIterator[pb.CallBatch], context: Any
    ) -> AsyncGenerator[pb.CallEvent | str, None]:
        """The body of `Calls`; yields the stream's prefix (a str) once it is known."""
        gang_id, last, calls = "", 0, 0
        progress: StreamProgress | None = None
        async for batch in request:
            if batch.gang_id and gang_id and batch.gang_id != gang_id:
                raise InvalidRequestError(
                    f"batch {batch.batch} of a call stream on gang {gang_id} names gang "
                    f"{batch.gang_id!r}; open one stream per gang"
                )
            if not gang_id:
                if not batch.gang_id:
                    raise InvalidRequestError(
                        "the first CallBatch of a call stream must name its gang (gang_id)"
                    )
                # The caller's gang (another tenant's answers NOT_FOUND), before anything
                # of the stream is registered.
                self.controller.manager.resolve(batch.gang_id, usable=False)
                gang_id = batch.gang_id
            if batch.batch <= last:
                raise InvalidRequestError(
                    f"call-stream batch {batch.batch} after batch {last}; number batches "
                    "1, 2, 3... in the order sent"
                )
            last = batch.batch
            set_log_context(gang=gang_id)
            if progress is None and batch.stream:
                prefix = batch.stream
                if not prefix.startswith(gang_id.partition("@")[0] + "/c") or len(prefix) > 100:
                    raise InvalidRequestError(
                        f'call-stream prefix {prefix[:100]!r} is not "<gang>/c<tag>" for '
                        f"gang {gang_id}"
                    )
                progress = self.controller.stream_opened(prefix)
                if progress.batch:
                    raise InvalidRequestError(
                        f"call-stream prefix {prefix} is in use by another stream; choose a "
                        "new tag for each stream"
                    )
                yield prefix
            specs = [(c.program_id, list(c.inputs), list(c.outputs), c.repeat) for c in batch.calls]
            metrics.STREAM_MESSAGES.inc()
            metrics.STREAM_CALLS.inc(len(specs))
            try:
                refused = self.controller.stream_calls(gang_id, specs) if specs else []
            except SlicewiseError as exc:  # the gang: every call of the batch is refused
                if self.controller.gangs.get(gang_id.partition("@")[0]) is None:
                    raise  # released: the stream ends with why
                refused = [(k, exc) for k in range(len(specs))]
            for k, why in refused:
                code = status_code_for(why)
                metrics.FAILURES.labels(f"rpc_{code.name.lower()}").inc()
                log.info("Calls: call %d refused (%s): %s", calls + k + 1, code.name, why)
                yield pb.CallEvent(
                    failure=pb.CallFailure(
                        batch=batch.batch,
                        index=k,
                        call=calls + k + 1,
                        program_id=specs[k][0],
                        outputs=specs[k][2],
                        code=code.value[0],
                        message=str(why),
                    )
                )
            calls += len(specs)
            if batch.deletes:
                self.controller.delete_quietly(list(batch.deletes))
            if progress is not None:
                progress.advance(batch.batch)
            if batch.sync:
                yield pb.CallEvent(accepted=batch.batch)

    @_streaming
    async def FetchArray(
        self, request: pb.FetchArrayRequest, context: Any
    ) -> AsyncIterator[pb.FetchChunk]:
        timeout_s = check_seconds(
            "FetchArrayRequest.timeout_s", request.timeout_s, "0 means the controller's default"
        )
        await self.controller.after_stream([request.handle], request.after_batch)
        with _holding("fetch") as hold:
            record, array = await self.controller.fetch(request.handle, timeout_s)
            hold(array.nbytes)
            yield pb.FetchChunk(header=messages.array_to_pb(record))
            for piece in wire.chunks(array.reshape(-1).view(np.uint8).data):
                yield pb.FetchChunk(data=bytes(piece))

    @_unary
    async def BeginDirectPut(
        self, request: pb.BeginDirectPutRequest, context: Any
    ) -> pb.DirectTransfer:
        transfer = self.controller.begin_direct_put(
            request.gang_id,
            wire.spec_from_pb(request.spec),
            wire.sharding_from_pb(request.sharding),
        )
        return _transfer_to_pb(transfer)

    @_unary
    async def FinishDirectPut(
        self, request: pb.FinishDirectPutRequest, context: Any
    ) -> pb.ArrayInfo:
        return messages.array_to_pb(self.controller.finish_direct_put(request.transfer_id))

    @_unary
    async def BeginDirectFetch(
        self, request: pb.BeginDirectFetchRequest, context: Any
    ) -> pb.DirectTransfer:
        timeout_s = check_seconds(
            "BeginDirectFetchRequest.timeout_s",
            request.timeout_s,
            "0 means the controller's default",
        )
        await self.controller.after_stream([request.handle], request.after_batch)
        return _transfer_to_pb(await self.controller.begin_direct_fetch(request.handle, timeout_s))

    @_unary
    async def AbandonDirectTransfer(
        self, request: pb.AbandonDirectTransferRequest, context: Any
    ) -> pb.AbandonDirectTransferResponse:
        self.controller.abandon_direct(request.transfer_id)
        return pb.AbandonDirectTransferResponse()

    @_unary
    async def WaitArrays(
        self, request: pb.WaitArraysRequest, context: Any
    ) -> pb.WaitArraysResponse:
        timeout_s = check_seconds(
            "WaitArraysRequest.timeout_s", request.timeout_s, "0 waits until they settle"
        )
        await self.controller.after_stream(request.handles, request.after_batch)
        records = await self.controller.wait(list(request.handles), timeout_s)
        return pb.WaitArraysResponse(arrays=[messages.array_to_pb(r) for r in records])

    @_unary
    async def DeleteArrays(
        self, request: pb.DeleteArraysRequest, context: Any
    ) -> pb.DeleteArraysResponse:
        return pb.DeleteArraysResponse(deleted=self.controller.delete(list(request.handles)))

    @_unary
    async def GetGangStats(self, request: pb.GangStatsRequest, context: Any) -> pb.GangStats:
        gang = self.controller.get_gang(request.gang_id)
        stats = await gang.worker_stats()
        d = gang.dispatcher
        return pb.GangStats(
            gang_id=gang.gang_id,
            dispatched=d.dispatched,
            completed=d.completed,
            queued=d.queued,
            streamed_calls=gang.streamed_calls,
            stream_batches=gang.stream_batches,
            workers=[
                pb.WorkerStats(
                    actor_name=worker_name(gang.gang_id, gang.epoch, s["process_id"]),
                    process_id=s["process_id"],
                    pid=s["pid"],
                    arrays=s["arrays"],
                    bytes=s["bytes"],
                    programs=s["programs"],
                    next_sequence=s["next_seq"],
                    max_in_flight=s["max_in_flight"],
                    window=s["window"],
                    pins=s["pins"],
                    data_address=gang.data_addresses[s["process_id"]],
                    staged=s["staged"],
                    control_frames_in=s["control"].get("frames_in", 0),
                    control_ops_in=s["control"].get("ops_in", 0),
                    control_frames_out=s["control"].get("frames_out", 0),
                    control_completions_out=s["control"].get("completions_out", 0),
                )
                for s in stats
            ],
            shares=shares_to_pb(gang),
        )

    @_streaming
    async def GetTrace(
        self, request: pb.GetTraceRequest, context: Any
    ) -> AsyncIterator[pb.TraceChunk]:
        gang_id = request.id
        job = self.jobs.find(request.id)
        if job is not None:  # a job's timeline is its gang's
            if not job.gang_id:
                raise FailedPreconditionError(
                    f"job {job.job_id} has no gang yet ({job.state.name.lower()}); "
                    "trace it once it runs"
                )
            gang_id = job.gang_id
        trace = await self.controller.trace(gang_id)
        data = json.dumps(trace).encode()
        for piece in wire.chunks(memoryview(data)):
            yield pb.TraceChunk(data=bytes(piece))

    # -- jobs ---------------------------------------------------------------------------

    @_unary
    async def SubmitJob(self, request: pb.SubmitJobRequest, context: Any) -> pb.JobInfo:
        num_slices, slice_type = request.num_slices, request.slice_type
        if request.gang_id:
            gang = self.controller.manager.get(request.gang_id)
            num_slices, slice_type = gang.shape.num_slices, gang.slice_type.name
        spec = JobSpec(
            program=request.program,
            num_slices=num_slices,
            slice_type=slice_type,
            steps=request.steps,
            overrides=tuple(sorted(request.overrides.items())),
            mesh=tuple((a.name, a.dcn, a.ici) for a in request.mesh.axes),
            client=request.client or (context.peer() or ""),
            gang_id=request.gang_id,
            checkpoint_every=(
                request.checkpoint_every
                if request.HasField("checkpoint_every")
                else DEFAULT_CHECKPOINT_EVERY
            ),
            checkpoint_dir=request.checkpoint_dir,
            keep_checkpoints=(
                request.keep_checkpoints
                if request.HasField("keep_checkpoints")
                else DEFAULT_KEEP_CHECKPOINTS
            ),
            keep_steps=tuple(sorted(set(request.keep_steps))),
            max_failures=(
                request.max_failures if request.HasField("max_failures") else DEFAULT_MAX_FAILURES
            ),
            elastic_min_slices=request.elastic_min_slices,
            peer_recovery=(request.peer_recovery if request.HasField("peer_recovery") else None),
            max_preemptions=(
                request.max_preemptions if request.HasField("max_preemptions") else None
            ),
            tenant=current_identity().tenant,
        )
        if not spec.gang_id:  # refused now, as AllocateGang refuses it, not failed once queued
            self.controller.check_can_ever_fit(spec.num_slices, spec.slice_type)
        return messages.job_to_pb(self.jobs.submit(spec))

    @_unary
    async def GetJob(self, request: pb.GetJobRequest, context: Any) -> pb.JobInfo:
        return messages.job_to_pb(self.jobs.get(request.job_id))

    @_unary
    async def ListJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[messages.job_to_pb(j) for j in self.jobs.visible()])

    @_unary
    async def CancelJob(self, request: pb.CancelJobRequest, context: Any) -> pb.JobInfo:
        return messages.job_to_pb(self.jobs.cancel(request.job_id))

    @_unary
    async def KeepCheckpoint(self, request: pb.KeepCheckpointRequest, context: Any) -> pb.JobInfo:
        return messages.job_to_pb(await self.jobs.keep(request.job_id, request.step))

    @_unary
    async def InjectFault(
        self, request: pb.InjectFaultRequest, context: Any
    ) -> pb.InjectFaultResponse:
        message = await self.jobs.inject_fault(
            request.job_id,
            request.kind,
            request.at_step if request.HasField("at_step") else None,
            request.process if request.HasField("process") else None,
        )
        return pb.InjectFaultResponse(message=message)

    @_streaming
    async def WatchJob(
        self, request: pb.WatchJobRequest, context: Any
    ) -> AsyncIterator[pb.JobEvent]:
        async for event in self.jobs.watch(request.job_id):
            yield pb.JobEvent(
                job=messages.job_to_pb(event["job"]),
                message=event["message"],
                steps=[messages.step_to_pb(r) for r in event["steps"]],
            )

    @_streaming
    async def JobLogs(self, request: pb.JobLogsRequest, context: Any) -> AsyncIterator[pb.LogLine]:
        job = self.jobs.get(request.job_id)
        tail = request.tail if request.tail > 0 else DEFAULT_LOG_TAIL
        with JOB_LOG.following(job.job_id) as new:
            sent = 0
            for seq, text in JOB_LOG.lines(job.job_id)[-tail:]:
                sent = seq
                yield pb.LogLine(source="controller", text=text)
            for host, text in await self.jobs.worker_log_tails(job, tail):
                for line in text.splitlines():
                    yield pb.LogLine(source=host, text=line)
            while request.follow and not (job.state.terminal and new.empty()):
                try:
                    seq, text = await asyncio.wait_for(new.get(), timeout=1.0)
                except TimeoutError:
                    continue
                if seq > sent:  # not among the lines sent first
                    yield pb.LogLine(source="controller", text=text)

    @_unary
    async def GetJobMetrics(self, request: pb.GetJobRequest, context: Any) -> pb.JobMetrics:
        job = self.jobs.get(request.job_id)
        return pb.JobMetrics(
            job=messages.job_to_pb(job),
            steps=[messages.step_to_pb(r) for r in self.jobs.steps(job.job_id)],
        )
