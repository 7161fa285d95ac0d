"""Slice types and sim specs, worker environments, protobuf conversions, and gRPC status codes."""

import os
import platform
import subprocess
import sys

import grpc
import numpy as np
import pytest
from ray.util.tpu import get_tpu_coordinator_env_vars

from controller import messages
from controller.arrays import ArrayRecord
from controller.hostenv import (
    DEVICE_POOL_ENV,
    POOL_MALLOC_CONF,
    HostPlacement,
    jemalloc_library,
    simulated_host_env,
    tpu_host_env,
)
from controller.servicer import status_code_for
from protos import controller_pb2 as pb
from slicewise import wire
from slicewise.common.arrays import ArraySpec
from slicewise.common.errors import (
    CapacityError,
    DeadlineError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    ProgramMismatchError,
    WorkerError,
)
from slicewise.common.mesh import MeshSpec, ShardingSpec
from slicewise.common.topology import SLICE_TYPES, parse_sim_spec, slice_type
from worker import sched

# -- topology --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "chips", "hosts", "per_host", "topology"),
    [
        ("v5litepod-1", 1, 1, 1, "1x1"),
        ("v5litepod-4", 4, 1, 4, "2x2"),
        ("v5litepod-8", 8, 1, 8, "2x4"),
        ("v5litepod-16", 16, 4, 4, "4x4"),
        ("v5litepod-32", 32, 8, 4, "4x8"),
        ("v5litepod-64", 64, 16, 4, "8x8"),
        ("v5litepod-128", 128, 32, 4, "8x16"),
        ("v5litepod-256", 256, 64, 4, "16x16"),
    ],
)
def test_slice_type_by_name_and_by_topology_follows_the_v5e_table(
    name, chips, hosts, per_host, topology
):
    by_name = slice_type(name)
    assert (by_name.chips, by_name.hosts, by_name.chips_per_host) == (chips, hosts, per_host)
    assert by_name.topology == topology
    assert slice_type(topology) is by_name
    assert by_name.head_resource == f"TPU-{name}-head"


def test_slice_type_ignores_case_and_surrounding_spaces():
    assert slice_type("  V5LitePod-16 ") is SLICE_TYPES["v5litepod-16"]


def test_an_unknown_slice_type_is_refused_with_the_known_ones_listed():
    with pytest.raises(InvalidRequestError, match="unknown slice type 'v5litepod-12'") as info:
        slice_type("v5litepod-12")
    assert all(name in str(info.value) for name in SLICE_TYPES)


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("2xv5litepod-8", ["v5litepod-8", "v5litepod-8"]),
        ("v5litepod-16,v5litepod-4", ["v5litepod-16", "v5litepod-4"]),
        (" 3xv5litepod-1 , v5litepod-8", ["v5litepod-1"] * 3 + ["v5litepod-8"]),
        ("V5LITEPOD-4", ["v5litepod-4"]),
    ],
)
def test_parse_sim_spec_returns_one_entry_per_slice_in_order(spec, names):
    assert [t.name for t in parse_sim_spec(spec)] == names


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "bad simulation spec part ''"),
        ("2*v5litepod-8", "bad simulation spec part '2\\*v5litepod-8'"),
        ("v4-8", "bad simulation spec part 'v4-8'"),
        ("2xv5litepod-8,", "bad simulation spec part ''"),
        ("0xv5litepod-8", "slice count must be at least 1"),
        ("v5litepod-3", "unknown slice type 'v5litepod-3'"),
    ],
)
def test_bad_sim_specs_are_refused_with_a_message(spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_sim_spec(spec)


# -- worker environment ----------------------------------------------------------------


def placement(slice_index=1, host_index=2, num_slices=2):
    return HostPlacement(slice_index, host_index, num_slices, hosts_per_slice=4, chips_per_host=4)


def test_placement_process_id_is_slice_major():
    assert placement(slice_index=1, host_index=2).process_id == 6
    assert placement(slice_index=0, host_index=3).process_id == 3


def test_simulated_env_gives_the_host_one_cpu_device_per_chip():
    env = simulated_host_env(HostPlacement(0, 0, 1, 1, 8))
    assert env["JAX_PLATFORMS"] == "cpu"
    assert "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"].split()


