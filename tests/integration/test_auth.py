"""A real controller that authenticates: bearer tokens from a tokens file, over mutual
TLS with certificates the test makes; and one asked to listen beyond loopback without
authentication, which refuses to start."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

import slicewise
from controller.auth import add_token
from protos import controller_pb2 as pb
from slicewise.common.errors import SlicewiseError
from slicewise.launch import ControllerStartError
from tests.certs import make_certificates
from tests.integration.conftest import start_controller

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    directory = tmp_path_factory.mktemp("auth")
    tokens = directory / "tokens"
    token = add_token(tokens, "alice")
    certs = make_certificates(directory)
    proc = start_controller(
        tmp_path_factory,
        "auth-controller",
        sim="1xv5litepod-1",
        extra_args=(
            "--tokens-file",
            str(tokens),
            "--tls-cert",
            certs.server_cert,
            "--tls-key",
            certs.server_key,
            "--tls-client-ca",
            certs.ca,
        ),
    )
    try:
        yield proc, token, certs
    finally:
        assert proc.stop() == 0


def test_mutual_tls_and_a_token_get_in(secured):
    proc, token, certs = secured
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
    proc, token, certs = secured
    with pytest.raises(ConnectionError, match="TLS handshake"):
        slicewise.connect(proc.address, token=token, tls_ca=certs.ca, timeout=3)
    with pytest.raises(ConnectionError):
        slicewise.connect(proc.address, token=token, timeout=3)  # plain text to a TLS port


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
