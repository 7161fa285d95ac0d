"""Arrays in and out of a gang: chunked streams, every dtype, any size; direct puts and
fetches (straight between client and hosts) against the path through the controller."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

import slicewise
from protos import controller_pb2 as pb
from slicewise import client as client_module
from slicewise.common import direct
from slicewise.testing import wait_until

pytestmark = pytest.mark.integration


def bytes_held(gang) -> int:
    return sum(w.bytes for w in gang.stats().workers)


@pytest.mark.slow
def test_one_gib_float32_round_trips_bit_identical(two_slices):
    gang = two_slices
    mesh = gang.mesh(dcn={"slice": 2}, ici={"data": 2, "model": 2})
    rows = 2**28 // 1024  # 2**28 float32 = 1 GiB
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, 1024), dtype=np.float32)
    x[0, :4] = [np.nan, np.inf, -0.0, np.finfo(np.float32).tiny]  # bit patterns, not values
    assert x.nbytes == 2**30
    before = bytes_held(gang)
    remote = gang.put(x, mesh.sharding(("slice", "data"), "model"))
    back = remote.fetch(timeout=240)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.array_equal(back.view(np.uint32), x.view(np.uint32))
    remote.delete()
    del back
    # Deletes are asynchronous.
    wait_until(
        lambda: bytes_held(gang) == before, timeout_s=60, what="the workers to free the 1 GiB"
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "uint32", "bool", "complex64"])
def test_dtypes_round_trip(two_slices, dtype):
    gang = two_slices
    mesh = gang.mesh()
    x = (np.arange(48) % 7).astype(jnp.dtype(dtype)).reshape(8, 6)
    back = gang.put(x, mesh.sharding(("slice", "chip"))).fetch()
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7, 5)])
def test_odd_shapes_replicated(two_slices, shape):
    gang = two_slices
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    back = gang.put(x).fetch()
    assert back.shape == shape
    np.testing.assert_array_equal(back, x)


def test_wait_reports_ready_and_delete_frees_worker_memory(two_slices):
    gang = two_slices
    mesh = gang.mesh()
    before = bytes_held(gang)
    arrays = [
        gang.put(np.ones((256, 256), np.float32), mesh.sharding(("slice", "chip")))
        for _ in range(3)
    ]
    assert all(a.wait().state == pb.ARRAY_STATE_READY for a in arrays)
    grown = bytes_held(gang)
    assert grown - before == 3 * 256 * 256 * 4
    slicewise.delete(arrays)
    # Deletes are asynchronous.
    wait_until(
        lambda: bytes_held(gang) == before, timeout_s=60, what=f"the workers to hold {before} bytes"
    )


# -- direct transfers: bytes straight between the client and the hosts -----------------


@pytest.fixture
def counted(monkeypatch):
    """Every array goes direct (however small), and the direct puts and fetches are
    counted."""
    calls = {"put": 0, "fetch": 0}
    put, fetch_into = direct.put, direct.fetch_into

    def counting_put(*args):
        calls["put"] += 1
        return put(*args)

    def counting_fetch(*args):
        calls["fetch"] += 1
        return fetch_into(*args)

    monkeypatch.setattr(client_module, "DIRECT_MIN_BYTES", 0)
    monkeypatch.setattr(direct, "put", counting_put)
    monkeypatch.setattr(direct, "fetch_into", counting_fetch)
    return calls


def proxied_twin(gang) -> client_module.Gang:
    """The same gang, seen by a client that sends every byte through the controller."""
    proxied = slicewise.connect(gang.client.address, direct_data=False)
    info = pb.GangInfo(
        gang_id=gang.id,
        slice_type=gang.slice_type,
        num_slices=gang.num_slices,
        hosts_per_slice=gang.hosts_per_slice,
        chips_per_host=gang.chips_per_host,
        platform=gang.platform,
        slices=gang.slices,
    )
    return client_module.Gang(proxied, info)


@pytest.mark.parametrize(
    ("shape", "partition"),
    [
        ((64, 48), (None, None)),  # replicated
        ((64, 48), (("slice", "chip"), None)),  # split over one axis
        ((64, 48), ("slice", "chip")),  # over both: pieces are columns too
        ((6, 64), (None, ("slice", "chip"))),  # the last axis only
    ],
)
def test_direct_put_and_fetch_round_trip_exact_bytes(two_slices, counted, shape, partition):
    gang = two_slices
    mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape, dtype=np.float32)
    x.flat[:3] = [np.nan, -0.0, np.inf]
    sharding = mesh.sharding(*partition)
    remote = gang.put(x, sharding)
    back = remote.fetch()
    assert counted == {"put": 1, "fetch": 1}
    assert back.dtype == x.dtype and back.view(np.uint32).tobytes() == x.view(np.uint32).tobytes()
    # A client that goes through the controller sees the same bytes, both ways.
    twin = proxied_twin(gang)
    try:
        assert twin.direct_data is False
        np.testing.assert_array_equal(
            client_module.RemoteArray(twin, remote.handle, remote.spec, None)
            .fetch()
            .view(np.uint32),
            x.view(np.uint32),
        )
        other = twin.put(x, remote.sharding)
        assert counted == {"put": 1, "fetch": 1}
        np.testing.assert_array_equal(
            client_module.RemoteArray(gang, other.handle, other.spec, None).fetch().view(np.uint32),
            x.view(np.uint32),
        )
        other.delete()
    finally:
        twin.client.close()
    remote.delete()
    stats = gang.stats().workers
    assert sum(w.staged for w in stats) == 0 and sum(w.pins for w in stats) == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "bool", "complex64"])
def test_direct_transfers_of_dtypes_without_a_buffer_format(two_slices, counted, dtype):
    gang = two_slices
    x = (np.arange(96) % 5).astype(jnp.dtype(dtype)).reshape(8, 12)
    back = gang.put(x, gang.mesh().sharding(("slice", "chip"))).fetch()
    assert counted == {"put": 1, "fetch": 1}
    assert back.dtype == x.dtype and back.tobytes() == x.tobytes()


def test_unreachable_hosts_fall_back_to_the_controller_once_per_gang(
    two_slices, counted, monkeypatch, caplog
):
    gang = two_slices
    mesh = gang.mesh()

    def unreachable(address):
        raise direct.UnreachableError(f"cannot reach the data port {address}: test")

    monkeypatch.setattr(direct, "_connect", unreachable)
    monkeypatch.setattr(gang, "direct_data", True)
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    with caplog.at_level(logging.WARNING, logger="slicewise.client"):
        remote = gang.put(x, mesh.sharding(("slice", "chip")))
        assert gang.direct_data is False  # what follows goes through the controller
        np.testing.assert_array_equal(remote.fetch(), x)
        np.testing.assert_array_equal(gang.put(x).fetch(), x)
    assert counted == {"put": 1, "fetch": 0}
    warnings = [r for r in caplog.records if "through the controller" in r.getMessage()]
    assert len(warnings) == 1
    # The abandoned transfer left nothing on the hosts.
    wait_until(
        lambda: sum(w.staged for w in gang.stats().workers) == 0,
        timeout_s=30,
        what="the abandoned direct put's pieces to be dropped",
    )
