"""Framing for the two TCP links between the controller and a worker, shared by both
ends so that they cannot drift apart.

Both links prefix each message with its length (8 bytes, network order):

- the data link (worker/transport.py, controller/datalink.py) sends a JSON header, then
  the raw bytes of every array piece it describes;
- the control channel (worker/channel.py, controller/channel.py) sends a JSON hello, then
  frames of operations and completions in the msgpack codec of codec.py: plain data, with
  an explicit registry of the types that may travel, so that nothing a peer sends can
  make a receiver run code.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from slicewise.common import codec
from slicewise.common.arrays import dtype_of
from slicewise.common.mesh import Index

LENGTH = struct.Struct("!Q")

# The largest control frame a receiver accepts: room for a batch with a LoadOp of the
# largest program (limits.MAX_PROGRAM_BYTES, under 2 GiB) and then some, so that a
# corrupt length cannot make a worker allocate memory it does not have. A batch too
# large for one frame travels as several (controller/channel.py).
MAX_FRAME_BYTES = 2**32

# The largest data-link header: its piece list grows with the pieces of one array on one
# host, some hundred bytes each. It is read before the peer has shown its token, so it is
# kept small enough that a stranger cannot make a worker allocate much.
MAX_HEADER_BYTES = 16 * 2**20

# An array's pieces as one host holds them: (index into the global array, data).
Pieces = list[tuple[Index, np.ndarray]]

# Received pieces start at an address that is a multiple of this: XLA's CPU client then
# takes them as they are (jax.device_put aliases an aligned host buffer), where an
# unaligned one is copied (0.3 s for 128 MiB here; numpy aligns to 16 bytes only).
ALIGNMENT = 64


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
    size = LENGTH.unpack(length)[0]
    if size > MAX_HEADER_BYTES:
        raise TransportError(f"a header of {size} bytes is over the {MAX_HEADER_BYTES} allowed")
    body = bytearray(size)
    recv_into(sock, memoryview(body))
    header: dict[str, Any] = json.loads(body)
    return header


def recv_pieces(sock: socket.socket, metas: list[dict[str, Any]]) -> Pieces:
    """Receives the bytes of the pieces a header described, each into its own array."""
    pieces = []
    for meta in metas:
        array = aligned_empty(meta["shape"], dtype_of(meta["dtype"]))
        if array.nbytes:
            recv_into(sock, array.reshape(-1).view(np.uint8).data)
        pieces.append((tuple(slice(a, b) for a, b in meta["index"]), array))
    return pieces


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array whose data starts at a multiple of ALIGNMENT.

    Raises:
        ValueError: a negative dimension.
    """
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimensions are not allowed: {list(shape)}")
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


# -- the control channel ---------------------------------------------------------------


def frame(kind: str, payload: Any) -> bytes:
    """One control-channel message `(kind, payload)`, encoded and length-prefixed.

    Raises:
        ChannelError: the payload holds something that may not travel (a bug).
    """
    try:
        body = codec.encode(kind, payload)
    except codec.CodecError as exc:
        raise ChannelError(str(exc)) from None
    return LENGTH.pack(len(body)) + body


def frame_length(prefix: bytes | bytearray) -> int:
    """The length of the frame that `prefix` (LENGTH.size bytes) announces.

    Raises:
        ChannelError: it is longer than any control frame may be.
    """
    (length,) = LENGTH.unpack(prefix)
    if length > MAX_FRAME_BYTES:
        raise ChannelError(
            f"a control frame of {length} bytes announced, more than the {MAX_FRAME_BYTES} "
            "any may have: the peer is not speaking this protocol"
        )
    return int(length)


def unframe(body: bytes | bytearray, messages: codec.Messages) -> tuple[str, Any]:
    """The `(kind, payload)` of a frame's body, if it is a message in `messages`.

    Raises:
        ChannelError: it is not (the receiver should drop the connection).
    """
    try:
        return codec.decode(body, messages)
    except codec.CodecError as exc:
        raise ChannelError(f"malformed control frame: {exc}") from None


def hello(token: str, epoch: int) -> bytes:
    """The controller's first message on a control channel (JSON, before any frame)."""
    body = json.dumps({"op": "control", "token": token, "epoch": epoch}).encode()
    return LENGTH.pack(len(body)) + body