def test_only_a_simulated_host_runs_its_dispatch_threads_after_its_devices():
    """worker/sched.py reads the variable the controller sets; a TPU host's threads keep
    the default policy, its devices not being the host's cores."""
    assert simulated_host_env(placement())[sched.SCHEDULING_ENV] == "idle"
    assert sched.SCHEDULING_ENV not in tpu_host_env(placement(), "10.0.0.1")


def test_xla_accepts_the_simulated_hosts_flags():
    """A process started with the simulated host's environment has its devices: XLA
    aborts on a flag it does not know, so a misspelt one fails here, not in a gang."""
    env = simulated_host_env(HostPlacement(0, 0, 1, 1, 4))
    run = subprocess.run(
        [sys.executable, "-c", "import jax; print(len(jax.devices()), jax.default_backend())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["4", "cpu"], run.stdout


LOADERS = ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1")


def test_simulated_env_asks_glibc_for_huge_pages_in_a_form_it_reads():
    """The tunable is spelled as glibc reads it: its own loader lists it as set."""
    loader = next((p for p in LOADERS if os.path.exists(p)), None)
    if loader is None or platform.libc_ver()[0] != "glibc":
        pytest.skip("no glibc dynamic loader at a known path")
    env = simulated_host_env(HostPlacement(0, 0, 1, 1, 8))
    listed = subprocess.run(
        [loader, "--list-tunables"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "glibc.malloc.hugetlb: 0x1 " in listed


# Allocates, fills and frees 64 MiB 20 times after a first time, and prints the page
# faults those 20 cost and whether jemalloc is mapped into the process.
_REUSE_PROBE = """
import resource, numpy as np
def cycle():
    a = np.empty(64 * 2**20, np.uint8)
    a.fill(1)
    del a
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    cycle()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults, "libjemalloc" in open("/proc/self/maps").read())
"""


def test_a_simulated_host_reuses_freed_device_memory_instead_of_faulting_it_again():
    """The pool takes effect in a process started with the simulated host's environment:
    freeing and allocating 64 MiB again costs no page faults (glibc: 16,384 a time in
    4-KiB pages, 32 in huge pages), and jemalloc took its options without a complaint."""
    assert jemalloc_library() is not None, "Ray's Linux wheel ships ray/core/libjemalloc.so"
    env = simulated_host_env(HostPlacement(0, 0, 1, 1, 4))
    run = subprocess.run(
        [sys.executable, "-c", _REUSE_PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "<jemalloc>" not in run.stderr, run.stderr[-2000:]
    faults, mapped = run.stdout.split()
    assert mapped == "True"
    assert int(faults) < 64, f"{faults} page faults in 20 reallocations of 64 MiB"


def test_without_the_pool_a_simulated_host_gets_the_system_malloc(monkeypatch):
    monkeypatch.setenv(DEVICE_POOL_ENV, "0")
    env = simulated_host_env(HostPlacement(0, 0, 1, 1, 4))
    assert "LD_PRELOAD" not in env and "MALLOC_CONF" not in env
    monkeypatch.delenv(DEVICE_POOL_ENV)
    assert simulated_host_env(HostPlacement(0, 0, 1, 1, 4))["MALLOC_CONF"] == POOL_MALLOC_CONF


def test_tpu_env_for_one_slice_has_no_megascale_variables():
    env = tpu_host_env(placement(slice_index=0, host_index=3, num_slices=1), "10.0.0.7")
    assert env["JAX_PLATFORMS"] == "tpu"
    assert env["TPU_WORKER_ID"] == "3"
    assert not [k for k in env if k.startswith("MEGASCALE_")]


def test_tpu_env_for_multislice_matches_ray_coordinator_env_vars():
    env = tpu_host_env(placement(slice_index=1, host_index=2, num_slices=3), "10.0.0.7")
    megascale = {k: v for k, v in env.items() if k.startswith("MEGASCALE_")}
    assert megascale == get_tpu_coordinator_env_vars("10.0.0.7", num_slices=3, slice_id=1)
    assert env["TPU_WORKER_ID"] == "2"


# -- protobuf conversions --------------------------------------------------------------

HYBRID = MeshSpec.build({"slice": 2, "data": 2}, {"data": 2, "model": 4})


def through_the_wire(message):
    return type(message).FromString(message.SerializeToString())


def test_mesh_round_trips_through_protobuf():
    assert wire.mesh_from_pb(through_the_wire(wire.mesh_to_pb(HYBRID))) == HYBRID


@pytest.mark.parametrize(
    "pspec",
    [
        (("slice", "data"), None, "model"),
        (),
        (None,),
        ("model", ("data", "slice")),
    ],
)
def test_sharding_round_trips_through_protobuf(pspec):
    sharding = ShardingSpec.from_partition_spec(HYBRID, pspec)
    back = wire.sharding_from_pb(through_the_wire(wire.sharding_to_pb(sharding)))
    assert back == sharding
    assert back.partition_spec() == pspec


@pytest.mark.parametrize(
    "spec",
    [
        ArraySpec((2, 3), "float32"),
        ArraySpec((), "int8"),
        ArraySpec((0, 5), "bfloat16"),
    ],
)
def test_array_spec_round_trips_through_protobuf(spec):
    assert wire.spec_from_pb(through_the_wire(wire.spec_to_pb(spec))) == spec


def test_array_spec_from_protobuf_is_validated():
    with pytest.raises(InvalidRequestError, match="unknown dtype"):
        wire.spec_from_pb(pb.ArraySpec(shape=[2], dtype="floot32"))


def test_array_info_carries_state_and_error():
    record = ArrayRecord("g1/a1", "g1", ArraySpec((4,), "float32"))
    assert messages.array_to_pb(record).state == pb.ARRAY_STATE_PENDING
    record.settle("worker 0 died")
    info = through_the_wire(messages.array_to_pb(record))
    assert (info.handle, info.state, info.error) == (
        "g1/a1",
        pb.ARRAY_STATE_FAILED,
        "worker 0 died",
    )
    assert wire.spec_from_pb(info.spec) == record.spec


@pytest.mark.parametrize("length", [0, 1, 6, 7, 20])
def test_chunks_are_at_most_the_chunk_size_and_reassemble_the_original(length):
    data = bytes(range(length))
    pieces = list(wire.chunks(memoryview(data), 3))
    assert all(0 < len(p) <= 3 for p in pieces)
    assert all(len(p) == 3 for p in pieces[:-1])
    assert b"".join(pieces) == data


def test_chunks_share_memory_with_the_original():
    data = bytearray(10)
    pieces = list(wire.chunks(memoryview(data), 4))
    data[5] = 7
    assert pieces[1][1] == 7


def test_default_chunk_size_stays_under_grpc_message_limit():
    data = memoryview(bytes(wire.CHUNK_BYTES + 1))
    assert [len(p) for p in wire.chunks(data)] == [wire.CHUNK_BYTES, 1]
    assert wire.CHUNK_BYTES < 4 * 2**20


def test_chunks_of_a_wide_memoryview_are_still_at_most_size_bytes():
    data = memoryview(np.arange(10, dtype=np.float32))
    pieces = list(wire.chunks(data, 8))
    assert all(p.nbytes <= 8 for p in pieces)
    assert b"".join(bytes(p) for p in pieces) == data.tobytes()


# -- gRPC status codes -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequestError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (ProgramMismatchError("wrong mesh"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotFoundError("no such handle"), grpc.StatusCode.NOT_FOUND),
        (FailedPreconditionError("released"), grpc.StatusCode.FAILED_PRECONDITION),
        (CapacityError("too big"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DeadlineError("too slow"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (WorkerError("host died"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_each_error_class_maps_to_its_grpc_code(error, code):
    assert status_code_for(error) == code


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("oops"),
        KeyError("k"),
        ValueError("v"),
        TimeoutError(),
    ],
)
def test_an_unexpected_error_maps_to_internal(error):
    assert status_code_for(error) == grpc.StatusCode.INTERNAL
