"""Remote arrays a client drops are deleted: the drop queue, and the client's batched
DeleteArrays calls against a recording stub (no controller)."""

from __future__ import annotations

import copy
import gc
import itertools
import threading
import weakref

import grpc
import numpy as np
import pytest

import slicewise
from protos import controller_pb2 as pb
from slicewise import wire
from slicewise.client import DropQueue, Gang, Mesh, Program, RemoteArray
from slicewise.common.arrays import ArraySpec
from slicewise.common.mesh import MeshSpec
from slicewise.testing import wait_until

SPEC = ArraySpec.of((4,), np.float32)


def taken(queue: DropQueue) -> list[str]:
    return queue.take(10**6)


# -- the drop queue ---------------------------------------------------------------------


def test_a_handle_is_queued_when_its_last_lease_holder_is_gone():
    q = DropQueue()
    first = q.lease("g/a1", 16)
    second = q.lease("g/a1", 16)
    assert first is second
    del first
    assert taken(q) == []
    del second
    assert taken(q) == ["g/a1"]
    assert taken(q) == []


def test_a_cancelled_lease_queues_nothing():
    q = DropQueue()
    lease = q.lease("g/a1", 16)
    lease.cancel()
    lease.cancel()  # twice is harmless
    del lease
    gc.collect()
    assert taken(q) == []


def test_a_lease_held_only_by_a_reference_cycle_is_queued_when_the_cycle_is_collected():
    q = DropQueue()
    gc.disable()  # the collector runs when this test says, not at an allocation
    try:
        holder: list[object] = [q.lease("g/a1", 16)]
        holder.append(holder)  # a cycle: only the collector frees it
        del holder
        assert taken(q) == []
        gc.collect()
        assert taken(q) == ["g/a1"]
    finally:
        gc.enable()


def test_take_returns_the_oldest_first_up_to_the_limit():
    q = DropQueue()
    leases = [q.lease(f"g/a{i}", 1) for i in range(5)]
    for i in range(5):
        leases[i] = None
    assert q.take(2) == ["g/a0", "g/a1"]
    assert q.take(10) == ["g/a2", "g/a3", "g/a4"]


def test_forget_discards_the_queue_and_later_drops_of_earlier_leases():
    q = DropQueue()
    old = [q.lease("g/a1", 1), q.lease("g/a2", 1)]
    old.pop()
    q.forget()
    old.pop()
    new = q.lease("g/a3", 1)
    del new
    assert taken(q) == ["g/a3"]


@pytest.mark.parametrize(("count", "nbytes", "due"), [(2, 1, False), (3, 1, True), (1, 100, True)])
def test_due_after_a_batch_of_handles_or_of_bytes(count, nbytes, due):
    q = DropQueue(batch_size=3, batch_bytes=100)
    leases = [q.lease(f"g/a{i}", nbytes) for i in range(count)]
    assert not q.due()
    leases.clear()
    assert q.due() is due


def test_arrays_dropped_on_other_threads_are_all_queued_once():
    q = DropQueue()
    per_thread = 500
    batches = [[q.lease(f"g/t{t}a{i}", 1) for i in range(per_thread)] for t in range(4)]
    threads = [threading.Thread(target=batch.clear) for batch in batches]
    for t in threads:
        t.start()
    got = []
    while any(t.is_alive() for t in threads):
        got += q.take(7)
    for t in threads:
        t.join(timeout=30)
    got += taken(q)
    assert sorted(got) == sorted(f"g/t{t}a{i}" for t in range(4) for i in range(per_thread))


# -- the client against a recording stub -------------------------------------------------


class RecordingStub:
    """Answers PutArray, Execute and DeleteArrays, and records them in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self._ids = itertools.count(1)
        self.deleted: set[str] = set()

    def _new(self) -> pb.ArrayInfo:
        return pb.ArrayInfo(handle=f"g/a{next(self._ids)}", spec=wire.spec_to_pb(SPEC))

    def PutArray(self, messages, timeout=None):  # noqa: N802 - the gRPC method's name
        list(messages)
        info = self._new()
        self.calls.append(("put", [info.handle]))
        return info

    def Execute(self, request, timeout=None):  # noqa: N802
        assert not self.deleted & set(request.inputs), "an input was deleted before the call"
        self.calls.append(("execute", list(request.inputs)))
        return pb.ExecuteResponse(outputs=[self._new()])

    def ExecuteBatch(self, request, timeout=None):  # noqa: N802
        return pb.ExecuteBatchResponse(
            results=[self.Execute(pb.ExecuteRequest(inputs=c.inputs)) for c in request.calls]
        )

    def Calls(self, requests, timeout=None):  # noqa: N802
        """A call stream read on the caller's reader thread, recorded as it is read."""

        def responses():
            for batch in requests:
                for c in batch.calls:
                    assert not self.deleted & set(c.inputs), "an input was deleted before the call"
                    self.calls.append(("execute", list(c.inputs)))
                if batch.deletes:
                    self.DeleteArrays(pb.DeleteArraysRequest(handles=batch.deletes))
                if batch.sync:
                    yield pb.CallEvent(accepted=batch.batch)

        return Responses(responses())

    def DeleteArrays(self, request, timeout=None):  # noqa: N802
        handles = list(request.handles)
        assert len(set(handles)) == len(handles), "a handle was sent twice"
        self.deleted.update(handles)
        self.calls.append(("delete", handles))
        return pb.DeleteArraysResponse(deleted=len(handles))

    def ReleaseGang(self, request, timeout=None):  # noqa: N802
        self.calls.append(("release", []))
        return pb.ReleaseGangResponse()

    def deletes(self) -> list[list[str]]:
        return [handles for kind, handles in self.calls if kind == "delete"]


