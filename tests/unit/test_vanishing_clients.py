"""A client that goes away in the middle of a put, a fetch or a program upload (its call
is cancelled, as gRPC does when the connection drops) leaves nothing behind: the bytes
the controller held for the transfer are counted down to 0, and pieces already on their
way to the workers are taken off them again. In-memory cluster, no processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from controller import metrics
from controller.core import Controller
from controller.servicer import ControllerServicer
from protos import controller_pb2 as pb
from slicewise import wire
from slicewise.common.arrays import ArraySpec
from slicewise.common.mesh import MeshSpec, ShardingSpec
from slicewise.common.ops import DeleteOp, PutOp
from tests.unit.fake_cluster import Clock, FakeCluster, FakeContext

TIMEOUT = 10.0
V4 = "v5litepod-4"  # one host of 4 chips
MESH = MeshSpec.build({"slice": 1}, {"chip": 4})
SPEC = ArraySpec((1024,), "float32")


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def held(kind: str) -> float:
    return metrics.TRANSFER_BYTES.labels(kind)._value.get()


async def one_host_gang() -> tuple[Controller, ControllerServicer, str, FakeCluster]:
    cluster = FakeCluster(V4)
    controller = Controller(backend=cluster, clock=Clock(), simulated=True)
    await controller.refresh_inventory()
    _, gang_id = await controller.allocate(1, V4)
    return controller, ControllerServicer(controller, jobs=None), gang_id, cluster


async def stalls_after(*messages: Any) -> AsyncIterator[Any]:
    """A request stream that sends `messages`, then nothing more (the client hangs)."""
    for m in messages:
        yield m
    await asyncio.Event().wait()


async def cancelled_once_holding(kind: str, call: Any) -> tuple[float, float]:
    """Runs a servicer call until the controller holds bytes for it, then cancels it (the
    client went away); returns the bytes held then, and after."""
    before = held(kind)
    task = asyncio.ensure_future(call)
    await until(lambda: held(kind) > before)
    during = held(kind) - before
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return during, held(kind) - before


def test_a_put_cancelled_mid_stream_releases_its_buffer():
    async def scenario() -> tuple[float, float, int]:
        controller, servicer, gang_id, _ = await one_host_gang()
        header = pb.PutHeader(
            gang_id=gang_id,
            spec=wire.spec_to_pb(SPEC),
            sharding=wire.sharding_to_pb(ShardingSpec(MESH, ())),
        )
        during, after = await cancelled_once_holding(
            "put",
            servicer.PutArray(
                stalls_after(pb.PutChunk(header=header), pb.PutChunk(data=b"\0" * 1024)),
                FakeContext(),
            ),
        )
        return during, after, len(controller.arrays)

    assert run(scenario()) == (SPEC.nbytes, 0, 0)


def test_a_program_upload_cancelled_mid_stream_releases_its_bytes():
    async def scenario() -> tuple[float, float, int]:
        controller, servicer, gang_id, _ = await one_host_gang()
        header = pb.ProgramHeader(
            gang_id=gang_id, name="p", mesh=wire.mesh_to_pb(MESH), total_bytes=4096
        )
        during, after = await cancelled_once_holding(
            "program",
            servicer.RegisterProgram(
                stalls_after(pb.ProgramChunk(header=header), pb.ProgramChunk(data=b"x" * 1000)),
                FakeContext(),
            ),
        )
        return during, after, len(controller.programs)

    assert run(scenario()) == (1000, 0, 0)


def test_a_fetch_cancelled_mid_stream_releases_its_array():
    async def scenario() -> tuple[float, float, float, list[bytes]]:
        controller, servicer, gang_id, _ = await one_host_gang()
        record = controller.arrays.new(gang_id, SPEC)
        record.settle(None)
        record.numbered = True
        gang = controller.gangs[gang_id]
        data = np.arange(1024, dtype=np.float32)

        async def read(pin_id: str) -> list[Any]:
            return [[((slice(0, 1024),), data)]]

        gang.read = read  # type: ignore[method-assign]
        before = held("fetch")
        stream = servicer.FetchArray(pb.FetchArrayRequest(handle=record.handle), FakeContext())
        first = [await stream.__anext__(), await stream.__anext__()]  # header, first data
        during = held("fetch") - before
        await stream.aclose()  # what gRPC does to the stream of a client that went away
        return during, held("fetch") - before, len(first), [c.data for c in first]

    during, after, n, chunks = run(scenario())
    assert (during, after, n) == (SPEC.nbytes, 0, 2)
    assert chunks[1] == np.arange(1024, dtype=np.float32).tobytes()


def test_a_put_cancelled_while_its_pieces_are_staged_takes_them_off_the_workers():
    async def scenario() -> tuple[list[Any], int]:
        controller, _, gang_id, cluster = await one_host_gang()
        gang = controller.gangs[gang_id]
        arrived = asyncio.Event()
        staged = asyncio.Event()

        async def stage(key: str, array: Any, indices: Any) -> None:
            arrived.set()
            await staged.wait()  # the pieces are on their way

        gang.stage = stage  # type: ignore[method-assign]
        target = controller.begin_put(gang_id, SPEC, ShardingSpec(MESH, ()))
        task = asyncio.ensure_future(controller.finish_put(target))
        await arrived.wait()
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        staged.set()  # the pieces reached the workers
        channel = cluster.channels[0]
        await until(lambda: any(isinstance(op, DeleteOp) and op.handles for op in channel.sent))
        return channel.sent, len(controller.arrays)

    sent, live = run(scenario())
    (put,) = [op for op in sent if isinstance(op, PutOp)]
    (delete,) = [op for op in sent if isinstance(op, DeleteOp) and op.handles]
    assert delete.handles == (put.handle,) and delete.seq > put.seq
    assert live == 0
