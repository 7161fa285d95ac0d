"""Client mistakes at the servicer edge, against an in-memory cluster (no processes):
each is refused with INVALID_ARGUMENT naming the field, and leaves nothing behind: no pin
on a worker, no array record, no program, no operation queued."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import grpc
import pytest

from controller.core import Controller
from controller.servicer import ControllerServicer, MalformedMessage, TolerantParsing
from protos import controller_pb2 as pb
from slicewise.common.arrays import ArraySpec
from slicewise.common.errors import DeadlineError
from slicewise.common.ops import DeleteOp, LoadOp, PinOp
from tests.unit.fake_cluster import Clock, FakeCluster, FakeContext

TIMEOUT = 10.0
V4 = "v5litepod-4"  # one host of 4 chips


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def until(condition):
    while not condition():
        await asyncio.sleep(0.001)


async def refused(call) -> tuple[grpc.StatusCode, str]:
    """The status and message a servicer call (a coroutine, or an async generator for a
    server-streaming method) aborts with."""
    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        result = call(context)
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    return context.code, context.details


async def one_ready_array():
    """A controller with a one-host gang holding one computed array."""
    cluster = FakeCluster(V4)
    controller = Controller(backend=cluster, clock=Clock(), simulated=True)
    await controller.refresh_inventory()
    gang, gang_id = await controller.allocate(1, V4)
    record = controller.arrays.new(gang.gang_id, ArraySpec((4,), "float32"))
    record.settle(None)
    record.numbered = True
    return controller, gang_id, record, cluster.channels[0], cluster.workers[0]


def pins_sent(channel) -> list[str]:
    return [op.pin_id for op in channel.sent if isinstance(op, PinOp)]


# -- fetches leave no pin --------------------------------------------------------------


def test_a_fetch_that_times_out_drops_its_pin_only_after_the_pin_happened():
    async def scenario():
        controller, _, record, channel, worker = await one_ready_array()
        channel.hold = (PinOp,)  # the pin is queued behind slow work
        with pytest.raises(DeadlineError, match="not ready within 0.001 s"):
            await controller.fetch(record.handle, timeout_s=0.001)
        await until(lambda: pins_sent(channel))
        # A drop sent now would reach the worker before the pin and leave it pinned.
        early = list(worker.dropped_pins)
        channel.complete_held()
        await until(lambda: worker.dropped_pins)
        return early, pins_sent(channel), worker.dropped_pins

    early, pinned, dropped = run(scenario())
    assert early == []
    assert dropped == pinned and len(pinned) == 1


def test_a_fetch_cancelled_by_its_client_drops_its_pin_once_the_pin_happened():
    async def scenario():
        controller, _, record, channel, worker = await one_ready_array()
        channel.hold = (PinOp,)
        fetch = asyncio.create_task(controller.fetch(record.handle, timeout_s=60))
        await until(lambda: pins_sent(channel))
        fetch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fetch
        early = list(worker.dropped_pins)
        channel.complete_held()
        await until(lambda: worker.dropped_pins)
        return early, pins_sent(channel), worker.dropped_pins

    early, pinned, dropped = run(scenario())
    assert early == []
    assert dropped == pinned and len(pinned) == 1


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_a_fetch_with_a_bad_timeout_is_refused_before_anything_is_pinned(value):
    async def scenario():
        controller, _, record, channel, _ = await one_ready_array()
        servicer = ControllerServicer(controller, jobs=None)
        request = pb.FetchArrayRequest(handle=record.handle, timeout_s=value)
        status = await refused(lambda ctx: servicer.FetchArray(request, ctx))
        return status, pins_sent(channel)

    (code, details), pinned = run(scenario())
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(
        f"FetchArrayRequest.timeout_s must be a finite number of seconds >= 0, got {value!r}"
    )
    assert pinned == []


# -- every other timeout field ---------------------------------------------------------


@pytest.mark.parametrize("value", [-5.0, math.nan, math.inf])
@pytest.mark.parametrize(
    ("field", "request_of"),
    [
        (
            "WaitArraysRequest.timeout_s",
            lambda h, v: ("WaitArrays", pb.WaitArraysRequest(handles=[h], timeout_s=v)),
        ),
        (
            "AllocateGangRequest.timeout_s",
            lambda h, v: (
                "AllocateGang",
                pb.AllocateGangRequest(num_slices=1, slice_type=V4, timeout_s=v),
            ),
        ),
        (
            "AllocateGangRequest.max_wait_s",
            lambda h, v: (
                "AllocateGang",
                pb.AllocateGangRequest(num_slices=1, slice_type=V4, timeout_s=1, max_wait_s=v),
            ),
        ),
        (
            "AllocateGangRequest.weight",
            lambda h, v: (
                "AllocateGang",
                pb.AllocateGangRequest(num_slices=1, slice_type=V4, timeout_s=1, weight=v),
            ),
        ),
    ],
)
def test_every_timeout_field_refuses_nan_infinite_and_negative_naming_itself(
    field, request_of, value
):
    async def scenario():
        controller, _, record, _, _ = await one_ready_array()
        servicer = ControllerServicer(controller, jobs=None)
        method, request = request_of(record.handle, value)
        status = await refused(lambda ctx: getattr(servicer, method)(request, ctx))
        return status, len(controller.gangs)

    (code, details), gangs = run(scenario())
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert field in details and repr(value) in details
    assert gangs == 1  # nothing allocated, nothing queued


# -- deletes ---------------------------------------------------------------------------


def test_deleting_the_same_handle_twice_in_one_request_deletes_it_once_everywhere():
    async def scenario():
        controller, _, record, channel, _ = await one_ready_array()
        servicer = ControllerServicer(controller, jobs=None)
        h = record.handle
        reply = await servicer.DeleteArrays(pb.DeleteArraysRequest(handles=[h, h]), FakeContext())
        await until(lambda: any(isinstance(op, DeleteOp) and op.handles for op in channel.sent))
        deletes = [op.handles for op in channel.sent if isinstance(op, DeleteOp) and op.handles]
        again = await refused(
            lambda ctx: servicer.DeleteArrays(pb.DeleteArraysRequest(handles=[h]), ctx)
        )
        return h, reply.deleted, deletes, len(controller.arrays), again

    h, deleted, deletes, left, (code, details) = run(scenario())
    assert h.startswith("g1-") and h.endswith("/a1")
    assert deleted == 1
    assert deletes == [(h,)]
    assert left == 0
    assert code is grpc.StatusCode.NOT_FOUND and f"{h} was deleted" in details


# -- program streams -------------------------------------------------------------------


def test_a_program_stream_past_its_declared_size_is_refused_as_the_bytes_arrive():
    pulled = 0

    async def endless(gang_id):
        nonlocal pulled
        mesh = pb.MeshSpec(axes=[pb.MeshAxis(name="chip", dcn=1, ici=4)])
        yield pb.ProgramChunk(
            header=pb.ProgramHeader(gang_id=gang_id, name="p", mesh=mesh, total_bytes=100)
        )
        while True:
            pulled += 1
            yield pb.ProgramChunk(data=b"x" * 30)

    async def scenario():
        controller, gang_id, _, channel, _ = await one_ready_array()
        servicer = ControllerServicer(controller, jobs=None)
        status = await refused(lambda ctx: servicer.RegisterProgram(endless(gang_id), ctx))
        return (
            status,
            len(controller.programs),
            [op for op in channel.sent if isinstance(op, LoadOp)],
        )

    (code, details), programs, loads = run(scenario())
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "sent more than the 100 bytes its header declared (total_bytes" in details
    assert pulled == 4  # refused with the chunk that crossed 100 bytes
    assert programs == 0 and loads == []


# -- bytes that do not parse -----------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
def test_request_bytes_that_do_not_parse_are_refused_as_invalid_argument(streaming):
    async def scenario():
        controller, _, _, _, _ = await one_ready_array()
        servicer = ControllerServicer(controller, jobs=None)
        if streaming:
            generated = grpc.stream_unary_rpc_method_handler(
                servicer.PutArray, request_deserializer=pb.PutChunk.FromString
            )
        else:
            generated = grpc.unary_unary_rpc_method_handler(
                servicer.GetJob, request_deserializer=pb.GetJobRequest.FromString
            )

        async def continuation(details):
            return generated

        call = SimpleNamespace(method="/slicewise.v1.Controller/Method", invocation_metadata=())
        interceptor = TolerantParsing()
        handler = await interceptor.intercept_service(continuation, call)
        assert await interceptor.intercept_service(continuation, call) is handler  # built once
        parsed = handler.request_deserializer(b"\xff\xff\xff")
        if streaming:

            async def stream():
                yield parsed

            status = await refused(lambda ctx: handler.stream_unary(stream(), ctx))
        else:
            status = await refused(lambda ctx: handler.unary_unary(parsed, ctx))
        valid = pb.PutChunk(data=b"x") if streaming else pb.GetJobRequest(job_id="j")
        good = handler.request_deserializer(valid.SerializeToString())
        return parsed, status, good

    parsed, (code, details), good = run(scenario())
    assert isinstance(parsed, MalformedMessage)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid request message (DecodeError" in details
    assert "protos/controller.proto" in details
    assert not isinstance(good, MalformedMessage)  # valid bytes parse as before


def test_a_fetch_hurries_its_pin_on_the_workers():
    """A fetch waits for its pin: the workers are asked to report it as soon as it ran,
    however deep their queue."""

    async def scenario():
        controller, _, record, channel, _ = await one_ready_array()
        channel.hold = (PinOp,)
        with pytest.raises(DeadlineError):
            await controller.fetch(record.handle, timeout_s=0.001)
        await until(lambda: pins_sent(channel))
        pins = [op.seq for op in channel.sent if isinstance(op, PinOp)]
        hurried = list(channel.hurried)
        channel.complete_held()
        return pins, hurried

    pins, hurried = run(scenario())
    assert hurried == pins and len(pins) == 1
