"""The controller's side of direct puts and fetches, on an in-memory cluster: what it
authorizes (each host's pieces, a capability for exactly them), what finishing queues,
and that a transfer abandoned, left to expire, or outlived by its gang leaves nothing
behind and breaks nothing. No processes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from controller.core import Controller
from controller.options import ControllerOptions
from controller.servicer import ControllerServicer
from protos import controller_pb2 as pb
from slicewise import wire
from slicewise.common import capability
from slicewise.common.arrays import ArraySpec
from slicewise.common.errors import CapacityError, FailedPreconditionError, NotFoundError
from slicewise.common.mesh import MeshSpec, ShardingSpec
from slicewise.common.ops import PinOp, PutOp
from tests.unit.fake_cluster import Clock, FakeCluster, FakeContext

TIMEOUT = 10.0
V4 = "v5litepod-16"  # four hosts of 4 chips
MESH = MeshSpec.build({"slice": 1}, {"data": 4, "model": 4})
SPEC = ArraySpec((16, 8), "float32")
TTL_S = 0.05


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def gang_of_four(ttl_s: float = 300.0) -> tuple[Controller, str, FakeCluster]:
    cluster = FakeCluster(V4)
    options = ControllerOptions(direct_transfer_ttl_s=ttl_s)
    controller = Controller(backend=cluster, clock=Clock(), simulated=True, options=options)
    await controller.refresh_inventory()
    _, gang_id = await controller.allocate(1, V4)
    return controller, gang_id, cluster


def dropped_staged(controller: Controller, gang_id: str) -> list[tuple[str, int]]:
    """Records the gang's drops of staged pieces instead of sending them."""
    drops: list[tuple[str, int]] = []

    async def drop(key: str, expires: int) -> None:
        drops.append((key, expires))

    controller.gangs[gang_id].drop_staged = drop  # type: ignore[method-assign]
    return drops


def test_a_direct_put_gives_each_host_its_pieces_and_a_capability_for_their_bytes():
    async def scenario() -> tuple[Any, str, list[Any]]:
        controller, gang_id, cluster = await gang_of_four()
        sharding = ShardingSpec.from_partition_spec(MESH, ("data", "model"))
        transfer = controller.begin_direct_put(gang_id, SPEC, sharding)
        record = controller.finish_direct_put(transfer.transfer_id)
        await until(lambda: any(isinstance(op, PutOp) for op in cluster.channels[0].sent))
        token = controller.gangs[gang_id]._token
        return transfer, token, [record, cluster.channels[0].sent]

    transfer, token, (record, sent) = run(scenario())
    assert [h.process_id for h in transfer.hosts] == [0, 1, 2, 3]
    covered = 0
    for host in transfer.hosts:
        nbytes = sum((b0 - a0) * (b1 - a1) * 4 for (a0, b0), (a1, b1) in host.pieces)
        covered += nbytes
        grant = capability.check(token, host.capability, "put", transfer.transfer_id, time.time())
        assert grant.nbytes == nbytes == SPEC.nbytes // 4
        with pytest.raises(capability.CapabilityError):
            capability.check(token, host.capability, "get", transfer.transfer_id, time.time())
    assert covered == SPEC.nbytes
    (put,) = [op for op in sent if isinstance(op, PutOp)]
    assert (put.handle, put.staged_key) == (record.handle, transfer.transfer_id)


def test_a_direct_put_is_checked_like_any_put_and_finishes_once():
    async def scenario() -> None:
        controller, gang_id, _ = await gang_of_four()
        huge = ArraySpec((2**40,), "float32")
        with pytest.raises(CapacityError, match="HBM"):
            controller.begin_direct_put(gang_id, huge, ShardingSpec(MESH, ()))
        with pytest.raises(NotFoundError):
            controller.begin_direct_put("g99", SPEC, ShardingSpec(MESH, ()))
        transfer = controller.begin_direct_put(gang_id, SPEC, ShardingSpec(MESH, ()))
        controller.finish_direct_put(transfer.transfer_id)
        for again in (controller.finish_direct_put, controller.abandon_direct):
            with pytest.raises(NotFoundError, match="finished, abandoned or expired"):
                again(transfer.transfer_id)

    run(scenario())


def test_an_abandoned_or_expired_put_is_dropped_from_the_workers():
    async def scenario() -> tuple[list[Any], list[str]]:
        controller, gang_id, _ = await gang_of_four(ttl_s=TTL_S)
        drops = dropped_staged(controller, gang_id)
        abandoned = controller.begin_direct_put(gang_id, SPEC, ShardingSpec(MESH, ()))
        controller.abandon_direct(abandoned.transfer_id)
        expired = controller.begin_direct_put(gang_id, SPEC, ShardingSpec(MESH, ()))
        await until(lambda: len(drops) == 2)
        with pytest.raises(NotFoundError, match="expired"):
            controller.finish_direct_put(expired.transfer_id)
        return drops, [abandoned.transfer_id, expired.transfer_id]

    drops, keys = run(scenario())
    assert [key for key, _ in drops] == keys
    assert all(expires > time.time() - 60 for _, expires in drops)


