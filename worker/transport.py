"""Bulk array bytes between the controller and a worker over plain TCP.

Ray's object store would copy each piece into the sender's store, across to the
receiver's store, and out again; a socket per transfer moves the bytes once, straight
into the buffer that keeps them (`recv_into`). Each request is one connection: a
length-prefixed JSON header, then the raw bytes of every piece in order.

    put:  header {"op": "put", "key": K, "pieces": [meta...]} + bytes  ->  {"ok": true}
    get:  header {"op": "get", "key": K}  ->  {"pieces": [meta...]} + bytes  (or {"error"})
    control: header {"op": "control", ...}  ->  the connection becomes the worker's
             control channel (channel.py)

where meta is {"index": [[start, stop], ...], "shape": [...], "dtype": name}.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from controller.arrays import dtype_of
from controller.mesh import Index

log = logging.getLogger(__name__)

Pieces = list[tuple[Index, np.ndarray]]
_LENGTH = struct.Struct("!Q")
_TIMEOUT_S = 600.0


class TransportError(ConnectionError):
    """A transfer failed: the peer went away or answered with an error."""


def _meta(index: Index, array: np.ndarray) -> dict[str, Any]:
    return {"index": [[s.start, s.stop] for s in index], "shape": list(array.shape),
            "dtype": array.dtype.name}


def _send(sock: socket.socket, header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> None:
    encoded = json.dumps(header).encode()
    sock.sendall(_LENGTH.pack(len(encoded)) + encoded)
    for array in arrays:
        if array.nbytes:  # as raw bytes: bfloat16 & co. have no buffer-protocol format
            sock.sendall(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise TransportError("the peer closed the connection mid-transfer")
        view = view[n:]


def _recv_header(sock: socket.socket) -> dict[str, Any]:
    length = bytearray(_LENGTH.size)
    _recv_exact(sock, memoryview(length))
    body = bytearray(_LENGTH.unpack(length)[0])
    _recv_exact(sock, memoryview(body))
    return json.loads(body)


def _recv_pieces(sock: socket.socket, metas: list[dict[str, Any]]) -> Pieces:
    pieces = []
    for meta in metas:
        array = np.empty(meta["shape"], dtype=dtype_of(meta["dtype"]))
        if array.nbytes:
            _recv_exact(sock, memoryview(array.reshape(-1).view(np.uint8)))
        pieces.append((tuple(slice(a, b) for a, b in meta["index"]), array))
    return pieces


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)), timeout=_TIMEOUT_S)
    except OSError as exc:
        raise TransportError(f"cannot reach the worker's data port {address}: {exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def put(address: str, key: str, pieces: Pieces) -> None:
    """Sends pieces of an array to the worker at `address`, to be stored under `key`."""
    with _connect(address) as sock:
        try:
            _send(sock, {"op": "put", "key": key, "pieces": [_meta(i, a) for i, a in pieces]},
                  [a for _, a in pieces])
            reply = _recv_header(sock)
        except OSError as exc:
            raise TransportError(f"sending {key} to {address} failed: {exc}") from exc
    if "error" in reply:
        raise TransportError(reply["error"])


def get(address: str, key: str) -> Pieces:
    """Receives the pieces the worker at `address` holds under `key`."""
    with _connect(address) as sock:
        try:
            _send(sock, {"op": "get", "key": key})
            reply = _recv_header(sock)
            if "error" in reply:
                raise TransportError(reply["error"])
            return _recv_pieces(sock, reply["pieces"])
        except OSError as exc:
            raise TransportError(f"reading {key} from {address} failed: {exc}") from exc


class DataServer:
    """The worker's end: accepts puts into `on_put(key, pieces, started_us)`, serves gets
    from `on_get(key)`, and hands a control connection to `on_control(conn, hello,
    reply)` for as long as it lasts."""

    def __init__(self, host: str, on_put: Callable[[str, Pieces, int], None],
                 on_get: Callable[[str], Pieces],
                 on_control: Callable[[socket.socket, dict[str, Any],
                                       Callable[[dict[str, Any]], None]], None] | None = None
                 ) -> None:
        self._on_put = on_put
        self._on_get = on_get
        self._on_control = on_control
        self._sock = socket.create_server((host, 0), backlog=64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, name="data-server", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                header = _recv_header(conn)
                if header.get("op") == "put":
                    started_us = time.time_ns() // 1000
                    self._on_put(header["key"], _recv_pieces(conn, header["pieces"]), started_us)
                    _send(conn, {"ok": True})
                elif header.get("op") == "get":
                    try:
                        pieces = self._on_get(header["key"])
                    except Exception as exc:  # noqa: BLE001 - reported to the reader
                        _send(conn, {"error": f"{type(exc).__name__}: {exc}"})
                        return
                    _send(conn, {"pieces": [_meta(i, a) for i, a in pieces]},
                          [a for _, a in pieces])
                elif header.get("op") == "control" and self._on_control is not None:
                    self._on_control(conn, header, lambda reply: _send(conn, reply))
                else:
                    _send(conn, {"error": f"unknown request {header.get('op')!r}"})
            except (OSError, ValueError, KeyError) as exc:
                log.warning("data transfer failed: %s", exc)
