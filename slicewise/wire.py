"""Conversions between protobuf messages and the shared vocabulary (meshes, shardings,
array specs), both ways, and the chunking of streams.

Client and servicer both use these, so the two ends cannot drift apart."""

from __future__ import annotations

from collections.abc import Iterator

from protos import controller_pb2 as pb
from slicewise.common.arrays import ArraySpec
from slicewise.common.mesh import MeshAxis, MeshSpec, ShardingSpec

# Chunk size for array and program streams: well under gRPC's 4 MiB default limit.
CHUNK_BYTES = 2 * 2**20


def mesh_to_pb(mesh: MeshSpec) -> pb.MeshSpec:
    return pb.MeshSpec(axes=[pb.MeshAxis(name=a.name, dcn=a.dcn, ici=a.ici) for a in mesh.axes])


def mesh_from_pb(msg: pb.MeshSpec) -> MeshSpec:
    return MeshSpec(tuple(MeshAxis(a.name, a.dcn, a.ici) for a in msg.axes))


def sharding_to_pb(sharding: ShardingSpec) -> pb.ShardingSpec:
    return pb.ShardingSpec(
        mesh=mesh_to_pb(sharding.mesh), dims=[pb.PartitionDim(axes=list(d)) for d in sharding.dims]
    )


def sharding_from_pb(msg: pb.ShardingSpec) -> ShardingSpec:
    return ShardingSpec(mesh_from_pb(msg.mesh), tuple(tuple(d.axes) for d in msg.dims))


def spec_to_pb(spec: ArraySpec) -> pb.ArraySpec:
    return pb.ArraySpec(shape=list(spec.shape), dtype=spec.dtype)


def spec_from_pb(msg: pb.ArraySpec) -> ArraySpec:
    return ArraySpec.of(tuple(msg.shape), msg.dtype)


def chunks(data: memoryview, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """Yields `data` in pieces of at most `size` bytes, without copying."""
    data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    for start in range(0, len(data), size):
        yield data[start : start + size]