def test_a_direct_fetch_pins_the_array_and_unpins_what_is_not_read():
    async def scenario() -> tuple[Any, list[Any], list[str]]:
        controller, gang_id, cluster = await gang_of_four(ttl_s=TTL_S)
        put = controller.begin_direct_put(gang_id, SPEC, ShardingSpec(MESH, ()))
        record = controller.finish_direct_put(put.transfer_id)
        fetch = await controller.begin_direct_fetch(record.handle)
        pins = [op for op in cluster.channels[0].sent if isinstance(op, PinOp)]
        await until(lambda: all(fetch.transfer_id in w.dropped_pins for w in cluster.workers))
        abandoned = await controller.begin_direct_fetch(record.handle)
        controller.abandon_direct(abandoned.transfer_id)
        await until(lambda: all(abandoned.transfer_id in w.dropped_pins for w in cluster.workers))
        token = controller.gangs[gang_id]._token
        return fetch, pins, [token, record.handle]

    fetch, pins, (token, handle) = run(scenario())
    assert [(p.handle, p.pin_id) for p in pins] == [(handle, fetch.transfer_id)]
    assert fetch.record is not None and fetch.record.handle == handle
    for host in fetch.hosts:
        # Valid for reading that pin before it expires (checked at a moment before its
        # deadline, not at the clock's now: the test's TTL is a fraction of a second).
        capability.check(
            token, host.capability, "get", fetch.transfer_id, fetch.expires_unix_s - 0.5
        )


def test_transfers_of_a_gang_released_meanwhile_expire_quietly():
    async def scenario() -> tuple[list[Any], list[list[str]]]:
        controller, gang_id, cluster = await gang_of_four(ttl_s=TTL_S)
        drops = dropped_staged(controller, gang_id)
        put = controller.begin_direct_put(gang_id, SPEC, ShardingSpec(MESH, ()))
        record = controller.finish_direct_put(put.transfer_id)
        await controller.begin_direct_fetch(record.handle)
        controller.begin_direct_put(gang_id, SPEC, ShardingSpec(MESH, ()))
        await controller.release(gang_id)
        await until(lambda: not controller._transfers and not controller._cleanups)
        return drops, [w.dropped_pins for w in cluster.workers]

    drops, pins = run(scenario())
    assert drops == [] and all(p == [] for p in pins)


def test_the_servicer_answers_a_plan_and_maps_refusals_to_status_codes():
    async def scenario() -> tuple[pb.DirectTransfer, list[Any]]:
        controller, gang_id, _ = await gang_of_four()
        servicer = ControllerServicer(controller, jobs=None)
        sharding = ShardingSpec.from_partition_spec(MESH, ("data", None))
        request = pb.BeginDirectPutRequest(
            gang_id=gang_id,
            spec=wire.spec_to_pb(SPEC),
            sharding=wire.sharding_to_pb(sharding),
        )
        plan = await servicer.BeginDirectPut(request, FakeContext())
        codes = []
        for call, bad in (
            (servicer.FinishDirectPut, pb.FinishDirectPutRequest(transfer_id="nope")),
            (servicer.AbandonDirectTransfer, pb.AbandonDirectTransferRequest(transfer_id="")),
            (servicer.BeginDirectFetch, pb.BeginDirectFetchRequest(handle="g1/a999")),
            (servicer.BeginDirectFetch, pb.BeginDirectFetchRequest(handle="x", timeout_s=-1)),
            (servicer.BeginDirectPut, pb.BeginDirectPutRequest(gang_id=gang_id)),
        ):
            context = FakeContext()
            with pytest.raises(grpc.aio.AbortError):
                await call(bad, context)
            codes.append(context.code.name)
        info = await servicer.FinishDirectPut(
            pb.FinishDirectPutRequest(transfer_id=plan.transfer_id), FakeContext()
        )
        assert info.spec == wire.spec_to_pb(SPEC)
        return plan, codes

    plan, codes = run(scenario())
    assert codes == [
        "NOT_FOUND",
        "NOT_FOUND",
        "NOT_FOUND",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
    ]
    # The transfer's deadline (the default TTL, 300 s) lies ahead: no duration is measured.
    deadline = plan.expires_unix_s
    assert len(plan.hosts) == 4 and deadline > time.time()
    assert [len(h.pieces) for h in plan.hosts] == [1, 1, 1, 1]
    assert all(h.data_address and h.capability for h in plan.hosts)


def test_finishing_a_put_on_a_gang_that_stopped_is_refused():
    async def scenario() -> None:
        controller, gang_id, _ = await gang_of_four()
        put = controller.begin_direct_put(gang_id, SPEC, ShardingSpec(MESH, ()))
        await controller.release(gang_id)
        with pytest.raises(FailedPreconditionError):
            controller.finish_direct_put(put.transfer_id)

    run(scenario())
