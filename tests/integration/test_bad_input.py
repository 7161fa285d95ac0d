"""Bad input gets a gRPC status a person can act on, and the controller keeps serving.

Every test here ends by checking that another client, connected all along, still gets
correct answers from its own gang.
"""

from __future__ import annotations

import math
import re

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import slicewise
from protos import controller_pb2 as pb
from slicewise import wire
from slicewise.common.mesh import MeshSpec, ShardingSpec
from slicewise.testing import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bystander(controller):
    """Another client with its own one-slice gang and a program it keeps calling."""
    with (
        slicewise.connect(controller.address, name="bystander") as c,
        c.allocate(slices=1, slice_type="v5litepod-16", timeout=120) as gang,
    ):
        mesh = gang.mesh()
        x = gang.put(np.arange(16, dtype=np.float32), mesh.sharding("chip"))
        triple = gang.compile(jax.jit(lambda a: a * 3), x)
        yield lambda: np.testing.assert_array_equal(
            triple(x).fetch(timeout=120), np.arange(16, dtype=np.float32) * 3
        )


@pytest.fixture(scope="module")
def gang(client):
    """One v5litepod-4 slice: 4 devices. The other v5litepod-4 stays free for tests that
    need a gang of their own."""
    with client.allocate(slices=1, slice_type="v5litepod-4", timeout=120) as g:
        yield g


def _code(excinfo) -> grpc.StatusCode:
    return excinfo.value.code


def test_corrupt_program_bytes(gang, bystander):
    mesh = gang.mesh()
    with pytest.raises(slicewise.InvalidRequestError, match="could not be deserialized") as e:
        gang.load(b"\x00not a jax.export artifact" * 10, mesh, name="garbage")
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    bystander()


def test_program_exported_for_another_device_count(gang, bystander):
    eight = AbstractMesh((8,), ("chip",))
    exported = jax.export.export(
        jax.jit(lambda a: a + 1, in_shardings=NamedSharding(eight, P("chip"))), platforms=["cpu"]
    )(jax.ShapeDtypeStruct((8,), jnp.float32))
    with pytest.raises(
        slicewise.InvalidRequestError, match=r"exported for 8 devices, but gang .* has 4"
    ) as e:
        gang.load(exported, gang.mesh(), name="four_devices")
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    bystander()


def test_program_exported_for_another_platform(gang, bystander):
    mesh = gang.mesh()
    exported = jax.export.export(jax.jit(lambda a: a + 1), platforms=["tpu"])(
        jax.ShapeDtypeStruct((8,), jnp.float32, sharding=mesh.sharding("chip"))
    )
    with pytest.raises(slicewise.InvalidRequestError, match="platforms=\\['cpu'\\]"):
        gang.load(exported, mesh, name="tpu_only")
    bystander()


@pytest.mark.parametrize(
    ("shape", "dtype", "match"),
    [
        ((8, 5), np.float32, r"expected float32\[8,4\], got float32\[8,5\]"),
        ((8, 4), np.int32, r"expected float32\[8,4\], got int32\[8,4\]"),
    ],
)
def test_input_of_wrong_shape_or_dtype(gang, bystander, shape, dtype, match):
    mesh = gang.mesh()
    good = gang.put(np.zeros((8, 4), np.float32), mesh.sharding("chip"))
    double = gang.compile(jax.jit(lambda a: a * 2), good)
    bad = gang.put(np.zeros(shape, dtype), mesh.sharding())
    with pytest.raises(slicewise.InvalidRequestError, match=match) as e:
        double(bad)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(slicewise.InvalidRequestError, match="takes 1 input"):
        double(good, good)
    np.testing.assert_array_equal(double(good).fetch(), np.zeros((8, 4)))  # still usable
    bystander()


