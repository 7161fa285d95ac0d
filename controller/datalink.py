"""The controller's end of a worker's data link: uploads and downloads of array pieces,
one TCP connection per transfer (the worker's end is worker/transport.py)."""

from __future__ import annotations

import socket

from slicewise.common.framing import (
    Pieces,
    TransportError,
    piece_meta,
    recv_header,
    recv_pieces,
    send_header,
)

_TIMEOUT_S = 600.0


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)), timeout=_TIMEOUT_S)
    except OSError as exc:
        raise TransportError(f"cannot reach the worker's data port {address}: {exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def put(address: str, token: str, key: str, pieces: Pieces) -> None:
    """Sends pieces of an array to the worker at `address`, to be stored under `key`;
    `token` is the gang's secret, which the worker checks first."""
    with _connect(address) as sock:
        try:
            send_header(
                sock,
                {
                    "op": "put",
                    "token": token,
                    "key": key,
                    "pieces": [piece_meta(i, a) for i, a in pieces],
                },
                [a for _, a in pieces],
            )
            reply = recv_header(sock)
        except OSError as exc:
            raise TransportError(f"sending {key} to {address} failed: {exc}") from exc
    if "error" in reply:
        raise TransportError(reply["error"])


def get(address: str, token: str, key: str) -> Pieces:
    """Receives the pieces the worker at `address` holds under `key`."""
    with _connect(address) as sock:
        try:
            send_header(sock, {"op": "get", "token": token, "key": key})
            reply = recv_header(sock)
            if "error" in reply:
                raise TransportError(reply["error"])
            return recv_pieces(sock, reply["pieces"])
        except OSError as exc:
            raise TransportError(f"reading {key} from {address} failed: {exc}") from exc


def drop(address: str, token: str, key: str, expires_unix_s: int) -> None:
    """Has the worker at `address` drop the pieces of an abandoned direct put under `key`,
    also any that arrive later with its capability (valid until `expires_unix_s`)."""
    with _connect(address) as sock:
        try:
            send_header(sock, {"op": "drop", "token": token, "key": key, "expires": expires_unix_s})
            reply = recv_header(sock)
        except OSError as exc:
            raise TransportError(f"dropping {key} at {address} failed: {exc}") from exc
    if "error" in reply:
        raise TransportError(reply["error"])
