"""The worker's data port over real loopback sockets: puts and gets only for a peer that
shows the gang's token, headers of bounded size, and the port still serving after a
stranger tried."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from controller import datalink
from slicewise.common.framing import (
    LENGTH,
    MAX_HEADER_BYTES,
    TransportError,
    piece_meta,
    recv_header,
    send_header,
)
from worker.transport import DataServer

TOKEN = "0123456789abcdef"
PIECE = ((slice(0, 2), slice(0, 3)), np.arange(6, dtype=np.float32).reshape(2, 3))


class Store:
    """A worker's data server whose puts land in a dict and whose gets read from it."""

    def __init__(self):
        self.stored = {}
        self.server = DataServer("127.0.0.1", TOKEN, self.put, self.get, self.control)
        self.controls = 0

    def put(self, key, pieces, started_us):
        self.stored[key] = pieces

    def get(self, key):
        return self.stored[key]

    def control(self, conn, hello, reply):
        self.controls += 1
        reply({"ok": True})


@pytest.fixture
def store():
    store = Store()
    yield store
    store.server.close()


def ask(address, header, arrays=()):
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        send_header(sock, header, arrays)
        return recv_header(sock)


def test_a_put_and_a_get_with_the_token_go_through(store):
    datalink.put(store.server.address, TOKEN, "k", [PIECE])
    [(index, array)] = datalink.get(store.server.address, TOKEN, "k")
    assert index == PIECE[0]
    np.testing.assert_array_equal(array, PIECE[1])


@pytest.mark.parametrize("token", ["", "wrong", TOKEN[:-1], None])
@pytest.mark.parametrize("op", ["put", "get", "control"])
def test_every_request_without_the_token_is_refused_and_changes_nothing(store, op, token):
    datalink.put(store.server.address, TOKEN, "k", [PIECE])
    header = {"op": op, "key": "k", "pieces": [piece_meta(*PIECE)], "epoch": 1}
    if token is not None:
        header["token"] = token
    arrays = [PIECE[1] + 1] if op == "put" else []
    reply = ask(store.server.address, header, arrays)
    assert "wrong or missing token" in reply["error"]
    assert "pieces" not in reply
    assert store.controls == 0
    np.testing.assert_array_equal(store.stored["k"][0][1], PIECE[1])


def test_the_library_functions_raise_on_a_wrong_token(store):
    with pytest.raises(TransportError, match="wrong or missing token"):
        datalink.put(store.server.address, "wrong", "k", [PIECE])
    with pytest.raises(TransportError, match="wrong or missing token"):
        datalink.get(store.server.address, "wrong", "k")
    assert store.stored == {}


def test_a_header_longer_than_allowed_is_dropped_unread_and_the_port_serves_on(store):
    host, port = store.server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(LENGTH.pack(MAX_HEADER_BYTES + 1))
        assert sock.recv(1) == b""  # closed without an answer or an allocation
    datalink.put(store.server.address, TOKEN, "k", [PIECE])
    assert list(store.stored) == ["k"]


def test_a_data_server_without_a_token_cannot_be_made():
    with pytest.raises(ValueError, match="needs a token"):
        DataServer("127.0.0.1", "", lambda *a: None, lambda k: [], None)