def test_unknown_and_deleted_handles(gang, bystander):
    mesh = gang.mesh()
    x = gang.put(np.ones(8, np.float32), mesh.sharding("chip"))
    negate = gang.compile(jax.jit(lambda a: -a), x)
    x.delete()
    with pytest.raises(slicewise.NotFoundError, match=f"array {x.handle} was deleted") as e:
        negate(x)
    assert _code(e) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(slicewise.NotFoundError, match="was deleted"):
        x.fetch()
    with pytest.raises(slicewise.NotFoundError, match="was deleted"):
        x.delete()
    stub = gang.client.stub
    with pytest.raises(grpc.RpcError) as raw:
        stub.Execute(
            pb.ExecuteRequest(gang_id=gang.id, program_id=negate.id, inputs=["no-such-handle"])
        )
    assert raw.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown to this controller" in raw.value.details()
    with pytest.raises(grpc.RpcError) as raw:
        stub.Execute(pb.ExecuteRequest(gang_id=gang.id, program_id="feedbeef", inputs=[]))
    assert raw.value.code() == grpc.StatusCode.NOT_FOUND
    assert "register it first" in raw.value.details()
    bystander()


def test_unknown_slice_type(client, bystander):
    with pytest.raises(
        slicewise.InvalidRequestError, match="unknown slice type 'v5litepod-3'"
    ) as e:
        client.allocate(slices=1, slice_type="v5litepod-3", timeout=10)
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    assert "v5litepod-16" in str(e.value)  # the message lists what exists
    bystander()


def test_allocation_larger_than_the_whole_cluster(client, bystander):
    with pytest.raises(
        slicewise.CapacityError, match=r"asked for 3 x v5litepod-4 but the whole cluster has 2"
    ) as e:
        client.allocate(slices=3, slice_type="v5litepod-4", timeout=600)
    assert _code(e) == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(slicewise.CapacityError, match="has 0 v5litepod-8"):
        client.allocate(slices=1, slice_type="v5litepod-8", timeout=600)
    bystander()


def test_gang_used_after_release(client, bystander):
    gang = client.allocate(slices=1, slice_type="v5litepod-4", timeout=120)
    mesh = gang.mesh()
    x = gang.put(np.ones(8, np.float32), mesh.sharding("chip"))
    inc = gang.compile(jax.jit(lambda a: a + 1), x)
    gang.release()
    for action, what in [
        (lambda: inc(x), "Execute"),
        (lambda: gang.put(np.ones(8, np.float32), mesh.sharding("chip")), "PutArray"),
        (lambda: gang.compile(jax.jit(lambda a: a - 1), x), "RegisterProgram"),
    ]:
        with pytest.raises(slicewise.SlicewiseError, match=f"gang {gang.id} was released") as e:
            action()
        assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION, what
    with pytest.raises(slicewise.NotFoundError, match=f"belonged to gang {gang.id}"):
        x.fetch()
    with pytest.raises(grpc.RpcError) as raw:
        gang.client.stub.ReleaseGang(pb.ReleaseGangRequest(gang_id=gang.id))
    assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    bystander()


def test_malformed_streams(client, bystander):
    """Raw gRPC: uploads without a header, with too few or too many bytes, bad meshes."""
    stub = client.stub
    with client.allocate(slices=1, slice_type="v5litepod-4", timeout=120) as g:
        spec = pb.ArraySpec(shape=[4], dtype="float32")
        sharding = wire.sharding_to_pb(ShardingSpec(MeshSpec.build({"slice": 1}, {"chip": 4}), ()))
        header = pb.PutChunk(header=pb.PutHeader(gang_id=g.id, spec=spec, sharding=sharding))
        cases = [
            ([pb.PutChunk(data=b"x" * 16)], "first message must be a header"),
            (
                [header, pb.PutChunk(data=b"x" * 8)],
                "sent 8 bytes, but a float32\\[4\\] array has 16",
            ),
            ([header, pb.PutChunk(data=b"x" * 20)], "more than the 16 bytes"),
        ]
        for messages, match in cases:
            with pytest.raises(grpc.RpcError) as raw:
                stub.PutArray(iter(messages))
            assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert re.search(match, raw.value.details()), raw.value.details()
        bad_mesh = pb.ShardingSpec(mesh=pb.MeshSpec(axes=[pb.MeshAxis(name="chip", dcn=1, ici=8)]))
        with pytest.raises(grpc.RpcError) as raw:
            stub.PutArray(
                iter([pb.PutChunk(header=pb.PutHeader(gang_id=g.id, spec=spec, sharding=bad_mesh))])
            )
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ICI parts to 4" in raw.value.details()
        with pytest.raises(grpc.RpcError) as raw:
            stub.PutArray(
                iter(
                    [
                        pb.PutChunk(
                            header=pb.PutHeader(
                                gang_id=g.id,
                                spec=pb.ArraySpec(shape=[4], dtype="floot32"),
                                sharding=sharding,
                            )
                        )
                    ]
                )
            )
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown dtype 'floot32'" in raw.value.details()
    bystander()


