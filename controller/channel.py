"""The controller's end of a worker's control channel (asyncio): operation batches out,
completions back. The protocol, and the worker's end, are described in worker/channel.py;
frames are msgpack of plain data (slicewise/common/codec.py), and a frame that is not a
message a worker may send ends the channel with a ChannelError.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

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
from slicewise.common.ops import Completions, Op, OpResult

log = logging.getLogger(__name__)


# Told about each frame of completions as it arrives (in the order they completed, which
# need not be sequence order), on the event loop's thread.
OnResults = Callable[[Completions], None]
# Told once, when the channel fails (the worker went away, refused a batch, or sent
# something that is not a message).
OnError = Callable[[ChannelError], None]


class ControllerEnd(asyncio.Protocol):
    """The controller's end (asyncio): `send` operation batches; completions are handed
    to the `listen`er as their frames arrive, or taken with `receive`.

    A protocol rather than a stream reader: each frame is parsed and its completions
    handed on in the callback that read its bytes. Through a StreamReader every frame
    also cost a wake-up of the reading task, a second turn of the event loop; on the
    2-core simulation an asyncio wake-up after a sleep costs about 120-400 us of CPU
    through a stream reader and 100-290 us through a protocol (`bench dispatch` prints
    them: benchmarks/wakeups.py).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._listener: tuple[OnResults, OnError] | None = None
        # Messages nobody listens for yet (the hello's answer, or completions before
        # `listen`, or for `receive`), and the future a `receive` waits on.
        self._inbox: deque[tuple[str, Any] | ChannelError] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._failed: ChannelError | None = None
        self._paused: asyncio.Future[None] | None = None  # while the socket is full
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
        loop = asyncio.get_running_loop()
        try:
            transport, channel = await loop.create_connection(lambda: cls(name), host, int(port))
        except OSError as exc:
            raise ChannelError(f"cannot reach {name} at {address}: {exc}") from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.write(hello(token, epoch))
        try:
            kind, payload = await channel._next()
        except ChannelError:
            channel.close()
            raise
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
        if self._failed is not None or self._transport is None or self._transport.is_closing():
            raise ChannelError(f"sending to {self._name} failed: {self._why_closed()}")
        for data in frames:
            self._transport.write(data)

    def hurry(self, seq: int) -> None:
        """Asks the worker to send operation `seq`'s completion as soon as it is made
        (somebody waits for it); nothing if the channel is closed."""
        transport = self._transport
        if self._failed is None and transport is not None and not transport.is_closing():
            transport.write(frame("hurry", seq))

    async def drain(self) -> None:
        if self._paused is not None:
            await asyncio.shield(self._paused)
        if self._failed is not None:
            raise ChannelError(f"sending to {self._name} failed: {self._why_closed()}")

    def listen(self, on_results: OnResults, on_error: OnError) -> None:
        """Hands every frame of completions to `on_results` as it arrives (those that
        came before, at once), and the channel's failure to `on_error`, once."""
        self._listener = (on_results, on_error)
        while self._inbox and self._listener is not None:
            self._deliver(self._inbox.popleft())
        if self._failed is not None and self._listener is not None:  # failed, and told
            self._listener = None  # to someone else before (or closed): told again
            asyncio.get_running_loop().call_soon(on_error, self._failed)

    async def receive(self) -> list[OpResult]:
        """The next completions, in the order they completed (not sequence order: an
        upload completes at once while earlier programs may still run); for a channel
        nobody `listen`s to.

        Raises:
            ChannelError: the worker went away, or refused a batch.
        """
        kind, payload = await self._next()
        if kind != "done":
            raise ChannelError(f"{self._name} refused operations: {payload}")
        return cast(Completions, payload).results()

    async def _next(self) -> tuple[str, Any]:
        while not self._inbox:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self._inbox.popleft()
        if isinstance(message, ChannelError):
            self._inbox.appendleft(message)  # every later receive says so too
            raise message
        return message

    def close(self) -> None:
        """Closes the channel; a listener hears nothing more (closing is no failure)."""
        self._listener = None
        self._fail(ChannelError(f"the control channel to {self._name} was closed"))

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.heard_at = time.monotonic()
        buffer = self._buffer
        buffer += data
        used = 0
        try:
            while self._failed is None and len(buffer) - used >= LENGTH.size:
                length = frame_length(buffer[used : used + LENGTH.size])
                if len(buffer) - used - LENGTH.size < length:
                    break
                body = buffer[used + LENGTH.size : used + LENGTH.size + length]
                used += LENGTH.size + length
                self._message(body)
        except ChannelError as exc:
            self._fail(ChannelError(f"{self._name} sent a bad frame: {exc}"))
        finally:
            del buffer[:used]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(self._lost())
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)

    def pause_writing(self) -> None:
        if self._paused is None:
            self._paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        paused, self._paused = self._paused, None
        if paused is not None and not paused.done():
            paused.set_result(None)

    def _message(self, body: bytearray) -> None:
        """Handles one frame's body.

        Raises:
            ChannelError: it is not a message a worker may send.
        """
        try:
            if body[:1] == b"{":  # a JSON refusal of the hello
                message: tuple[str, Any] = (
                    "error",
                    str(json.loads(body).get("error", "refused")),
                )
            else:
                message = unframe(body, TO_CONTROLLER)
        except (ValueError, AttributeError) as exc:
            raise ChannelError(str(exc)) from exc
        if message[0] == "beat":
            self.progress = message[1]
        elif self._listener is not None:
            self._deliver(message)
        else:
            self._queue(message)

    def _deliver(self, message: tuple[str, Any] | ChannelError) -> None:
        """Hands a message to the listener: completions, or the channel's failure."""
        assert self._listener is not None
        on_results, on_error = self._listener
        if isinstance(message, tuple) and message[0] == "done":
            try:
                on_results(message[1])
            except Exception as exc:  # a bug: fail the channel, loudly, not the loop
                log.exception("handling completions from %s failed", self._name)
                self._fail(ChannelError(f"handling completions from {self._name} failed: {exc}"))
            return
        if not isinstance(message, ChannelError):
            message = ChannelError(f"{self._name} refused operations: {message[1]}")
            self._fail(message)
            return
        self._listener = None  # told once
        on_error(message)

    def _lost(self) -> ChannelError:
        return ChannelError(
            f"{self._name} closed its control channel (the worker process died or was killed)"
        )

    def _why_closed(self) -> ChannelError | str:
        """Why nothing can be sent: the channel's failure, if it failed; else a transport
        closing under us is the worker's end gone (asyncio calls `connection_lost` a
        moment later), which a send may notice first."""
        if self._failed is not None:
            return self._failed
        if self._transport is None:
            return "the channel is not open"
        return self._lost()

    def _fail(self, error: ChannelError) -> None:
        if self._failed is not None:
            return
        self._failed = error
        if self._transport is not None:
            self._transport.close()
        if self._listener is not None:
            self._deliver(error)
        else:
            self._queue(error)

    def _queue(self, message: tuple[str, Any] | ChannelError) -> None:
        self._inbox.append(message)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def encode_batch(ops: list[Op]) -> list[bytes]:
    """The batch as one frame, or, in the rare batch of several large programs, as
    many as it takes to keep each under MAX_FRAME_BYTES (TCP keeps them in order)."""
    data = frame("submit", ops)
    if len(data) - LENGTH.size <= MAX_FRAME_BYTES or len(ops) == 1:
        return [data]
    half = len(ops) // 2
    return encode_batch(ops[:half]) + encode_batch(ops[half:])
