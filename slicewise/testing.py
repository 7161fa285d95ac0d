"""Helpers for testing code that uses slicewise: waiting on conditions, and (below) a
controller on a simulated cluster started from a test."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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