# -- values the controller once answered INTERNAL or UNKNOWN, or leaked on -------------


def _replicated(g) -> pb.ShardingSpec:
    """No split, over the mesh of a one-host gang of 4 chips."""
    return wire.sharding_to_pb(ShardingSpec(MeshSpec.build({"slice": 1}, {"chip": 4}), ()))


def _put(g, shape, dtype="float32", data=None, sharding=None) -> pb.ArrayInfo:
    """Raw PutArray: the header as given, then `data` (all zeros of the spec when None)."""
    spec = pb.ArraySpec(shape=shape, dtype=dtype)
    header = pb.PutHeader(gang_id=g.id, spec=spec, sharding=sharding or _replicated(g))
    if data is None:
        data = bytes(4 * int(np.prod(shape)))
    return g.client.stub.PutArray(iter([pb.PutChunk(header=header), pb.PutChunk(data=data)]))


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raw:
        result = call()
        if not hasattr(result, "ListFields"):  # a response stream
            list(result)
    return raw.value


def _fetch(g, handle, timeout_s=60.0) -> np.ndarray:
    chunks = list(
        g.client.stub.FetchArray(pb.FetchArrayRequest(handle=handle, timeout_s=timeout_s))
    )
    return np.frombuffer(b"".join(c.data for c in chunks[1:]), np.float32)


def _still_serves(g) -> None:
    """A well-formed upload and download on the same gang, right after the refusal."""
    info = _put(g, [4], data=np.arange(4, dtype=np.float32).tobytes())
    np.testing.assert_array_equal(_fetch(g, info.handle), np.arange(4, dtype=np.float32))
    g.client.stub.DeleteArrays(pb.DeleteArraysRequest(handles=[info.handle]))


def _held(g) -> tuple[int, ...]:
    """What the gang's workers hold (arrays, their bytes, pins, programs) and how many
    arrays of the gang the controller has records of."""
    workers = g.client.stub.GetGangStats(pb.GangStatsRequest(gang_id=g.id)).workers
    (summary,) = [s for s in g.client.cluster_info().gangs if s.gang_id == g.id]
    return (
        sum(w.arrays for w in workers),
        sum(w.bytes for w in workers),
        sum(w.pins for w in workers),
        sum(w.programs for w in workers),
        summary.live_arrays,
    )


@pytest.fixture
def fresh(client):
    """The other v5litepod-4, for a test that counts what its workers hold."""
    with client.allocate(slices=1, slice_type="v5litepod-4", timeout=120) as g:
        yield g


@pytest.mark.parametrize(
    ("dtype", "match"),
    [
        ("f4,(2", r"unknown dtype 'f4,\(2'; use a numpy dtype name such as 'float32'"),
        ("f4,f4", r"dtype 'f4,f4' .* cannot live on an accelerator; use .*'float32'"),
        (">f4", r"dtype '>f4' is not in this machine's byte order; .* as 'float32'"),
    ],
)
def test_dtype_numpy_cannot_parse_or_hold_on_a_device(gang, bystander, dtype, match):
    error = _refused(lambda: _put(gang, [4], dtype, data=b""))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(match, error.details()), error.details()
    _still_serves(gang)
    bystander()


