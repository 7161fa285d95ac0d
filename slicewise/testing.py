"""Helpers for testing code that uses slicewise: a controller on a simulated cluster,
started from a test, and waiting on conditions.

    from slicewise.testing import simulated_cluster

    with simulated_cluster("2xv5litepod-4") as client:
        with client.allocate(slices=2, slice_type="v5litepod-4") as gang:
            ...

The pytest plugin (`slicewise.pytest_plugin`) shares one such cluster per test session
as the fixture `slicewise_client`.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from slicewise.common.files import last_lines
from slicewise.common.topology import parse_sim_spec
from slicewise.launch import ControllerProcess, ControllerStartError

if TYPE_CHECKING:
    from slicewise.client import Client

__all__ = ["DEFAULT_SIM", "ControllerStartError", "log_tail", "simulated_cluster", "wait_until"]

T = TypeVar("T")

DEFAULT_SIM = "2xv5litepod-4"


def wait_until(
    condition: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
) -> T:
    """Polls `condition()` until it returns something truthy, and returns that.

    Args:
        condition: called every `interval_s` seconds; exceptions propagate.
        timeout_s: how long to keep asking.
        what: what is awaited, for the error message ("job j1 to reach step 10").

    Raises:
        TimeoutError: `condition()` stayed falsy for `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


@contextmanager
def simulated_cluster(
    sim: str = DEFAULT_SIM,
    *,
    name: str = "slicewise.testing",
    start_timeout_s: float = 300.0,
    extra_args: Sequence[str] = (),
    log: str | os.PathLike[str] | None = None,
) -> Iterator[Client]:
    """Starts a controller on a simulated cluster and yields a client connected to it.

    The controller runs as a subprocess (`slicewise controller --sim SIM --port 0`) with
    its journal in a temporary directory; every simulated host is a process of its own.
    Leaving the block, also by an exception or Ctrl-C, closes the client and stops the
    controller, its workers and every simulated host (SIGTERM, then SIGKILL).

    Args:
        sim: the cluster, as for `slicewise controller --sim`: "2xv5litepod-4" (two
            single-host slices of 4 chips), "v5litepod-16,v5litepod-4", ...
        name: the client's name, as `slicewise status` shows it.
        start_timeout_s: how long the controller and the simulated hosts may take to
            start (about 10-20 s for a few hosts on a laptop).
        extra_args: more `slicewise controller` flags, e.g. ("--window", "4").
        log: a file for the controller's log; by default it goes to the temporary
            directory and is gone afterwards.

    Raises:
        InvalidRequestError: `sim` is not a cluster spec.
        ControllerStartError: the controller did not start; the message carries the end
            of its log.
        RuntimeError: on leaving the block, when the controller did not stop cleanly.
    """
    parse_sim_spec(sim)  # a bad spec fails here, before any process starts
    from slicewise.client import connect  # gRPC only once a cluster is wanted

    with tempfile.TemporaryDirectory(
        prefix="slicewise-sim-", ignore_cleanup_errors=True
    ) as workdir:
        log_path = Path(log) if log is not None else Path(workdir) / "controller.log"
        args = ("--state-dir", str(Path(workdir) / "state"), *extra_args)
        with open(log_path, "w") as stderr:
            try:
                controller = ControllerProcess(
                    sim=sim, extra_args=args, stderr=stderr, start_timeout_s=start_timeout_s
                )
            except ControllerStartError as exc:
                advice = (
                    "its log below says why"
                    if exc.exit_code is not None
                    else f"a slow or busy machine may need more than start_timeout_s="
                    f"{start_timeout_s:g}; its log below shows how far it got"
                )
                keep = f" ({log_path})" if log is not None else " (pass log=PATH to keep it)"
                raise ControllerStartError(
                    f"no simulated cluster {sim!r}: {exc.reason}",
                    exc.exit_code,
                    advice=f"{advice}. The end of the controller's log{keep}:\n"
                    + log_tail(log_path),
                ) from None
        try:
            with connect(controller.address, name=name) as client:
                yield client
        except BaseException:
            controller.stop()
            raise
        code = controller.stop()
        if code != 0:
            raise RuntimeError(
                f"the controller on {sim!r} exited with code {code} when asked to stop; "
                f"the end of its log:\n{log_tail(log_path)}"
            )


def log_tail(path: str | os.PathLike[str], lines: int = 40) -> str:
    """The last `lines` lines of a log file, or why there are none."""
    try:
        return last_lines(path, lines) or "(the log is empty)"
    except OSError as exc:
        return f"(no log: {exc})"
