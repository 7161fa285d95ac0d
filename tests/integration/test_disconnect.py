"""A client killed (SIGKILL) in the middle of a put, a fetch or a program upload leaves
nothing behind: the bytes the controller held for the transfer, and the workers' arrays,
bytes, pins and programs, are back to what they were before it started.

The client is a process of its own on a real gRPC connection. It says when it is in the
middle of its stream (and the controller's `slicewise_transfer_bytes` gauge confirms it
holds the transfer's bytes) and then hangs, so the kill always lands mid-stream, without
sleeps. (A handle deleted twice is deleted once and reported once: test_bad_input.py.)
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slicewise.testing import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIG = 64 * 2**20  # bytes: more than a connection's flow-control window
TIMEOUT_S = 60.0

# argv: address, what ("put", "fetch" or "program"), gang id, then the declared size
# (put, program) or the handle (fetch). Prints one line once in the middle of its stream.
CLIENT = r"""
import sys, threading
import grpc
from protos import controller_pb2 as pb, controller_pb2_grpc as pb_grpc
from slicewise import wire
from slicewise.common.arrays import ArraySpec
from slicewise.common.mesh import MeshSpec, ShardingSpec

address, what, gang_id, arg = sys.argv[1:5]
stub = pb_grpc.ControllerStub(grpc.insecure_channel(address))
mesh = MeshSpec.build({"slice": 2}, {"chip": 4})
hang = threading.Event()

def put():
    spec = ArraySpec((int(arg) // 4,), "float32")
    sharding = ShardingSpec(mesh, ())
    yield pb.PutChunk(header=pb.PutHeader(
        gang_id=gang_id, spec=wire.spec_to_pb(spec), sharding=wire.sharding_to_pb(sharding)))
    yield pb.PutChunk(data=bytes(wire.CHUNK_BYTES))
    print("sent the first chunk", flush=True)
    hang.wait()

def program():
    yield pb.ProgramChunk(header=pb.ProgramHeader(
        gang_id=gang_id, name="never", mesh=wire.mesh_to_pb(mesh), total_bytes=int(arg)))
    yield pb.ProgramChunk(data=bytes(4096))
    print("sent the first chunk", flush=True)
    hang.wait()

if what == "put":
    stub.PutArray(put())
elif what == "program":
    stub.RegisterProgram(program())
else:
    stream = stub.FetchArray(pb.FetchArrayRequest(handle=arg))
    next(stream)  # the header
    next(stream)  # the first chunk of data; the rest stays unread
    print("received the first chunk", flush=True)
    hang.wait()
"""


@contextlib.contextmanager
def client_process(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The client above, killed on leaving the block if it still runs."""
    with open(tmp_path / f"client-{args[1]}.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, *args],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=ROOT,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def line_from(proc: subprocess.Popen[str], timeout_s: float = TIMEOUT_S) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise TimeoutError(f"the client said nothing within {timeout_s:g} s")
    line = proc.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"the client exited ({proc.wait(timeout=30)}) before its stream")
    return line


def held(controller: Any) -> dict[str, float]:
    """The controller's `slicewise_transfer_bytes` gauge, by kind of transfer."""
    with urllib.request.urlopen(controller.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    out = {"put": 0.0, "fetch": 0.0, "program": 0.0}
    for line in text.splitlines():
        if line.startswith("slicewise_transfer_bytes{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def state(controller: Any, gang: Any) -> dict[str, Any]:
    """What the controller and the gang's workers hold."""
    return {
        "controller transfer bytes": held(controller),
        "controller arrays": next(
            g.live_arrays for g in gang.client.cluster_info().gangs if g.gang_id == gang.id
        ),
        "workers (arrays, bytes, pins, programs)": [
            (w.arrays, w.bytes, w.pins, w.programs) for w in gang.stats().workers
        ],
    }


def back_to(controller: Any, gang: Any, before: dict[str, Any]) -> None:
    try:
        wait_until(
            lambda: state(controller, gang) == before,
            timeout_s=TIMEOUT_S,
            what="the controller and the workers to hold what they held before",
        )
    except TimeoutError:
        assert state(controller, gang) == before  # shows what stayed behind


def still_serves(gang: Any) -> None:
    mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
    x = gang.put(np.arange(8, dtype=np.float32), mesh.sharding(("slice", "chip")))
    np.testing.assert_array_equal(x.fetch(), np.arange(8, dtype=np.float32))
    x.delete()


@pytest.fixture(scope="module")
def gang(two_slices):
    still_serves(two_slices)  # the workers' first put and fetch are behind us
    return two_slices


def settled(controller: Any, gang: Any) -> dict[str, Any]:
    """`state` once the workers have applied every operation queued so far."""
    previous: dict[str, Any] = {}

    def steady() -> dict[str, Any] | None:
        nonlocal previous
        now = state(controller, gang)
        stats = gang.stats()
        done = stats.completed == stats.dispatched and now == previous
        previous = now
        return now if done else None

    return wait_until(steady, timeout_s=TIMEOUT_S, what="the gang to be idle", interval_s=0.2)


def test_a_client_killed_in_the_middle_of_a_put_leaves_nothing_behind(controller, gang, tmp_path):
    before = settled(controller, gang)
    dispatched = gang.stats().dispatched
    with client_process(tmp_path, controller.address, "put", gang.id, str(BIG)) as proc:
        assert line_from(proc) == "sent the first chunk"
        wait_until(
            lambda: held(controller)["put"] >= before["controller transfer bytes"]["put"] + BIG,
            timeout_s=TIMEOUT_S,
            what="the controller to hold the put's buffer",
        )
        proc.kill()
    back_to(controller, gang, before)
    assert gang.stats().dispatched == dispatched  # nothing reached the workers
    still_serves(gang)


def test_a_client_killed_in_the_middle_of_a_program_upload_leaves_nothing_behind(
    controller, gang, tmp_path
):
    before = settled(controller, gang)
    dispatched = gang.stats().dispatched
    declared = 1_000_000
    with client_process(tmp_path, controller.address, "program", gang.id, str(declared)) as proc:
        assert line_from(proc) == "sent the first chunk"
        wait_until(
            lambda: (
                held(controller)["program"] >= before["controller transfer bytes"]["program"] + 4096
            ),
            timeout_s=TIMEOUT_S,
            what="the controller to hold the program's first bytes",
        )
        proc.kill()
    back_to(controller, gang, before)
    assert gang.stats().dispatched == dispatched  # no program load was queued
    still_serves(gang)


def test_a_client_killed_in_the_middle_of_a_fetch_leaves_nothing_behind(controller, gang, tmp_path):
    mesh = gang.mesh(dcn={"slice": 2}, ici={"chip": 4})
    fill = gang.compile(
        jax.jit(
            lambda: jnp.ones(BIG // 4, jnp.float32), out_shardings=mesh.sharding(("slice", "chip"))
        ),
        name="fill",
        mesh=mesh,
    )
    fill().delete()  # loaded and compiled on the workers
    without = settled(controller, gang)
    big = fill()
    big.block_until_ready()
    before = settled(controller, gang)
    with client_process(tmp_path, controller.address, "fetch", gang.id, big.handle) as proc:
        assert line_from(proc) == "received the first chunk"
        assert held(controller)["fetch"] >= before["controller transfer bytes"]["fetch"] + BIG
        proc.kill()
    back_to(controller, gang, before)
    np.testing.assert_array_equal(big.fetch()[:4], np.ones(4, np.float32))  # still there
    big.delete()
    back_to(controller, gang, without)
    still_serves(gang)
