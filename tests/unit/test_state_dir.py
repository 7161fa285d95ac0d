"""Where a controller keeps its state when not told, and the lock that keeps two
controllers off one state directory (no processes: the lock is per open file)."""

from __future__ import annotations

import os
from pathlib import Path

from controller.server import default_state_dir, lock_state_dir


def test_the_default_state_dir_is_per_user_and_per_simulated_cluster(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state_dir(None) == tmp_path / "slicewise"
    assert default_state_dir("2xv5litepod-4") == tmp_path / "slicewise" / "sim-2xv5litepod-4"
    assert default_state_dir("v5litepod-16,v5litepod-4").name == "sim-v5litepod-16+v5litepod-4"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_state_dir(None) == Path.home() / ".local" / "state" / "slicewise"


def test_a_state_dir_is_taken_by_one_controller_at_a_time(tmp_path, caplog):
    state = tmp_path / "state"
    first = lock_state_dir(state)
    assert first is not None
    assert (state / "controller.lock").read_text().strip() == str(os.getpid())
    assert lock_state_dir(state) is None  # a second controller is refused...
    assert f"in use by another controller (pid {os.getpid()})" in caplog.text
    os.close(first)  # ...until the first one is gone (the kernel drops its lock)
    again = lock_state_dir(state)
    assert again is not None
    os.close(again)
