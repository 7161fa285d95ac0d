"""Stopping the controller stops everything it started: workers, raylets, agents."""

from __future__ import annotations

import contextlib
import os
import signal

import jax
import numpy as np
import pytest

import slicewise
from slicewise.testing import wait_until
from tests.integration.conftest import start_controller

pytestmark = pytest.mark.integration


def _session_members(sid: int) -> dict[int, str]:
    members = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    members[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            continue
    return members


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for_exit(pids: list[int], names: dict[int, str], timeout_s: float) -> None:
    """Waits until none of `pids` is alive; the message names those that are."""
    try:
        wait_until(
            lambda: not any(_alive(p) for p in pids),
            timeout_s=timeout_s,
            interval_s=0.5,
            what="the processes to exit",
        )
    except TimeoutError:
        left = {p: names.get(p, "supervisor") for p in pids if _alive(p)}
        raise AssertionError(f"still alive after {timeout_s:g} s: {left}") from None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_on_controller_leaves_no_worker_or_raylet(tmp_path_factory, sig):
    controller = start_controller(tmp_path_factory, f"shutdown-{sig.name}", sim="2xv5litepod-1")
    try:
        with slicewise.connect(controller.address) as client:
            sim_pid = client.health().simulation_pid
            gang = client.allocate(slices=2, slice_type="v5litepod-1", timeout=120)
            mesh = gang.mesh()
            x = gang.put(np.ones(2, np.float32), mesh.sharding("slice"))
            assert gang.compile(jax.jit(lambda a: a + 1), x)(x).fetch().tolist() == [2, 2]
            worker_pids = [w.pid for w in gang.stats().workers]
        members = _session_members(sim_pid)
        raylets = [p for p, cmd in members.items() if "raylet" in cmd]
        assert sim_pid > 0 and len(raylets) >= 3, members  # head + one per simulated host
        assert all(p in members for p in worker_pids), (worker_pids, members)

        os.kill(controller.pid, sig)  # the gang is still held: shutdown must release it
        assert controller.proc.wait(timeout=120) == 0

        wait_for_exit([*members, sim_pid], members, timeout_s=60)
        assert not [p for p in _session_members(sim_pid) if _alive(p)]
    finally:
        controller.stop()


def test_killed_controller_takes_its_simulation_with_it(tmp_path_factory):
    """Even SIGKILL, which no handler sees: the supervisor notices its stdin close."""
    controller = start_controller(tmp_path_factory, "shutdown-SIGKILL", sim="v5litepod-1")
    try:
        with slicewise.connect(controller.address) as client:
            sim_pid = client.health().simulation_pid
        members = _session_members(sim_pid)
        assert any("raylet" in cmd for cmd in members.values())
        os.kill(controller.pid, signal.SIGKILL)
        controller.proc.wait(timeout=30)
        wait_for_exit([*members, sim_pid], members, timeout_s=90)
    finally:
        controller.stop()


def test_a_killed_parent_takes_its_controller_with_it(tmp_path):
    """A test run killed outright (SIGKILL: no finalizer runs) leaves no controller behind:
    the controller started by slicewise.testing sees its stdin close and stops."""
    import subprocess
    import sys

    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, threading\n"
            "from slicewise.launch import ControllerProcess\n"
            "c = ControllerProcess(sim='v5litepod-1', extra_args=('--state-dir', sys.argv[1]))\n"
            "print(c.pid, flush=True)\n"
            "threading.Event().wait()\n",
            str(tmp_path / "state"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    controller_pid = 0
    try:
        assert parent.stdout is not None
        # The parent prints the pid once the controller listens, or exits (start failed).
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"the controller did not start: {line!r}"
        controller_pid = int(line)
        assert _alive(controller_pid)
        parent.kill()
        parent.wait(timeout=30)
        wait_for_exit([controller_pid], {controller_pid: "controller"}, timeout_s=120)
    finally:
        for group in (parent.pid, controller_pid):  # each leads a session of its own
            if group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
        parent.wait(timeout=30)