def test_too_many_dimensions_or_mesh_axes(gang, bystander):
    error = _refused(lambda: _put(gang, [1] * 65))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shape has 65 dimensions, more than the 64 numpy supports" in error.details()
    axes = [pb.MeshAxis(name="chip", dcn=1, ici=4)]
    axes += [pb.MeshAxis(name=f"a{i}", dcn=1, ici=1) for i in range(39)]
    error = _refused(lambda: _put(gang, [4], sharding=pb.ShardingSpec(mesh=pb.MeshSpec(axes=axes))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the mesh has 40 axes, more than the 32" in error.details()
    # The limits themselves work end to end.
    widest = pb.ShardingSpec(
        mesh=pb.MeshSpec(axes=axes[:32]),
        dims=[pb.PartitionDim()] * 63 + [pb.PartitionDim(axes=["chip"])],
    )
    info = _put(
        gang, [1] * 63 + [4], data=np.arange(4, dtype=np.float32).tobytes(), sharding=widest
    )
    np.testing.assert_array_equal(_fetch(gang, info.handle), np.arange(4, dtype=np.float32))
    gang.client.stub.DeleteArrays(pb.DeleteArraysRequest(handles=[info.handle]))
    bystander()


@pytest.mark.parametrize(
    ("shape", "code", "match"),
    [
        (
            [2**62],
            grpc.StatusCode.INVALID_ARGUMENT,
            r"float32\[4611686018427387904\] array spans 1.845e\+19 bytes, more than numpy",
        ),
        (
            [2**62, 2**62, 2**62],
            grpc.StatusCode.INVALID_ARGUMENT,
            r"spans 3.923e\+56 bytes, more than numpy can address",
        ),
        (
            [2**40],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            r"float32\[1099511627776\] array \(4398046511104 bytes .*\) replicated puts "
            r"4398046511104 bytes .* on each chip, more than the 17179869184 bytes \(16 GiB\) "
            r"of HBM a v5e chip has \(gang .*: 4 chips, .*\); split it over more mesh axes",
        ),
    ],
)
def test_declared_size_larger_than_memory(gang, bystander, shape, code, match):
    error = _refused(lambda: _put(gang, shape, data=b""))
    assert error.code() == code
    assert re.search(match, error.details()), error.details()
    _still_serves(gang)
    bystander()


def test_deleting_one_handle_twice_deletes_it_once(fresh, bystander):
    before = _held(fresh)
    info = _put(fresh, [256])
    stub = fresh.client.stub
    reply = stub.DeleteArrays(pb.DeleteArraysRequest(handles=[info.handle, info.handle]))
    assert reply.deleted == 1
    # Deletes are asynchronous on the workers.
    wait_until(lambda: _held(fresh) == before, timeout_s=60, what=f"the workers to hold {before}")
    error = _refused(lambda: stub.DeleteArrays(pb.DeleteArraysRequest(handles=[info.handle])))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert f"array {info.handle} was deleted" in error.details()
    _still_serves(fresh)
    bystander()


@pytest.mark.parametrize("timeout_s", [-1.0, math.nan, math.inf])
def test_fetch_with_a_timeout_that_is_not_seconds(gang, bystander, timeout_s):
    info = _put(gang, [4])
    error = _refused(lambda: _fetch(gang, info.handle, timeout_s))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(
        f"FetchArrayRequest.timeout_s must be a finite number of seconds >= 0, got {timeout_s!r}; "
        "0 means the controller's default"
    )
    np.testing.assert_array_equal(_fetch(gang, info.handle), np.zeros(4))
    gang.client.stub.DeleteArrays(pb.DeleteArraysRequest(handles=[info.handle]))
    bystander()


def test_a_fetch_that_times_out_leaves_nothing_pinned(fresh, bystander):
    before = _held(fresh)
    info = _put(fresh, [4])
    error = _refused(lambda: _fetch(fresh, info.handle, timeout_s=1e-9))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "not ready within 1e-09 s; fetch again with a longer timeout" in error.details()
    # A fetch queued after it succeeds, so the timed-out fetch's pin has happened.
    np.testing.assert_array_equal(_fetch(fresh, info.handle), np.zeros(4))
    fresh.client.stub.DeleteArrays(pb.DeleteArraysRequest(handles=[info.handle]))
    wait_until(lambda: _held(fresh) == before, timeout_s=60, what=f"the workers to hold {before}")
    bystander()


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_every_timeout_field_refuses_what_is_not_seconds(gang, client, bystander, value):
    stub = client.stub
    queued = len(client.cluster_info().queue)
    v4 = "v5litepod-4"
    for field, call in [
        (
            "WaitArraysRequest.timeout_s",
            lambda: stub.WaitArrays(pb.WaitArraysRequest(handles=[], timeout_s=value)),
        ),
        (
            "AllocateGangRequest.timeout_s",
            lambda: stub.AllocateGang(
                pb.AllocateGangRequest(num_slices=1, slice_type=v4, timeout_s=value)
            ),
        ),
        (
            "AllocateGangRequest.max_wait_s",
            lambda: stub.AllocateGang(
                pb.AllocateGangRequest(num_slices=1, slice_type=v4, timeout_s=1, max_wait_s=value)
            ),
        ),
        (
            "AllocateGangRequest.weight",
            lambda: stub.AllocateGang(
                pb.AllocateGangRequest(num_slices=1, slice_type=v4, timeout_s=1, weight=value)
            ),
        ),
    ]:
        error = _refused(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in error.details() and repr(value) in error.details(), error.details()
    assert len(client.cluster_info().queue) == queued  # nothing was queued for slices
    _still_serves(gang)
    bystander()


def _program(g) -> bytes:
    mesh = g.mesh()
    exported = jax.export.export(jax.jit(lambda a: a + 1), platforms=[g.platform])(
        jax.ShapeDtypeStruct((8,), jnp.float32, sharding=mesh.sharding("chip"))
    )
    return bytes(exported.serialize())


def _register(g, total_bytes, data) -> pb.ProgramInfo:
    header = pb.ProgramHeader(
        gang_id=g.id, name="plus_one", mesh=wire.mesh_to_pb(g.mesh().spec), total_bytes=total_bytes
    )
    chunks = [pb.ProgramChunk(data=bytes(c)) for c in wire.chunks(memoryview(data), 1024)]
    return g.client.stub.RegisterProgram(iter([pb.ProgramChunk(header=header), *chunks]))


def test_a_program_stream_longer_than_it_declared(fresh, bystander):
    serialized = _program(fresh)
    before = _held(fresh)
    dispatched = fresh.client.stub.GetGangStats(pb.GangStatsRequest(gang_id=fresh.id)).dispatched
    for total, data, match in [
        (
            len(serialized),
            serialized + b"\0",  # flatbuffers would ignore the extra byte
            f"sent more than the {len(serialized)} bytes its header declared \\(total_bytes",
        ),
        (len(serialized) + 1, serialized, f"sent {len(serialized)} bytes, but its header"),
        (2**31, serialized, "declares total_bytes=2147483648; .* between 1 and 2147483647"),
    ]:
        error = _refused(lambda: _register(fresh, total, data))  # noqa: B023 - called at once
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(match, error.details()), error.details()
    stats = fresh.client.stub.GetGangStats(pb.GangStatsRequest(gang_id=fresh.id))
    assert stats.dispatched == dispatched  # no program load was queued
    assert _held(fresh) == before
    assert _register(fresh, len(serialized), serialized).num_devices == 4
    bystander()


def test_bytes_that_are_no_request_message(controller, gang, bystander):
    with grpc.insecure_channel(controller.address) as channel:
        raw = {"request_serializer": None, "response_deserializer": None}
        method = "/slicewise.v1.Controller/"
        for call in [
            lambda: channel.unary_unary(method + "GetJob", **raw)(b"\xff\xff\xff", timeout=30),
            lambda: channel.unary_stream(method + "FetchArray", **raw)(b"\x0a\xff", timeout=30),
            lambda: channel.stream_unary(method + "PutArray", **raw)(iter([b"\xff"]), timeout=30),
        ]:
            error = _refused(call)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "bytes that are not a valid request message (DecodeError" in error.details()
            assert "protos/controller.proto" in error.details()
    _still_serves(gang)
    bystander()
