"""The client's end of a direct transfer, against real data servers on loopback (one per
simulated host): every piece lands in its place of the output, contiguous or not, for the
shardings of a 2 x v5litepod-4 gang; pieces that do not fit, or do not cover the array,
are refused; an unreachable host is told apart from a refusal."""

from __future__ import annotations

import socket
import time

import ml_dtypes
import numpy as np
import pytest

from slicewise.common import capability, direct
from slicewise.common.framing import TransportError, piece_meta
from slicewise.common.mesh import GangShape, MeshSpec, ShardingSpec
from worker.transport import DataServer

TOKEN = "fedcba9876543210"
GANG = GangShape(num_slices=2, hosts_per_slice=1, chips_per_host=4)
MESH = MeshSpec.build({"slice": 2}, {"chip": 4})


class Host:
    """A data server whose puts are kept, and whose gets serve (and drop) them, like a
    worker's staging and pins."""

    def __init__(self):
        self.stored = {}
        self.server = DataServer("127.0.0.1", TOKEN, self.put, self.get)

    def put(self, key, pieces, started_us, expires):
        self.stored[key] = pieces

    def get(self, key):
        return self.stored.pop(key)


@pytest.fixture
def hosts():
    made = [Host(), Host()]
    yield made
    for h in made:
        h.server.close()


def parts(hosts, op, key, sharding=None, array=None):
    # Ten minutes from now, not from when the module was collected: in a 20-minute suite
    # a module-level deadline had passed by the time these tests ran.
    later = int(time.time()) + 600
    pieces = sharding.process_pieces(array.shape, GANG) if sharding else {}
    result = []
    for p, h in enumerate(hosts):
        mine = tuple(pieces.get(p, ()))
        nbytes = sum(array[i].nbytes for i in mine)
        shown = capability.issue(TOKEN, op, key, later, nbytes if op == "put" else 0)
        result.append(direct.HostPart(h.server.address, shown, mine))
    return result


@pytest.mark.parametrize(
    ("shape", "partition"),
    [
        ((16, 6), ()),  # replicated: each host sends one copy
        ((16, 6), (("slice", "chip"),)),  # split over all chips along rows
        ((16, 8), ("slice", "chip")),  # both axes: columns are not contiguous
        ((6, 16), (None, ("slice", "chip"))),  # the last axis only
        ((), ()),
    ],
)
def test_pieces_round_trip_into_their_places(hosts, shape, partition):
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 1.5
    sharding = ShardingSpec.from_partition_spec(MESH, partition)
    direct.put("k", array, parts(hosts, "put", "k", sharding, array))
    if not partition:  # replicated: one device's copy is read (replica 0, on host 0)
        hosts[1].stored["k"] = []
    out = np.full(shape, np.nan, np.float32)
    direct.fetch_into("k", out, parts(hosts, "get", "k", None, array))
    np.testing.assert_array_equal(out, array)
    assert all(not h.stored for h in hosts)  # read once


def test_a_dtype_without_a_buffer_format_round_trips(hosts):
    array = np.arange(64, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(8, 8)
    sharding = ShardingSpec.from_partition_spec(MESH, ("slice", "chip"))
    direct.put("k", array, parts(hosts, "put", "k", sharding, array))
    out = np.empty(array.shape, array.dtype)
    direct.fetch_into("k", out, parts(hosts, "get", "k", None, array))
    assert out.tobytes() == array.tobytes()


def test_contiguous_places_are_views_of_the_output():
    out = np.zeros((4, 6), np.int32)
    rows = direct.destination(out, piece_meta((slice(2, 4), slice(0, 6)), out[2:4]))
    assert rows.flags.c_contiguous and np.shares_memory(rows, out)
    cols = direct.destination(out, piece_meta((slice(0, 4), slice(3, 6)), out[:, 3:]))
    assert not cols.flags.c_contiguous and np.shares_memory(cols, out)
    scalar = np.zeros((), np.int32)
    place = direct.destination(scalar, piece_meta((), scalar))
    assert place.shape == () and np.shares_memory(place, scalar)


@pytest.mark.parametrize(
    "meta",
    [
        {"index": [[0, 5], [0, 6]], "shape": [5, 6], "dtype": "int32"},  # past the end
        {"index": [[0, 2], [0, 6]], "shape": [2, 5], "dtype": "int32"},  # wrong shape
        {"index": [[0, 2], [0, 6]], "shape": [2, 6], "dtype": "float32"},  # wrong dtype
        {"index": [[0, 2]], "shape": [2], "dtype": "int32"},  # wrong rank
        {"index": [[2, 1], [0, 6]], "shape": [-1, 6], "dtype": "int32"},
        {"index": "x", "shape": [2, 6], "dtype": "int32"},
        {"shape": [2, 6]},
    ],
)
def test_a_piece_that_does_not_fit_is_refused(meta):
    with pytest.raises(TransportError):
        direct.destination(np.zeros((4, 6), np.int32), meta)


def test_pieces_that_do_not_cover_the_array_are_refused(hosts):
    array = np.arange(16, dtype=np.float32)
    sharding = ShardingSpec.from_partition_spec(MESH, (("slice", "chip"),))
    direct.put("k", array, parts(hosts, "put", "k", sharding, array))
    hosts[1].stored["k"] = []  # one host lost its half
    with pytest.raises(TransportError, match="8 of 16 elements"):
        direct.fetch_into("k", np.empty(16, np.float32), parts(hosts, "get", "k", None, array))


def test_an_unreachable_host_is_not_a_refusal(hosts):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
    array = np.zeros(4, np.float32)
    good = parts(hosts, "get", "k", None, array)
    with pytest.raises(direct.UnreachableError):
        direct.fetch_into("k", array, [good[0], direct.HostPart(nobody, good[1].capability)])
    with pytest.raises(TransportError) as refused:
        direct.fetch_into("k", array, [direct.HostPart(good[0].address, "1.0.0")])
    assert not isinstance(refused.value, direct.UnreachableError)
    assert "wrong capability" in str(refused.value)
