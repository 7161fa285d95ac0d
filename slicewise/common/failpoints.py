"""Test-only pauses at chosen points of the controller and the workers, so a test can
make a failure land exactly there (a host lost mid-reservation, workers killed while a
checkpoint commits) instead of hoping a sleep lines it up.

A test points SLICEWISE_FAILPOINTS at a JSON file of name -> number, e.g.
`{"reserve_delay_s": 4}`. The controller passes the variable on to the workers it
starts (`worker_env`), so one file drives both. The file is read on every use: a test
may set and clear failpoints while its processes run.
"""

from __future__ import annotations

import json
import os

ENV_VAR = "SLICEWISE_FAILPOINTS"


def failpoint(name: str) -> float:
    """The value of failpoint `name` (0 when unset, or when there is no readable file)."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return 0.0
    try:
        with open(path) as f:
            return float(json.load(f).get(name, 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def worker_env() -> dict[str, str]:
    """The variable for a process started on this one's behalf (its workers), when set."""
    path = os.environ.get(ENV_VAR)
    return {ENV_VAR: path} if path else {}
