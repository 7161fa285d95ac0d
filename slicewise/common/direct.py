"""The client's end of a direct transfer: array pieces straight between the client and
each host's data port (worker/transport.py), one connection and one thread per host,
authorized by a capability the controller issued for this one transfer
(slicewise/common/capability.py). The controller only validates, authorizes and queues:
no byte of the array passes through it.

A put sends each host the pieces the controller listed for it, cut from the caller's
array without a copy where the piece is contiguous; a fetch receives every piece straight
into its place in one preallocated output array where that place is contiguous (a piece
split along the leading axes), else through a buffer of the piece's size.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from slicewise.common.framing import (
    TransportError,
    piece_meta,
    recv_header,
    recv_into,
    send_header,
)
from slicewise.common.mesh import Index

CONNECT_TIMEOUT_S = 10.0
# A transfer's connection waits this long for the peer to go on; the capability's
# deadline bounds the whole transfer anyway.
IO_TIMEOUT_S = 600.0


class UnreachableError(TransportError):
    """The client cannot connect to a host's data port (another network, say): the
    caller falls back to the path through the controller."""


@dataclass(frozen=True)
class HostPart:
    """One host's part in a transfer: its data port, the capability, and (a put's) the
    pieces it receives."""

    address: str
    capability: str
    pieces: tuple[Index, ...] = ()


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        raise UnreachableError(f"cannot reach the data port {address}: {exc}") from exc
    sock.settimeout(IO_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _on_every_host(work: Any, hosts: Sequence[HostPart]) -> list[Any]:
    """`work(host)` for every host at once, one thread each; raises the first error
    (an unreachable host's first, so that the caller can fall back)."""
    if len(hosts) == 1:
        return [work(hosts[0])]
    with ThreadPoolExecutor(len(hosts), thread_name_prefix="direct") as pool:
        futures = [pool.submit(work, h) for h in hosts]
        errors = [f.exception() for f in futures]
    unreachable = [e for e in errors if isinstance(e, UnreachableError)]
    first = unreachable[0] if unreachable else next((e for e in errors if e), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]


def put(key: str, array: np.ndarray, hosts: Sequence[HostPart]) -> None:
    """Sends every host its pieces of `array` (C-ordered) under `key`.

    Raises:
        UnreachableError: a host's data port does not answer a connection.
        TransportError: a host refused the pieces or the connection broke.
    """

    def send(host: HostPart) -> None:
        pieces = [array[index] for index in host.pieces]
        with _connect(host.address) as sock:
            try:
                header = {
                    "op": "put",
                    "capability": host.capability,
                    "key": key,
                    "pieces": [piece_meta(i, a) for i, a in zip(host.pieces, pieces, strict=True)],
                }
                send_header(sock, header, pieces)
                reply = recv_header(sock)
            except TransportError:
                raise
            except OSError as exc:
                raise TransportError(f"sending {key} to {host.address} failed: {exc}") from exc
        if "error" in reply:
            raise TransportError(f"{host.address}: {reply['error']}")

    _on_every_host(send, hosts)


def fetch_into(key: str, out: np.ndarray, hosts: Sequence[HostPart]) -> None:
    """Fills `out` (C-ordered) with every host's pieces of the array pinned as `key`.

    Raises:
        UnreachableError: a host's data port does not answer a connection.
        TransportError: a host refused, the connection broke, or the pieces do not fit
            `out` or do not cover it.
    """

    def read(host: HostPart) -> int:
        with _connect(host.address) as sock:
            try:
                send_header(sock, {"op": "get", "capability": host.capability, "key": key})
                reply = recv_header(sock)
                if "error" in reply:
                    raise TransportError(f"{host.address}: {reply['error']}")
                covered = 0
                for meta in reply["pieces"]:
                    place = destination(out, meta)
                    if not place.size:
                        continue
                    if place.flags.c_contiguous:
                        recv_into(sock, _bytes(place))
                    else:  # a piece of a split along a later axis: through a buffer
                        piece = np.empty(place.shape, out.dtype)
                        recv_into(sock, _bytes(piece))
                        place[...] = piece
                    covered += place.size
                return covered
            except TransportError:
                raise
            except OSError as exc:
                raise TransportError(f"reading {key} from {host.address} failed: {exc}") from exc

    covered = sum(_on_every_host(read, hosts))
    if covered != out.size:
        raise TransportError(
            f"the hosts sent {covered} of {out.size} elements of the array; they disagree "
            "on its sharding"
        )


def destination(out: np.ndarray, meta: Any) -> np.ndarray:
    """The view of `out` that a piece a host announced fills (contiguous, so that the
    bytes can go straight into it, unless the piece is of a split along a later axis).

    Raises:
        TransportError: the piece does not fit `out` (its place, shape or dtype).
    """
    try:
        bounds = [(int(a), int(b)) for a, b in meta["index"]]
        shape = [int(n) for n in meta["shape"]]
        dtype = str(meta["dtype"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TransportError(f"a host described a piece wrongly ({meta!r}): {exc}") from None
    fits = (
        len(bounds) == out.ndim
        and all(0 <= a <= b <= n for (a, b), n in zip(bounds, out.shape, strict=False))
        and shape == [b - a for a, b in bounds]
        and dtype == out.dtype.name
    )
    if not fits:
        raise TransportError(
            f"a host sent a piece {meta!r} that does not fit a {out.dtype.name} array of "
            f"shape {list(out.shape)}"
        )
    # With the Ellipsis, a 0-d array's place is a 0-d view, not a scalar.
    index: tuple[Any, ...] = (*(slice(a, b) for a, b in bounds), Ellipsis)
    place: np.ndarray = out[index]
    return place


def _bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as bytes (bfloat16 & co. have no buffer format)."""
    return array.reshape(-1).view(np.uint8).data
