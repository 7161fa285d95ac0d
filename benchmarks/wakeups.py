"""What it costs a process to wake up for one small message after a sleep, by how it
waits: a blocking `recv`, a bare `epoll` loop, an asyncio protocol (the controller's
control channels), and an asyncio stream reader.

Every completion frame a worker sends wakes the controller's event loop; on the 2-core
simulation that wake-up is a large part of what a call costs the controller once calls
are longer than the gap between frames, and so of the break-even (`bench dispatch`).
Each figure is the receiver's own CPU (its process time) divided by the messages it got,
from a sender process that sleeps `period` between 16-byte messages over a socket pair.

    python -m benchmarks.wakeups            # every way, at 2 and 10 ms
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import socket
import subprocess
import sys
import time

WAYS = ("blocking recv", "epoll", "asyncio protocol", "asyncio stream")
PERIODS_S = (0.002, 0.01)
MESSAGES = 200
MESSAGE = b"x" * 16


def _receive_blocking(sock: socket.socket, count: int) -> None:
    got = 0
    while got < count:
        data = sock.recv(4096)
        if not data:
            return
        got += len(data) // len(MESSAGE)


def _receive_epoll(sock: socket.socket, count: int) -> None:
    sock.setblocking(False)
    poller = select.epoll()
    poller.register(sock.fileno(), select.EPOLLIN)
    got = 0
    while got < count:
        for _ in poller.poll(-1):
            data = sock.recv(4096)
            if not data:
                return
            got += len(data) // len(MESSAGE)


class _Counter(asyncio.Protocol):
    def __init__(self, count: int, done: asyncio.Future[None]) -> None:
        self.left, self.done = count, done

    def data_received(self, data: bytes) -> None:
        self.left -= len(data) // len(MESSAGE)
        if self.left <= 0 and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _receive_protocol(sock: socket.socket, count: int) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _Counter(count, done), sock=sock)
    await done
    transport.close()


async def _receive_stream(sock: socket.socket, count: int) -> None:
    reader, writer = await asyncio.open_connection(sock=sock)
    got = 0
    while got < count:
        data = await reader.read(4096)
        if not data:
            break
        got += len(data) // len(MESSAGE)
    writer.close()


def measure(way: str, period_s: float, count: int = MESSAGES) -> float:
    """Microseconds of the receiver's CPU per message, `count` messages `period_s` apart.
    Forks the sender: call it from a process with no other threads (see `run`)."""
    if way not in WAYS:
        raise ValueError(f"unknown way {way!r}; one of {', '.join(WAYS)}")
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the sender
        mine.close()
        for _ in range(count):
            time.sleep(period_s)
            theirs.sendall(MESSAGE)
        theirs.close()
        os._exit(0)
    theirs.close()
    started = time.process_time()
    if way == "blocking recv":
        _receive_blocking(mine, count)
    elif way == "epoll":
        _receive_epoll(mine, count)
    elif way == "asyncio protocol":
        asyncio.run(_receive_protocol(mine, count))
    else:
        asyncio.run(_receive_stream(mine, count))
    used = time.process_time() - started
    os.waitpid(pid, 0)
    mine.close()
    return 1e6 * used / count


def run(
    periods: tuple[float, ...] = PERIODS_S, count: int = MESSAGES
) -> dict[str, dict[str, float]]:
    """`{way: {period in ms: us of CPU per wake-up}}`, each measured in a fresh process
    (a benchmark's own process has threads, which a fork must not copy)."""
    results: dict[str, dict[str, float]] = {way: {} for way in WAYS}
    for period in periods:
        for way in WAYS:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.wakeups", "--one", way, str(period), str(count)],
                capture_output=True,
                text=True,
                check=True,
                timeout=60 + 3 * count * period,
            )
            results[way][f"{1e3 * period:g}"] = float(out.stdout.strip().splitlines()[-1])
    return results


def report(result: dict[str, dict[str, float]]) -> str:
    periods = next(iter(result.values())).keys()
    return f"CPU per wake-up for a message after a sleep of {' / '.join(periods)} ms: " + ", ".join(
        f"{way} {' / '.join(f'{us:.0f}' for us in by_period.values())} us"
        for way, by_period in result.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=3, metavar=("WAY", "PERIOD_S", "COUNT"))
    args = parser.parse_args()
    if args.one:
        way, period, count = args.one
        print(measure(way, float(period), int(count)))
        return
    result = run()
    print(report(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
