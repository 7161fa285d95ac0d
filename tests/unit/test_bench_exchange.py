"""The transfer benchmark's baseline: two processes swapping bytes over loopback TCP."""

from __future__ import annotations

import pytest

from benchmarks.common import RawExchange


@pytest.mark.parametrize("warm", [False, True], ids=["own-memory", "cache-warm"])
def test_the_raw_exchange_swaps_any_size_again_and_again(warm):
    """Sizes that do and do not divide by the streams, growing and shrinking: each swap
    comes back (a peer that stopped would raise, one that hung would time out)."""
    with RawExchange(4) as exchange:
        for nbytes in (2**20, 3 * 2**20 + 5, 40 * 2**20, 2**20):
            assert exchange.swap(nbytes, warm=warm) > 0
        assert all(proc.poll() is None for proc in exchange._procs)


def test_a_peer_that_dies_is_an_error_not_a_hang():
    with RawExchange(2) as exchange:
        exchange._procs[0].kill()
        exchange._procs[0].wait(timeout=10)
        with pytest.raises((RuntimeError, BrokenPipeError)):
            exchange.swap(2**20)
