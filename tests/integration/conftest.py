"""Shared, real multi-process fixtures: one simulated cluster + controller for the whole
session (started on first use), clients and gangs per module.

Every process started here runs in a session of its own and is stopped (SIGTERM, then
SIGKILL) at teardown, also when tests fail; a failing test shows the tail of the
controller's log.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

import slicewise
from protos import controller_pb2 as pb
from slicewise.common.files import last_lines
from slicewise.launch import ControllerProcess
from slicewise.testing import wait_until

# Two single-host slices for multislice work, one 4-host slice for multi-host work.
SHARED_SIM = "2xv5litepod-4,v5litepod-16"

_LOGS: list[Path] = []
_LOG_OF: dict[int, Path] = {}  # controller pid -> its log


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return last_lines(path, lines)
    except OSError as exc:
        return f"(no log: {exc})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for path in _LOGS:
            report.sections.append((f"controller log {path.name} (tail)", log_tail(path)))


def start_controller(tmp_path_factory, name: str, *, extra_args=(), **kwargs) -> ControllerProcess:
    """A controller subprocess whose stderr goes to a log shown when a test fails, and
    whose journal lives in the test's temporary directory."""
    directory = Path(tmp_path_factory.mktemp(name))
    path = directory / f"{name}.log"
    _LOGS.append(path)
    # No test waits for a silent worker to be given up on, and on the 2-core CI machine
    # the whole machine stalls for 10-20 s now and then under the suite's load (a
    # raylet's event loop queued a timer for 19.9 s, and workers of two clusters fell
    # silent at once): a 10-s heartbeat limit failed healthy gangs there.
    args = ("--state-dir", str(directory / "state"), "--heartbeat-timeout", "60", *extra_args)
    with open(path, "w") as log:
        proc = ControllerProcess(stderr=log, extra_args=args, **kwargs)
    _LOG_OF[proc.pid] = path
    return proc


@contextlib.contextmanager
def chaos_controller_on(
    tmp_path_factory, name: str, sim: str, step_timeout_s: float, *extra_args: str
) -> Iterator[ControllerProcess]:
    """A controller of a module's own on `sim`, accepting fault injection, with a step
    watchdog of `step_timeout_s` (and `extra_args`); stopped (and checked to exit
    cleanly) at the end."""
    proc = start_controller(
        tmp_path_factory,
        name,
        sim=sim,
        extra_args=("--allow-chaos", "--step-timeout", str(step_timeout_s), *extra_args),
    )
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def controller_log(controller: ControllerProcess) -> str:
    """What a controller started by `start_controller` has logged so far."""
    return _LOG_OF[controller.pid].read_text(errors="replace")


@pytest.fixture(scope="session")
def controller(tmp_path_factory):
    proc = start_controller(
        tmp_path_factory, "shared-controller", sim=SHARED_SIM, extra_args=("--metrics-port", "0")
    )
    try:
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, f"the shared controller exited with {code}"


@pytest.fixture(scope="module")
def client(controller):
    with slicewise.connect(controller.address, name=f"tests-{os.getpid()}") as c:
        yield c


@pytest.fixture(scope="module")
def two_slices(client):
    """A gang of both v5litepod-4 slices: 8 chips on 2 hosts, one per slice."""
    with client.allocate(slices=2, slice_type="v5litepod-4", timeout=120) as gang:
        yield gang


@pytest.fixture(scope="session")
def lm_reference(controller, tmp_path_factory):
    """(info, steps) of an uninterrupted `test_checkpoints.CONFIG` run of all its
    `total_steps` (40) on 2 x v5litepod-4, without checkpoints, on the shared controller.

    The reference of every module that compares a checkpointed, preempted, restarted or
    recovered run with an uninterrupted one: the learning rate follows `total_steps`, not
    the steps a job runs, so a shorter run of CONFIG is this run's prefix, and the same
    program and seed give the same losses on any controller.
    """
    from tests.integration.test_checkpoints import CONFIG, run_job

    def run() -> tuple[pb.JobInfo, list[pb.StepMetrics]]:
        with slicewise.connect(controller.address, name=f"reference-{os.getpid()}") as client:
            return run_job(client, int(CONFIG["total_steps"]), checkpoint_every=0)

    # The suite's workers (pytest-xdist) share one run: its info and steps are kept beside
    # their temporary directories, under this run's id, by whichever asks first.
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id:
        return run()
    path = tmp_path_factory.getbasetemp().parent / f"lm-reference-{run_id}.pb"
    with open(path.with_suffix(".lock"), "w") as lock:
        wait_until(
            lambda: _try_lock(lock),
            timeout_s=900,
            interval_s=0.5,
            what="the other test worker's reference run",
        )
        try:
            if path.exists():
                kept = pb.JobMetrics.FromString(path.read_bytes())
                return kept.job, list(kept.steps)
            info, steps = run()
            path.write_bytes(pb.JobMetrics(job=info, steps=steps).SerializeToString())
            return info, steps
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _try_lock(lock: IO[str]) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
