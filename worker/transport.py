"""Bulk array bytes between the controller and a worker over plain TCP.

Ray's object store would copy each piece into the sender's store, across to the
receiver's store, and out again; a socket per transfer moves the bytes once, straight
into the buffer that keeps them (`recv_into`). Each request is one connection: a
length-prefixed JSON header, then the raw bytes of every piece in order.

    put:  header {"op": "put", "token": T, "key": K, "pieces": [meta...]} + bytes
          ->  {"ok": true}
    get:  header {"op": "get", "token": T, "key": K}  ->  {"pieces": [meta...]} + bytes
    drop: header {"op": "drop", "token": T, "key": K, "expires": E}  ->  {"ok": true}: the
          pieces of an abandoned direct put are dropped, also if they arrive later
    control: header {"op": "control", "token": T, ...}  ->  the connection becomes the
             worker's control channel (channel.py)

Every request carries the gang's secret token (the controller made it and Ray handed it
to the worker), or, for a client's direct put or get, a "capability" instead: the
controller's signed permission for that one op on that one key until a deadline (and, for
a put, for exactly so many bytes; see slicewise/common/capability.py). A request with
neither is answered {"error": ...} before anything else is read, and the listener binds
only to the address Ray uses on this host.

where meta is {"index": [[start, stop], ...], "shape": [...], "dtype": name}.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from slicewise.common import capability
from slicewise.common.arrays import dtype_of
from slicewise.common.errors import SlicewiseError
from slicewise.common.framing import Pieces, piece_meta, recv_header, recv_pieces, send_header

log = logging.getLogger(__name__)


class DataServer:
    """The worker's end: accepts puts into `on_put(key, pieces, started_us, expires)`
    (`expires`: the deadline of the capability a client's direct put showed, 0 for the
    controller's), serves gets from `on_get(key)`, and hands a control connection to
    `on_control(conn, hello, reply)` for as long as it lasts, and drops an abandoned
    direct put's pieces with `on_drop(key, expires)`; only for peers that show `token`,
    or (a put or get) a capability signed with it for the op and key they ask for."""

    # How long a new connection may take to send its header: a peer that connects and
    # says nothing does not hold a thread for longer.
    HEADER_TIMEOUT_S = 60.0

    def __init__(
        self,
        host: str,
        token: str,
        on_put: Callable[[str, Pieces, int, int], None],
        on_get: Callable[[str], Pieces],
        on_control: Callable[
            [socket.socket, dict[str, Any], Callable[[dict[str, Any]], None]], None
        ]
        | None = None,
        *,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        if not token:
            raise ValueError("a data server needs a token")
        self._token = token
        self._on_put = on_put
        self._on_get = on_get
        self._on_control = on_control
        self._on_drop = on_drop
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
            threading.Thread(
                target=self._serve, args=(conn,), name="data-connection", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn.settimeout(self.HEADER_TIMEOUT_S)
                header = recv_header(conn)
                conn.settimeout(None)
                error, expires = self._authorize(header)
                if error:
                    send_header(conn, {"error": error})
                    return
                if header.get("op") == "put":
                    started_us = time.time_ns() // 1000
                    pieces = recv_pieces(conn, header["pieces"])
                    try:
                        self._on_put(header["key"], pieces, started_us, expires)
                    except Exception as exc:  # noqa: BLE001 - reported to the sender
                        send_header(conn, {"error": f"{type(exc).__name__}: {exc}"})
                        return
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
                elif header.get("op") == "drop" and self._on_drop is not None:
                    self._on_drop(str(header["key"]), int(header["expires"]))
                    send_header(conn, {"ok": True})
                elif header.get("op") == "control" and self._on_control is not None:
                    self._on_control(conn, header, lambda reply: send_header(conn, reply))
                else:
                    send_header(conn, {"error": f"unknown request {header.get('op')!r}"})
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("data transfer failed: %s", exc)

    def _authorize(self, header: dict[str, Any]) -> tuple[str, int]:
        """(why the request may not go ahead or "", the deadline of the capability it
        showed or 0 for the token): it must show the gang's token, or a capability for
        its op, key and byte count."""
        token = header.get("token")
        if token is not None or "capability" not in header:
            if hmac.compare_digest(str(token or "").encode(), self._token.encode()):
                return "", 0
            return (
                "wrong or missing token: only this gang's controller (or a client with its "
                "capability for one put or get) may connect to this worker"
            ), 0
        shown, op, key = header["capability"], header.get("op"), header.get("key")
        if not isinstance(shown, str) or op not in capability.OPS or not isinstance(key, str):
            return f"wrong capability: a capability is for one put or get, not {op!r}", 0
        try:
            grant = capability.check(self._token, shown, op, key, time.time())
        except capability.CapabilityError as exc:
            return f"wrong capability: {exc}", 0
        if op == "put" and _nbytes(header.get("pieces")) != grant.nbytes:
            return (
                f"wrong capability: the put of {key!r} is not of the {grant.nbytes} bytes "
                "its capability allows"
            ), 0
        return "", grant.expires_unix_s


def _nbytes(metas: Any) -> int:
    """The bytes of the pieces a put header describes (-1 if it describes them wrong)."""
    if not isinstance(metas, list):
        return -1
    total = 0
    try:
        for m in metas:
            shape = [int(n) for n in m["shape"]]
            if any(n < 0 for n in shape):
                return -1
            total += math.prod(shape) * dtype_of(str(m["dtype"])).itemsize
    except (KeyError, TypeError, ValueError, SlicewiseError):
        return -1
    return total
