"""Framing for the two TCP links between the controller and a worker, shared by both
ends so that they cannot drift apart.

Both links prefix each message with its length (8 bytes, network order):

- the data link (worker/transport.py, controller/datalink.py) sends a JSON header, then
  the raw bytes of every array piece it describes;
- the control channel (worker/channel.py, controller/channel.py) sends pickled frames of
  operations and completions, after a JSON hello.
"""

from __future__ import annotations

import json
import pickle
import socket
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from slicewise.common.arrays import dtype_of
from slicewise.common.mesh import Index

LENGTH = struct.Struct("!Q")

# An array's pieces as one host holds them: (index into the global array, data).
Pieces = list[tuple[Index, np.ndarray]]


class TransportError(ConnectionError):
    """A transfer failed: the peer went away or answered with an error."""


class ChannelError(ConnectionError):
    """The control channel broke: the worker went away, or refused what it was sent."""


# -- the data link ---------------------------------------------------------------------


def piece_meta(index: Index, array: np.ndarray) -> dict[str, Any]:
    """What a header says of one piece: where it sits, its shape and its dtype."""
    return {
        "index": [[s.start, s.stop] for s in index],
        "shape": list(array.shape),
        "dtype": array.dtype.name,
    }


def send_header(
    sock: socket.socket, header: dict[str, Any], arrays: Sequence[np.ndarray] = ()
) -> None:
    """Sends a JSON header, then the raw bytes of `arrays` in order."""
    encoded = json.dumps(header).encode()
    sock.sendall(LENGTH.pack(len(encoded)) + encoded)
    for array in arrays:
        if array.nbytes:  # as raw bytes: bfloat16 & co. have no buffer-protocol format
            sock.sendall(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from the socket.

    Raises:
        TransportError: the peer closed the connection first.
    """
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise TransportError("the peer closed the connection mid-transfer")
        view = view[n:]


def recv_header(sock: socket.socket) -> dict[str, Any]:
    length = bytearray(LENGTH.size)
    recv_into(sock, memoryview(length))
    body = bytearray(LENGTH.unpack(length)[0])
    recv_into(sock, memoryview(body))
    header: dict[str, Any] = json.loads(body)
    return header


def recv_pieces(sock: socket.socket, metas: list[dict[str, Any]]) -> Pieces:
    """Receives the bytes of the pieces a header described, each into its own array."""
    pieces = []
    for meta in metas:
        array = np.empty(meta["shape"], dtype=dtype_of(meta["dtype"]))
        if array.nbytes:
            recv_into(sock, array.reshape(-1).view(np.uint8).data)
        pieces.append((tuple(slice(a, b) for a, b in meta["index"]), array))
    return pieces


# -- the control channel ---------------------------------------------------------------


def frame(message: Any) -> bytes:
    """One control-channel message, pickled and length-prefixed."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(body)) + body


def hello(token: str, epoch: int) -> bytes:
    """The controller's first message on a control channel (JSON, before any pickle)."""
    body = json.dumps({"op": "control", "token": token, "epoch": epoch}).encode()
    return LENGTH.pack(len(body)) + body
