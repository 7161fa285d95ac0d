"""The worker's data port over real loopback sockets: puts and gets only for a peer that
shows the gang's token (or a capability for exactly that put or get), headers of bounded
size, and the port still serving after a stranger tried."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from controller import datalink
from slicewise.common import capability
from slicewise.common.framing import (
    ALIGNMENT,
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
        self.server = DataServer(
            "127.0.0.1", TOKEN, self.put, self.get, self.control, on_drop=self.drop
        )
        self.controls = 0
        self.expires = {}
        self.dropped = []
        self.refuse = ""

    def put(self, key, pieces, started_us, expires):
        if self.refuse:
            raise KeyError(self.refuse)
        self.stored[key] = pieces
        self.expires[key] = expires

    def drop(self, key, expires):
        self.dropped.append((key, expires))

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


# -- capabilities: a client's direct put or get -------------------------------------------


@pytest.fixture
def later():
    """A deadline ten minutes from when the test runs (not from when it was collected: in
    a 20-minute suite a module-level deadline had passed by the time its tests ran)."""
    return int(time.time()) + 600


def test_a_get_capability_reads_its_key_once_and_nothing_else(store, later):
    datalink.put(store.server.address, TOKEN, "a", [PIECE])
    datalink.put(store.server.address, TOKEN, "b", [PIECE])
    shown = capability.issue(TOKEN, "get", "a", later)
    for header in (
        {"op": "get", "capability": shown, "key": "b"},  # another key
        {"op": "put", "capability": shown, "key": "a", "pieces": [piece_meta(*PIECE)]},
        {"op": "control", "capability": shown, "key": "a", "epoch": 1},
        {"op": "drop", "capability": shown, "key": "a", "expires": later},
    ):
        arrays = [PIECE[1] + 1] if header["op"] == "put" else []
        reply = ask(store.server.address, header, arrays)
        assert "wrong capability" in reply["error"], header
        assert "pieces" not in reply
    assert store.controls == 0
    np.testing.assert_array_equal(store.stored["a"][0][1], PIECE[1])
    reply = ask(store.server.address, {"op": "get", "capability": shown, "key": "a"})
    assert reply["pieces"] == [piece_meta(*PIECE)]


def test_a_put_capability_stages_exactly_its_bytes_with_its_deadline(store, later):
    nbytes = PIECE[1].nbytes
    shown = capability.issue(TOKEN, "put", "k", later, nbytes)
    bigger = (PIECE[0], np.zeros((2, 4), np.float32))
    reply = ask(
        store.server.address,
        {"op": "put", "capability": shown, "key": "k", "pieces": [piece_meta(*bigger)]},
        [bigger[1]],
    )
    assert "not of the 24 bytes" in reply["error"]
    assert store.stored == {}
    header = {"op": "put", "capability": shown, "key": "k", "pieces": [piece_meta(*PIECE)]}
    assert ask(store.server.address, header, [PIECE[1]]) == {"ok": True}
    assert store.expires["k"] == later
    np.testing.assert_array_equal(store.stored["k"][0][1], PIECE[1])
    # The controller's own puts carry no deadline.
    datalink.put(store.server.address, TOKEN, "c", [PIECE])
    assert store.expires["c"] == 0


def test_an_expired_or_foreign_capability_is_refused(store, later):
    expired = capability.issue(TOKEN, "get", "k", int(time.time()) - 1)
    foreign = capability.issue("another gang's token", "get", "k", later)
    datalink.put(store.server.address, TOKEN, "k", [PIECE])
    for shown in (expired, foreign, "", None, 7):
        reply = ask(store.server.address, {"op": "get", "capability": shown, "key": "k"})
        assert "wrong capability" in reply["error"] or "wrong or missing token" in reply["error"]


def test_a_refused_put_is_answered_with_its_reason(store, later):
    store.refuse = "the direct put k has ended"
    shown = capability.issue(TOKEN, "put", "k", later, PIECE[1].nbytes)
    header = {"op": "put", "capability": shown, "key": "k", "pieces": [piece_meta(*PIECE)]}
    reply = ask(store.server.address, header, [PIECE[1]])
    assert "has ended" in reply["error"]


def test_only_the_controller_may_drop_staged_pieces(store, later):
    datalink.drop(store.server.address, TOKEN, "k", later)
    assert store.dropped == [("k", later)]
    with pytest.raises(TransportError, match="wrong or missing token"):
        datalink.drop(store.server.address, "wrong", "k", later)
    assert store.dropped == [("k", later)]


def test_received_pieces_are_aligned_for_xla_to_take_without_a_copy(store):
    odd = ((slice(0, 3),), np.arange(3, dtype=np.int8))
    datalink.put(store.server.address, TOKEN, "k", [odd, PIECE, odd])
    for (_, sent), (_, got) in zip([odd, PIECE, odd], store.stored["k"], strict=True):
        assert got.ctypes.data % ALIGNMENT == 0
        np.testing.assert_array_equal(got, sent)
