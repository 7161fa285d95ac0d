"""A real controller that authenticates: bearer tokens from a tokens file, over mutual
TLS with certificates the test makes; tenants that cannot see or touch each other's
gangs, arrays, programs and jobs (an admin sees all); and a controller asked to listen
beyond loopback without authentication, which refuses to start."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import jax
import numpy as np
import pytest

import slicewise
from controller.auth import add_token
from controller.jobview import TERMINAL
from programs.lm.config import SMALL_OVERRIDES
from protos import controller_pb2 as pb
from slicewise import wire
from slicewise.client import _call
from slicewise.common import direct
from slicewise.common.errors import SlicewiseError
from slicewise.common.framing import TransportError, recv_header, send_header
from slicewise.common.mesh import ShardingSpec
from slicewise.launch import ControllerStartError
from slicewise.testing import wait_until
from tests.certs import make_certificates
from tests.integration.conftest import controller_log, start_controller

pytestmark = pytest.mark.integration

# Direct transfers expire this soon here, so that their clean-up can be seen.
DIRECT_TTL_S = 4


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    directory = tmp_path_factory.mktemp("auth")
    tokens = directory / "tokens"
    token = add_token(tokens, "alice")
    others = {
        "bob": add_token(tokens, "bob", caps={"max_chips": 1, "max_bytes": 1024}),
        "ops": add_token(tokens, "ops", "admin"),
    }
    certs = make_certificates(directory)
    data = directory / "data"
    data.mkdir()
    (data / "a.txt").write_text("hello " * 100)
    proc = start_controller(
        tmp_path_factory,
        "auth-controller",
        sim="2xv5litepod-1",
        extra_args=(
            "--tokens-file",
            str(tokens),
            "--tls-cert",
            certs.server_cert,
            "--tls-key",
            certs.server_key,
            "--tls-client-ca",
            certs.ca,
            "--data-root",
            str(data),
            "--direct-transfer-ttl",
            str(DIRECT_TTL_S),
        ),
    )
    proc.data_root = data
    try:
        yield proc, token, certs, others
    finally:
        assert proc.stop() == 0


def as_tenant(secured, token):
    proc, _, certs, _ = secured
    mtls = {"tls_ca": certs.ca, "tls_cert": certs.client_cert, "tls_key": certs.client_key}
    return slicewise.connect(proc.address, token=token, **mtls)


def test_mutual_tls_and_a_token_get_in(secured):
    proc, token, certs, _ = secured
    mtls = {"tls_ca": certs.ca, "tls_cert": certs.client_cert, "tls_key": certs.client_key}
    with slicewise.connect(proc.address, token=token, **mtls) as client:
        assert client.cluster_info().slices
        assert client.health().simulated
    for bad, why in ((None, "no bearer token"), (token[:-2], "an unknown bearer token")):
        with slicewise.connect(proc.address, token=bad, **mtls) as client:
            with pytest.raises(SlicewiseError, match=why) as info:
                client.cluster_info()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as raw:  # streams are refused as well
                list(client.stub.WatchJob(pb.WatchJobRequest(job_id="j1")))
            assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_without_a_client_certificate_or_trust_there_is_no_connection(secured):
    proc, token, certs, _ = secured
    with pytest.raises(ConnectionError, match="TLS handshake"):
        slicewise.connect(proc.address, token=token, tls_ca=certs.ca, timeout=3)
    with pytest.raises(ConnectionError):
        slicewise.connect(proc.address, token=token, timeout=3)  # plain text to a TLS port


def test_tenants_see_only_their_own_and_an_admin_sees_all(secured):
    _, alice_token, _, others = secured
    with (
        as_tenant(secured, alice_token) as alice,
        as_tenant(secured, others["bob"]) as bob,
        as_tenant(secured, others["ops"]) as ops,
    ):
        gang = alice.allocate(1, "v5litepod-1", timeout=120)
        mesh = gang.mesh()
        x = gang.put(np.arange(8, dtype=np.float32), mesh.sharding())
        double = gang.compile(jax.jit(lambda a: a * 2), x)
        own = bob.allocate(1, "v5litepod-1", timeout=120)
        # Queued behind the two gangs, which hold both slices until it is cancelled below.
        job = alice.submit_job(
            "lm", slices=1, slice_type="v5litepod-1", steps=1, overrides=SMALL_OVERRIDES
        )
        try:
            stub = bob.stub
            # Alice's direct put, under way while bob tries to begin, finish or end one.
            spec = pb.ArraySpec(shape=[8], dtype="float32")
            sharding = wire.sharding_to_pb(x.sharding)
            put = pb.BeginDirectPutRequest(gang_id=gang.id, spec=spec, sharding=sharding)
            transfer = alice.stub.BeginDirectPut(put).transfer_id
            for what, call in {
                "direct put": lambda: stub.BeginDirectPut(put),
                "direct fetch": lambda: stub.BeginDirectFetch(
                    pb.BeginDirectFetchRequest(handle=x.handle)
                ),
                "finish": lambda: stub.FinishDirectPut(
                    pb.FinishDirectPutRequest(transfer_id=transfer)
                ),
                "abandon": lambda: stub.AbandonDirectTransfer(
                    pb.AbandonDirectTransferRequest(transfer_id=transfer)
                ),
            }.items():
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.NOT_FOUND, what
                assert "alice" not in info.value.details(), what
            # Still hers, and still under way (TTL permitting: it is only DIRECT_TTL_S).
            alice.stub.AbandonDirectTransfer(pb.AbandonDirectTransferRequest(transfer_id=transfer))
            refused = {
                "gang": lambda: stub.ReleaseGang(pb.ReleaseGangRequest(gang_id=gang.id)),
                "array": lambda: list(stub.FetchArray(pb.FetchArrayRequest(handle=x.handle))),
                "delete": lambda: stub.DeleteArrays(pb.DeleteArraysRequest(handles=[x.handle])),
                "program": lambda: stub.Execute(
                    pb.ExecuteRequest(gang_id=own.id, program_id=double.id, inputs=[])
                ),
                "calls": lambda: list(
                    stub.Calls(
                        iter(
                            [
                                pb.CallBatch(
                                    gang_id=gang.id,
                                    batch=1,
                                    stream=f"{gang.id}/cbob",
                                    calls=[
                                        pb.StreamCall(
                                            program_id=double.id,
                                            inputs=[x.handle],
                                            outputs=[f"{gang.id}/cbob.1"],
                                        )
                                    ],
                                    deletes=[x.handle],
                                    sync=True,
                                )
                            ]
                        )
                    )
                ),
                "job": lambda: stub.GetJob(pb.GetJobRequest(job_id=job.job_id)),
                "cancel": lambda: stub.CancelJob(pb.CancelJobRequest(job_id=job.job_id)),
            }
            for what, call in refused.items():
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.NOT_FOUND, what
                assert "alice" not in info.value.details(), what
            assert job.job_id not in [j.job_id for j in bob.jobs()]
            # Bob's caps: one chip, 1 KiB of arrays.
            own.put(np.zeros(128, np.float32), own.mesh().sharding())  # 512 B
            big = pb.ArraySpec(shape=[256], dtype="float32")
            own_sharding = wire.sharding_to_pb(ShardingSpec(own.mesh().spec, ()))
            for what, call in (
                ("chips", lambda: bob.allocate(1, "v5litepod-1", timeout=30)),
                ("bytes", lambda: own.put(np.zeros(256, np.float32), own.mesh().sharding())),
                (
                    "direct bytes",
                    lambda: _call(
                        bob.stub.BeginDirectPut,
                        pb.BeginDirectPutRequest(gang_id=own.id, spec=big, sharding=own_sharding),
                    ),
                ),
            ):
                with pytest.raises(SlicewiseError, match="of its cap of") as info:
                    call()
                assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, what
            assert gang.id not in [g.gang_id for g in bob.cluster_info().gangs]
            # Nothing of alice's changed: her array, program, gang and job are all there.
            np.testing.assert_array_equal(double(x).fetch(), np.arange(8) * 2)
            assert alice.job(job.job_id).job_id == job.job_id
            # The admin sees everyone's.
            assert {gang.id, own.id} <= {g.gang_id for g in ops.cluster_info().gangs}
            assert ops.job(job.job_id).job_id == job.job_id
        finally:
            alice.cancel_job(job.job_id)
            own.release()
            gang.release()


def test_worker_ports_refuse_every_connection_without_the_gang_token(secured):
    _, token, _, _ = secured
    with as_tenant(secured, token) as alice:
        gang = alice.allocate(1, "v5litepod-1", timeout=120)
        try:
            x = gang.put(np.arange(8, dtype=np.float32), gang.mesh().sharding())
            x.block_until_ready()
            [worker] = gang.stats().workers
            host, port = worker.data_address.rsplit(":", 1)
            assert host == "127.0.0.1"  # the address Ray uses here, not every interface
            for header in (
                {"op": "put", "key": x.handle, "pieces": []},
                {"op": "get", "key": x.handle},
                {"op": "control", "epoch": 1, "token": "not-the-token"},
            ):
                with socket.create_connection((host, int(port)), timeout=60) as sock:
                    send_header(sock, header)
                    reply = recv_header(sock)
                assert "wrong or missing token" in reply["error"], header
                assert "pieces" not in reply
            # The gang's own connections go on working, and nothing changed.
            np.testing.assert_array_equal(x.fetch(), np.arange(8, dtype=np.float32))
            assert gang.stats().workers[0].arrays == worker.arrays
        finally:
            gang.release()


def test_abandoned_direct_transfers_leave_nothing_on_the_workers(secured):
    proc, token, _, _ = secured
    with as_tenant(secured, token) as alice:
        gang = alice.allocate(1, "v5litepod-1", timeout=120)
        try:
            x = gang.put(np.arange(1024, dtype=np.float32), gang.mesh().sharding())
            spec, sharding = pb.ArraySpec(shape=[1024], dtype="float32"), x.sharding
            put = pb.BeginDirectPutRequest(
                gang_id=gang.id, spec=spec, sharding=wire.sharding_to_pb(sharding)
            )
            begun = alice.stub.BeginDirectPut(put)
            [host] = begun.hosts
            piece = tuple(slice(r.start, r.stop) for r in host.pieces[0].ranges)
            part = direct.HostPart(host.data_address, host.capability, (piece,))
            direct.put(begun.transfer_id, np.ones(1024, np.float32), [part])  # staged
            fetch = alice.stub.BeginDirectFetch(pb.BeginDirectFetchRequest(handle=x.handle))
            assert fetch.array.handle == x.handle
            # Neither is finished or read: both are taken off the worker at expiry.
            wait_until(
                lambda: [(w.staged, w.pins) for w in gang.stats().workers] == [(0, 0)],
                timeout_s=60,
                what="the abandoned direct put and fetch to be cleaned up",
            )
            with pytest.raises(grpc.RpcError) as info:
                alice.stub.FinishDirectPut(pb.FinishDirectPutRequest(transfer_id=begun.transfer_id))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "expired" in info.value.details()
            # Its capability is no use any more either: expired, or (in the second
            # before it does) refused by the worker, which remembers the put ended.
            with pytest.raises(TransportError, match="wrong capability|has ended"):
                direct.put(begun.transfer_id, np.ones(1024, np.float32), [part])
            np.testing.assert_array_equal(x.fetch(), np.arange(1024, dtype=np.float32))
            # Transfers of a gang released before they expire expire quietly (the
            # fetch's first: its clean-up is due first).
            alice.stub.BeginDirectFetch(pb.BeginDirectFetchRequest(handle=x.handle))
            late = alice.stub.BeginDirectPut(put).transfer_id
        finally:
            gang.release()
        wait_until(
            lambda: f"direct put {late} expired" in controller_log(proc),
            timeout_s=60,
            what=f"direct put {late} to expire",
        )
        assert alice.health().num_gangs == 0
        log = controller_log(proc)
        for sign in ("failed unexpectedly", "never retrieved", "Exception in callback"):
            assert sign not in log, sign


def test_jobs_read_data_only_under_the_data_roots(secured):
    proc, token, _, _ = secured
    with as_tenant(secured, token) as alice:
        inside = alice.submit_job(
            "lm",
            slices=1,
            slice_type="v5litepod-1",
            steps=1,
            overrides=SMALL_OVERRIDES | {"corpus": f"{proc.data_root}/*.txt"},
        )
        ended = wait_until(
            lambda: (job := alice.job(inside.job_id)).state in TERMINAL and job,
            timeout_s=240,
            interval_s=0.5,
            what=f"job {inside.job_id} to end",
        )
        assert ended.state == pb.JOB_STATE_SUCCEEDED, ended.error
        assert ended.step == 1
        for spec in ("/etc/*", f"{proc.data_root}/../*", "/etc/passwd"):
            with pytest.raises(SlicewiseError, match="reaches outside the data roots") as info:
                alice.submit_job(
                    "lm", slices=1, slice_type="v5litepod-1", steps=1, overrides={"corpus": spec}
                )
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_no_controller_serves_beyond_loopback_without_authentication(tmp_path_factory):
    run = subprocess.run(
        [sys.executable, "-m", "controller.cli", "controller", "--sim", "1xv5litepod-1"]
        + ["--host", "0.0.0.0", "--insecure-local"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "only on a loopback address, not '0.0.0.0'" in run.stderr
    plain = subprocess.run(
        [sys.executable, "-m", "controller.cli", "controller", "--sim", "1xv5litepod-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 2
    assert "authentication is on by default" in plain.stderr
    with pytest.raises(ControllerStartError):
        start_controller(
            tmp_path_factory,
            "no-tokens",
            sim="1xv5litepod-1",
            extra_args=("--tokens-file", str(tmp_path_factory.mktemp("x") / "missing")),
            start_timeout_s=120,
        )
