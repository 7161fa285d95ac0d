"""Authentication: tokens files, the server interceptor on a real gRPC server over
loopback (unary and streaming calls, plain and TLS), the client's token and TLS options,
and the rule that a controller without authentication listens only on loopback. (A real
controller with tokens and mutual TLS: tests/integration/test_auth.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import threading
from pathlib import Path

import grpc
import pytest

import slicewise
from controller.auth import (
    LOCAL,
    AuthConfigError,
    AuthInterceptor,
    Identity,
    TokenTable,
    add_token,
    bearer,
    current_identity,
    digest,
    is_loopback,
)
from controller.server import ServerConfig
from protos import controller_pb2 as pb
from protos import controller_pb2_grpc as pb_grpc
from slicewise.common.errors import SlicewiseError
from tests.certs import make_certificates


class WhoAmI(pb_grpc.ControllerServicer):
    """Answers with the caller's identity: Health in `version`, GetTrace as its data."""

    async def Health(self, request, context):
        who = current_identity()
        return pb.HealthResponse(version=f"{who.tenant}/{who.role}")

    async def GetTrace(self, request, context):
        who = current_identity()
        for part in (who.tenant, who.role):
            yield pb.TraceChunk(data=part.encode())


class Server:
    """A grpc.aio server with the interceptor, in a thread of its own."""

    def __init__(self, table: TokenTable, credentials=None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(table, credentials), self.loop)
        self.port = self.port.result(timeout=30)

    async def _start(self, table, credentials) -> int:
        self.server = grpc.aio.server(interceptors=[AuthInterceptor(table)])
        pb_grpc.add_ControllerServicer_to_server(WhoAmI(), self.server)
        if credentials is None:
            port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            port = self.server.add_secure_port("127.0.0.1:0", credentials)
        await self.server.start()
        return port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens"
    alice = add_token(path, "alice")
    root = add_token(path, "ops", "admin")
    return path, alice, root


def test_a_tokens_file_keeps_only_digests_and_identifies_its_tokens(tokens):
    path, alice, root = tokens
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert alice not in text and root not in text and digest(alice) in text
    table = TokenTable.load(path)
    assert table.identify(alice) == Identity("alice", "user")
    assert table.identify(root) == Identity("ops", "admin") and table.identify(root).admin
    assert table.identify(alice + "x") is None and table.identify("") is None
    assert len(alice) >= 40 and alice != add_token(path, "alice")  # fresh, long tokens


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "line 1: not JSON"),
        ('["alice"]', "line 1: expected an object"),
        ('{"tenant": "", "sha256": "' + "a" * 64 + '"}', "'tenant' must be a name"),
        ('{"tenant": "a", "role": "root", "sha256": "' + "a" * 64 + '"}', "'role' must be"),
        ('{"tenant": "a", "sha256": "abc"}', "'sha256' must be 64 hex digits"),
        ('{"tenant": "a", "sha256": "' + "g" * 64 + '"}', "'sha256' must be 64 hex digits"),
    ],
)
def test_bad_tokens_files_say_which_line_and_what(tmp_path, line, message):
    path = tmp_path / "tokens"
    path.write_text(line + "\n")
    with pytest.raises(AuthConfigError, match=message):
        TokenTable.load(path)


def test_empty_and_missing_tokens_files_are_refused(tmp_path):
    (tmp_path / "empty").write_text("# nobody yet\n\n")
    with pytest.raises(AuthConfigError, match="holds no tokens; add one with `slicewise token"):
        TokenTable.load(tmp_path / "empty")
    with pytest.raises(AuthConfigError, match="cannot read tokens file"):
        TokenTable.load(tmp_path / "missing")
    with pytest.raises(AuthConfigError, match="role 'root'"):
        add_token(tmp_path / "t", "a", "root")


def test_bearer_tokens_and_loopback_addresses():
    assert bearer([("authorization", "Bearer abc"), ("x", "y")]) == "abc"
    assert bearer([("authorization", "Basic abc")]) is None and bearer(None) is None
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "myhost", ""))
    assert current_identity() == LOCAL  # outside any authenticated call


def test_calls_need_a_known_token_and_run_as_its_tenant(tokens):
    path, alice, root = tokens
    server = Server(TokenTable.load(path))
    address = f"127.0.0.1:{server.port}"
    try:
        with slicewise.connect(address, token=alice) as client:
            assert client.health().version == "alice/user"
            assert b"".join(c.data for c in client.stub.GetTrace(pb.GetTraceRequest())) == (
                b"aliceuser"
            )
        with slicewise.connect(address, token=root) as client:
            assert client.health().version == "ops/admin"
        for token, why in ((None, "no bearer token"), ("forged", "an unknown bearer token")):
            with slicewise.connect(address, token=token) as client:
                with pytest.raises(SlicewiseError, match=why) as info:
                    client.health()
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as raw:
                    list(client.stub.GetTrace(pb.GetTraceRequest()))
                assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()


def test_the_token_comes_from_the_environment_too(tokens, monkeypatch):
    path, alice, _ = tokens
    server = Server(TokenTable.load(path))
    try:
        monkeypatch.setenv("SLICEWISE_TOKEN", alice)
        with slicewise.connect(f"127.0.0.1:{server.port}") as client:
            assert client.health().version == "alice/user"
    finally:
        server.stop()


def test_tls_with_certificates_the_test_makes(tokens, tmp_path):
    path, alice, _ = tokens
    certs = make_certificates(tmp_path)
    key, chain = Path(certs.server_key).read_bytes(), Path(certs.server_cert).read_bytes()
    credentials = grpc.ssl_server_credentials([(key, chain)])
    server = Server(TokenTable.load(path), credentials)
    address = f"127.0.0.1:{server.port}"
    try:
        with slicewise.connect(address, token=alice, tls_ca=certs.ca) as client:
            assert client.health().version == "alice/user"
        # A client that does not trust the server's CA never gets through the handshake.
        (tmp_path / "other").mkdir()
        other = make_certificates(tmp_path / "other", ca_name="another CA")
        with pytest.raises(ConnectionError, match="TLS handshake"):
            slicewise.connect(address, token=alice, tls_ca=other.ca, timeout=3)
    finally:
        server.stop()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "authentication is on by default: give --tokens-file"),
        ({"insecure_local": True, "host": "0.0.0.0"}, "only on a loopback address, not '0.0.0.0'"),
        ({"insecure_local": True, "tokens_file": "t"}, "either --tokens-file or --insecure-local"),
        ({"tokens_file": "t", "tls_cert": "c"}, "both --tls-cert and --tls-key"),
        ({"tokens_file": "t", "tls_client_ca": "ca"}, "needs --tls-cert and --tls-key"),
    ],
)
def test_a_controller_without_authentication_listens_only_on_loopback(fields, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(sim="1xv5litepod-1", **fields)
    ServerConfig(sim="1xv5litepod-1", insecure_local=True, host="127.0.0.1")
    ServerConfig(sim="1xv5litepod-1", tokens_file="t", host="0.0.0.0")


def test_token_add_prints_the_token_once(tmp_path, capsys):
    from controller.cli import main

    path = tmp_path / "tokens"
    assert main(["token", "add", "--tokens-file", str(path), "--tenant", "bob"]) == 0
    token = capsys.readouterr().out.strip()
    assert TokenTable.load(path).identify(token) == Identity("bob", "user")
    assert json.loads(path.read_text())["tenant"] == "bob"
