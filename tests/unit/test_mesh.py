"""Mesh and sharding math, checked against JAX's own index maps on 8 CPU devices."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from slicewise.common.errors import InvalidRequestError, ProgramMismatchError
from slicewise.common.mesh import GangShape, MeshAxis, MeshSpec, ShardingSpec, index_key

TWO_BY_FOUR = GangShape(num_slices=2, hosts_per_slice=1, chips_per_host=4)
MULTI_HOST = GangShape(num_slices=2, hosts_per_slice=2, chips_per_host=2)


def test_build_orders_dcn_axes_first_and_merges_hybrid_axes():
    mesh = MeshSpec.build(dcn={"slice": 2, "data": 1}, ici={"data": 2, "model": 2})
    assert mesh.axes == (MeshAxis("slice", 2, 1), MeshAxis("data", 1, 2), MeshAxis("model", 1, 2))
    assert mesh.shape == (2, 2, 2)
    assert mesh.size == 8


def test_device_grid_puts_each_dcn_index_on_its_own_slice():
    grid = MeshSpec.build({"slice": 2}, {"data": 2, "model": 2}).device_grid(TWO_BY_FOUR)
    assert grid.shape == (2, 2, 2)
    # slice s holds global devices 4s..4s+3, and nothing else
    for s in range(2):
        assert sorted(grid[s].ravel().tolist()) == list(range(4 * s, 4 * s + 4))


def test_hybrid_axis_is_dcn_major():
    # one axis of size 4 = 2 slices x 2 chips: positions 0,1 on slice 0, 2,3 on slice 1
    grid = MeshSpec.build({"data": 2}, {"data": 2, "model": 2}).device_grid(TWO_BY_FOUR)
    assert [int(grid[i, 0]) // 4 for i in range(4)] == [0, 0, 1, 1]


def test_mesh_that_does_not_cover_the_gang_is_refused_with_the_numbers():
    with pytest.raises(ProgramMismatchError, match="DCN parts must multiply to 2"):
        MeshSpec.build({"slice": 1}, {"chip": 8}).device_grid(TWO_BY_FOUR)


@pytest.mark.parametrize(
    "bad",
    [
        dict(dcn={"1x": 2}),
        dict(dcn={"a": 0}),
    ],
)
def test_bad_axes_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        MeshSpec.build(**bad)


def test_repeated_axis_names_are_refused():
    with pytest.raises(InvalidRequestError, match="repeat"):
        MeshSpec((MeshAxis("a", 2), MeshAxis("a", 1, 4)))


def test_sharding_checks_divisibility_axes_and_rank():
    mesh = MeshSpec.build({"slice": 2}, {"data": 4})
    with pytest.raises(InvalidRequestError, match="does not divide"):
        ShardingSpec.from_partition_spec(mesh, ("data",)).check((6,))
    with pytest.raises(InvalidRequestError, match="no axis 'model'"):
        ShardingSpec.from_partition_spec(mesh, ("model",)).check((8,))
    with pytest.raises(InvalidRequestError, match="used twice"):
        ShardingSpec.from_partition_spec(mesh, ("data", "data")).check((8, 8))
    with pytest.raises(InvalidRequestError, match="only 1 dimensions"):
        ShardingSpec.from_partition_spec(mesh, (None, None)).check((8,))


CASES = [
    (({"slice": 2}, {"data": 2, "model": 2}), (("slice", "data"), None), (16, 6)),
    (({"slice": 2}, {"data": 2, "model": 2}), (None, "model"), (6, 8)),
    (({"slice": 2}, {"data": 2, "model": 2}), ("model", ("slice", "data")), (4, 8, 3)),
    (({"slice": 2}, {"data": 2, "model": 2}), (), (5, 3)),
    (({"data": 2}, {"data": 2, "model": 2}), ("data", "model"), (8, 4)),
    (({"slice": 2}, {"chip": 4}), (("chip", "slice"),), (24,)),
]


@pytest.mark.parametrize("gang", [TWO_BY_FOUR, MULTI_HOST], ids=["1host", "2hosts"])
@pytest.mark.parametrize(("axes", "pspec", "shape"), CASES)
def test_device_indices_match_jax(gang, axes, pspec, shape):
    """The controller's pure index math agrees with JAX on a mesh built the same way."""
    mesh_spec = MeshSpec.build(*axes)
    grid = mesh_spec.device_grid(gang)
    devices = np.array(jax.devices()[:8], dtype=object)[grid]
    sharding = NamedSharding(Mesh(devices, mesh_spec.names), PartitionSpec(*pspec))
    ours = ShardingSpec.from_partition_spec(mesh_spec, pspec).device_indices(shape, gang)
    theirs = sharding.devices_indices_map(shape)
    for device, index in theirs.items():
        assert index_key(ours[device.id], shape) == index_key(index, shape)


def test_process_pieces_sends_each_replica_once_and_covers_every_element():
    mesh = MeshSpec.build({"slice": 2}, {"data": 2, "model": 2})
    spec = ShardingSpec.from_partition_spec(mesh, (("slice", "data"), None))
    pieces = spec.process_pieces((16, 4), MULTI_HOST)
    assert sorted(pieces) == [0, 1, 2, 3]
    covered = np.zeros((16, 4), int)
    for indices in pieces.values():
        assert len(indices) == 1  # the model axis replicates; one copy per host is enough
        for index in indices:
            covered[index] += 1
    assert (covered == 1).all()


def test_partition_spec_round_trip():
    mesh = MeshSpec.build({"slice": 2}, {"data": 4})
    spec = ShardingSpec.from_partition_spec(mesh, (("slice", "data"), None, "data"))
    assert spec.partition_spec() == (("slice", "data"), None, "data")
