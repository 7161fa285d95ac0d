"""The controller's end of a worker's control channel (asyncio): operation batches out,
completions back. The protocol, and the worker's end, are described in worker/channel.py;
frames are msgpack of plain data (slicewise/common/codec.py), and a frame that is not a
message a worker may send ends the channel with a ChannelError.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import Any

from slicewise.common.codec import TO_CONTROLLER
from slicewise.common.framing import (
    LENGTH,
    MAX_FRAME_BYTES,
    ChannelError,
    frame,
    frame_length,
    hello,
    unframe,
)
from slicewise.common.ops import Op, OpResult


class ControllerEnd:
    """The controller's end (asyncio): `send` operation batches, `receive` completions."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._name = name
        # Liveness, for controller/health.py: when anything last came from the worker
        # (time.monotonic), and the progress its latest heartbeat reported.
        self.heard_at = time.monotonic()
        self.progress: dict[str, Any] = {}

    @classmethod
    async def connect(cls, address: str, token: str, epoch: int, name: str) -> ControllerEnd:
        """Opens the channel to the worker at `address` (`name` says which, in errors).

        Raises:
            ChannelError: the worker cannot be reached or refused the connection.
        """
        host, port = address.rsplit(":", 1)
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as exc:
            raise ChannelError(f"cannot reach {name} at {address}: {exc}") from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(hello(token, epoch))
        channel = cls(reader, writer, name)
        kind, payload = await channel._read()
        if kind != "ready":
            channel.close()
            raise ChannelError(f"{name} refused the control channel: {payload}")
        return channel

    async def send(self, ops: list[Op]) -> None:
        """Sends a batch; returns once it is on its way (TCP keeps the order)."""
        self.write(ops, encode_batch(ops))
        await self.drain()

    def write(self, ops: list[Op], frames: list[bytes]) -> None:
        """Queues a batch already encoded as `frames` (`encode_batch(ops)`: one encoding
        may go to every worker of a gang); `drain` waits until it is on its way."""
        try:
            for data in frames:
                self._writer.write(data)
        except (OSError, RuntimeError) as exc:
            raise ChannelError(f"sending to {self._name} failed: {exc}") from exc

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except (OSError, RuntimeError) as exc:
            raise ChannelError(f"sending to {self._name} failed: {exc}") from exc

    async def receive(self) -> list[OpResult]:
        """The next completions, in the order they completed (not sequence order: an
        upload completes at once while earlier programs may still run).

        Raises:
            ChannelError: the worker went away, or refused a batch.
        """
        while True:
            kind, payload = await self._read()
            if kind == "beat":
                self.progress = payload
                continue
            if kind == "done":
                return payload
            raise ChannelError(f"{self._name} refused operations: {payload}")

    async def _read(self) -> tuple[str, Any]:
        try:
            length = frame_length(await self._reader.readexactly(LENGTH.size))
            body = await self._reader.readexactly(length)
        except ChannelError as exc:
            raise ChannelError(f"{self._name} sent a bad frame: {exc}") from exc
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise ChannelError(
                f"{self._name} closed its control channel (the worker process died or was killed)"
            ) from exc
        self.heard_at = time.monotonic()
        try:
            if body[:1] == b"{":  # a JSON refusal of the hello
                return "error", str(json.loads(body).get("error", "refused"))
            return unframe(body, TO_CONTROLLER)
        except (ChannelError, ValueError, AttributeError) as exc:
            raise ChannelError(f"{self._name} sent a bad frame: {exc}") from exc

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()


def encode_batch(ops: list[Op]) -> list[bytes]:
    """The batch as one frame, or, in the rare batch of several large programs, as
    many as it takes to keep each under MAX_FRAME_BYTES (TCP keeps them in order)."""
    data = frame("submit", ops)
    if len(data) - LENGTH.size <= MAX_FRAME_BYTES or len(ops) == 1:
        return [data]
    half = len(ops) // 2
    return encode_batch(ops[:half]) + encode_batch(ops[half:])
