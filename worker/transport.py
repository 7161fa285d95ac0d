"""Bulk array bytes between the controller and a worker over plain TCP.

Ray's object store would copy each piece into the sender's store, across to the
receiver's store, and out again; a socket per transfer moves the bytes once, straight
into the buffer that keeps them (`recv_into`). Each request is one connection: a
length-prefixed JSON header, then the raw bytes of every piece in order.

    put:  header {"op": "put", "token": T, "key": K, "pieces": [meta...]} + bytes
          ->  {"ok": true}
    get:  header {"op": "get", "token": T, "key": K}  ->  {"pieces": [meta...]} + bytes
    control: header {"op": "control", "token": T, ...}  ->  the connection becomes the
             worker's control channel (channel.py)

Every request carries the gang's secret token (the controller made it and Ray handed it
to the worker); a request without it is answered {"error": ...} before anything else is
read, and the listener binds only to the address Ray uses on this host.

where meta is {"index": [[start, stop], ...], "shape": [...], "dtype": name}.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from slicewise.common.framing import Pieces, piece_meta, recv_header, recv_pieces, send_header

log = logging.getLogger(__name__)


class DataServer:
    """The worker's end: accepts puts into `on_put(key, pieces, started_us)`, serves gets
    from `on_get(key)`, and hands a control connection to `on_control(conn, hello,
    reply)` for as long as it lasts; only for peers that show `token`."""

    # How long a new connection may take to send its header: a peer that connects and
    # says nothing does not hold a thread for longer.
    HEADER_TIMEOUT_S = 60.0

    def __init__(
        self,
        host: str,
        token: str,
        on_put: Callable[[str, Pieces, int], None],
        on_get: Callable[[str], Pieces],
        on_control: Callable[
            [socket.socket, dict[str, Any], Callable[[dict[str, Any]], None]], None
        ]
        | None = None,
    ) -> None:
        if not token:
            raise ValueError("a data server needs a token")
        self._token = token.encode()
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
                conn.settimeout(self.HEADER_TIMEOUT_S)
                header = recv_header(conn)
                conn.settimeout(None)
                if not hmac.compare_digest(str(header.get("token", "")).encode(), self._token):
                    send_header(
                        conn,
                        {
                            "error": "wrong or missing token: only this gang's controller "
                            "may connect to this worker"
                        },
                    )
                    return
                if header.get("op") == "put":
                    started_us = time.time_ns() // 1000
                    self._on_put(header["key"], recv_pieces(conn, header["pieces"]), started_us)
                    send_header(conn, {"ok": True})
                elif header.get("op") == "get":
                    try:
                        pieces = self._on_get(header["key"])
                    except Exception as exc:  # noqa: BLE001 - reported to the reader
                        send_header(conn, {"error": f"{type(exc).__name__}: {exc}"})
                        return
                    send_header(
                        conn,
                        {"pieces": [piece_meta(i, a) for i, a in pieces]},
                        [a for _, a in pieces],
                    )
                elif header.get("op") == "control" and self._on_control is not None:
                    self._on_control(conn, header, lambda reply: send_header(conn, reply))
                else:
                    send_header(conn, {"error": f"unknown request {header.get('op')!r}"})
            except (OSError, ValueError, KeyError) as exc:
                log.warning("data transfer failed: %s", exc)
