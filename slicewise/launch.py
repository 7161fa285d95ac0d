"""Starting and stopping controller processes from Python (the demo, tests, benchmarks).

A controller runs in a session of its own, so that stopping it can never signal the
caller, and so that anything it leaves behind can still be found and killed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


class ControllerStartError(RuntimeError):
    """A controller subprocess exited, or did not listen in time, before it could serve.

    `reason` says which; `exit_code` is None when it was still running; `advice` (what to
    look at next) completes the message.
    """

    def __init__(
        self, reason: str, exit_code: int | None = None, *, advice: str = "see its log"
    ) -> None:
        super().__init__(f"{reason}; {advice}")
        self.reason = reason
        self.exit_code = exit_code


class ControllerProcess:
    """A `slicewise controller` subprocess; `address` is where it listens."""

    def __init__(
        self,
        *,
        sim: str | None = None,
        ray_address: str | None = None,
        extra_args: tuple[str, ...] = (),
        stderr: IO[str] | None = None,
        start_timeout_s: float = 300.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        where = ["--sim", sim] if sim else ["--ray-address", str(ray_address)]
        if "--tokens-file" not in extra_args and "--insecure-local" not in extra_args:
            # On loopback, as started from here unless told otherwise: nobody else reaches it.
            where.append("--insecure-local")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "controller.cli",
                "controller",
                *where,
                "--port",
                "0",
                "--stop-on-stdin-eof",
                *extra_args,
            ],
            # Never written to: it closes when this process exits, however it exits, and
            # the controller then stops (no controller outlives a killed test run).
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
            cwd=cwd,
            env=None if env is None else os.environ | env,
        )
        try:
            lines = _wait_for_listening(self.proc, start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.address = lines[-1].split("listening on", 1)[1].split()[0]
        self.metrics_url = next(
            (
                ln.split(" on ", 1)[1].strip()
                for ln in lines
                if ln.startswith("slicewise metrics on ")
            ),
            None,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 90.0) -> int:
        return stop_process(self.proc, timeout_s)


@contextmanager
def controller_process(**kwargs: object) -> Iterator[ControllerProcess]:
    """A ControllerProcess that is stopped (SIGTERM, then SIGKILL) on leaving the block."""
    controller = ControllerProcess(**kwargs)  # type: ignore[arg-type]
    try:
        yield controller
    finally:
        controller.stop()


class RestartableController:
    """A controller on `sim` (or joined to the Ray cluster at `ray_address`) that can be
    killed or stopped and started again on the same state directory (`directory/state`)
    and port (a `stable_port`), logs in `directory/controller-N.log`; at `close` every
    process it started is gone, also those of a controller killed outright (each start
    runs in a session of its own)."""

    def __init__(
        self,
        directory: Path,
        *,
        sim: str | None = None,
        ray_address: str | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.sim = sim
        self.ray_address = ray_address
        self.extra_args = extra_args
        self.env = env  # added to this process's environment (e.g. Ray's token)
        self.state = directory / "state"
        self.port = stable_port()
        self.starts = 0
        self.proc: ControllerProcess | None = None
        self.sessions: list[int] = []

    def log_path(self, start: int) -> Path:
        return self.directory / f"controller-{start}.log"

    def start(self) -> ControllerProcess:
        self.starts += 1
        with open(self.log_path(self.starts), "w") as log:
            self.proc = ControllerProcess(
                sim=self.sim,
                ray_address=self.ray_address,
                stderr=log,
                env=self.env,
                extra_args=(
                    *self.extra_args,
                    "--state-dir",
                    str(self.state),
                    "--port",
                    str(self.port),
                ),
            )
        self.sessions.append(self.proc.pid)
        self.port = int(self.proc.address.rsplit(":", 1)[1])
        return self.proc

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        for session in self.sessions:  # whatever a killed controller left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(session, signal.SIGKILL)


def stable_port(low: int = 10000, high: int | None = None, tries: int = 50) -> int:
    """A port free on 127.0.0.1 now, from `low` up to `high` (default: just below the
    kernel's ephemeral range), for a controller that must come back on the port it had.

    A port the kernel hands out (`--port 0`) is from the ephemeral range, which is also
    where every outgoing connection takes its local port: once a killed controller's
    port is free, any connection on the machine may take it before the controller is
    started again (it happened under the test suite's load: "Address already in use").
    Below the range only an explicit bind can take it.

    Raises:
        OSError: no free port was found in `tries` random picks.
    """
    if high is None:
        try:
            with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
                high = int(f.read().split()[0]) - 1
        except (OSError, ValueError, IndexError):
            high = 32767  # Linux's default range starts at 32768
    for _ in range(tries):
        port = random.randint(low, max(low, high))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on 127.0.0.1 between {low} and {high} in {tries} tries")


def _wait_for_listening(proc: subprocess.Popen, timeout_s: float) -> list[str]:
    """The controller's stdout lines up to and including its "listening on" line."""
    lines: list[str] = []
    done = threading.Event()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:
        # Reads to the end, so that the controller never blocks on a full pipe.
        for line in stdout:
            if not done.is_set():
                lines.append(line.strip())
                if "listening on" in line:
                    done.set()
        done.set()  # end of output: the controller exited

    threading.Thread(target=read, daemon=True).start()
    ended = done.wait(timeout_s)
    if not lines or "listening on" not in lines[-1]:
        if ended:  # its output ended before it listened: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        code = proc.poll()
        if code is None:
            raise ControllerStartError(
                f"the controller did not start listening within {timeout_s:g} s"
            )
        raise ControllerStartError(
            f"the controller exited with code {code} before it started listening", code
        )
    return lines


def stop_process(proc: subprocess.Popen, timeout_s: float = 90.0) -> int:
    """SIGTERM a process started in its own session; SIGKILL the session if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    if proc.stdin is not None:
        proc.stdin.close()
    return proc.returncode