class Responses:
    """A response stream that can be cancelled, as gRPC's can."""

    def __init__(self, events) -> None:
        self._events = events

    def __iter__(self):
        return self._events

    def cancel(self) -> None:
        self._events.close()


class FakeClient:
    def __init__(self) -> None:
        self.stub = RecordingStub()
        self.closed = False
        self._streams = weakref.WeakSet()
        self.direct_data = False  # its puts go to the recording stub


@pytest.fixture
def gang():
    info = pb.GangInfo(
        gang_id="g", slice_type="v5litepod-1", num_slices=1, hosts_per_slice=1, chips_per_host=1
    )
    return Gang(FakeClient(), info)


def remote(gang: Gang, handle: str) -> RemoteArray:
    return RemoteArray.from_pb(gang, pb.ArrayInfo(handle=handle, spec=wire.spec_to_pb(SPEC)), None)


def test_dropped_arrays_are_deleted_in_batches_on_flush(gang):
    arrays = [remote(gang, f"g/a{i}") for i in range(600)]
    del arrays
    gc.collect()
    assert gang.client.stub.deletes() == []  # nothing is sent from a finalizer
    assert gang.flush_deletes() == 600
    assert [len(b) for b in gang.client.stub.deletes()] == [256, 256, 88]
    assert gang.client.stub.deleted == {f"g/a{i}" for i in range(600)}
    assert gang.flush_deletes() == 0


def test_a_handle_is_deleted_when_its_last_wrapper_is_gone(gang):
    a = remote(gang, "g/a1")
    b = copy.copy(a)
    c = remote(gang, "g/a1")  # another wrapper of the same handle
    del a, b
    assert gang.flush_deletes() == 0
    del c
    assert gang.flush_deletes() == 1
    assert gang.client.stub.deletes() == [["g/a1"]]


def test_explicitly_deleted_arrays_are_not_deleted_again(gang):
    a, b, c = (remote(gang, f"g/a{i}") for i in range(3))
    a.delete()
    slicewise.delete([b, b, c])
    del a, b, c
    gc.collect()
    assert gang.flush_deletes() == 0
    assert gang.client.stub.deletes() == [["g/a0"], ["g/a1", "g/a2"]]


def test_arrays_of_a_released_gang_need_no_deletes(gang):
    before = remote(gang, "g/a1")
    dropped = remote(gang, "g/a2")
    del dropped
    gang.release()
    del before
    assert gang.flush_deletes() == 0
    assert gang.client.stub.deletes() == []


def test_a_closed_client_sends_nothing_and_drops_do_not_raise(gang):
    a = remote(gang, "g/a1")
    gang.client.closed = True
    del a
    gc.collect()
    assert gang.flush_deletes() == 0
    assert gang.client.stub.calls == []


def program(gang: Gang) -> Program:
    mesh = Mesh(MeshSpec.build({"slice": 1}, {"chip": 1}))
    spec = wire.spec_to_pb(SPEC)
    info = pb.ProgramInfo(program_id="p", name="step", inputs=[spec], outputs=[spec])
    return Program(gang, info, mesh, None)


def test_an_uploaded_argument_is_deleted_only_after_the_call_that_reads_it(gang):
    gang._drops.batch_size = 1  # every queued handle is due at the next put or call
    step = program(gang)
    for _ in range(3):
        # Each uploads its argument; the outputs are dropped at once.
        step(np.ones(4, np.float32))
        gang.execute_batch([(step, [np.ones(4, np.float32)])])
    gang.flush_deletes()
    calls = gang.client.stub.calls
    read_at = {h: i for i, (kind, hs) in enumerate(calls) if kind == "execute" for h in hs}
    deleted_at = {h: i for i, (kind, hs) in enumerate(calls) if kind == "delete" for h in hs}
    assert len(read_at) == 6 and set(read_at) <= set(deleted_at)
    assert all(deleted_at[h] > read_at[h] for h in read_at)


def test_a_put_or_call_sends_deletes_only_once_a_batch_is_queued(gang):
    gang._drops.batch_size = 3
    step = program(gang)
    x = gang.put(np.ones(4, np.float32))
    for _ in range(3):
        step(x)  # the outputs are dropped at once
    gang.calls().sync()  # everything sent has been read
    assert gang.client.stub.deletes() == []
    step(x)
    gang.calls().sync()
    assert [len(b) for b in gang.client.stub.deletes()] == [3]


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the controller went away"


def test_a_broken_call_stream_raises_why_once_and_the_next_call_opens_a_new_one(gang):
    step = program(gang)
    x = gang.put(np.ones(4, np.float32))
    stub = gang.client.stub
    opened = []

    def broken_calls(requests, timeout=None):
        opened.append(requests)

        def responses():
            next(requests)  # the first batch goes out, then the connection drops
            raise Unavailable()
            yield  # a generator

        return Responses(responses())

    stub.Calls, working = broken_calls, stub.Calls
    step(x)
    stream = gang._stream
    wait_until(lambda: stream.broken, timeout_s=10, what="the stream to break")
    with pytest.raises(slicewise.WorkerError, match="the controller went away"):
        step(x)
    stub.Calls = working
    y = step(x)  # on a new stream
    gang.calls().sync()
    assert gang._stream is not stream and len(opened) == 1
    assert ("execute", [x.handle]) in stub.calls and y._stream is gang._stream
