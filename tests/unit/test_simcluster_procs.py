"""How a simulated host finds every process it takes down when it goes away."""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import suppress

from controller.simcluster import _descendants
from slicewise.testing import wait_until


def test_descendants_are_the_children_and_their_children():
    # The root shell starts a sleeping child and a second shell, whose child sleeps too.
    root = subprocess.Popen(["sh", "-c", "sleep 60 & sh -c 'sleep 60 & wait' & wait"])
    try:
        found = wait_until(
            lambda: tree if len(tree := _descendants([root.pid])) == 3 else None,
            timeout_s=30,
            what="the root shell's three descendants",
        )
        names = []
        for pid in found:
            with open(f"/proc/{pid}/comm") as f:
                names.append(f.read().strip())
        assert sorted(names) == ["sh", "sleep", "sleep"]
        assert root.pid not in found and os.getpid() not in found
        assert _descendants([]) == []
    finally:
        for pid in _descendants([root.pid]):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait(timeout=10)
