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
        # A forked child is named "sh" until it has exec'd `sleep`: wait for the names.
        def settled():
            tree = _descendants([root.pid])
            names = []
            for pid in tree:
                with suppress(FileNotFoundError), open(f"/proc/{pid}/comm") as f:
                    names.append(f.read().strip())
            return tree if sorted(names) == ["sh", "sleep", "sleep"] else None

        found = wait_until(settled, timeout_s=30, what="the root shell's three descendants")
        assert len(found) == 3
        assert root.pid not in found and os.getpid() not in found
        assert _descendants([]) == []
    finally:
        for pid in _descendants([root.pid]):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait(timeout=10)
