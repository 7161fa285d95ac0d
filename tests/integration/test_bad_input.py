"""Bad input gets a gRPC status a person can act on, and the controller keeps serving.

Every test here ends by checking that another client, connected all along, still gets
correct answers from its own gang.
"""

from __future__ import annotations

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
