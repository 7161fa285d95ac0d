"""A worker's staged pieces of direct puts: dropped when abandoned, and never staged again
under a key whose put ended while its capability is still valid."""

from __future__ import annotations

import time

import numpy as np
import pytest

from slicewise.common.mesh import GangShape
from worker.runtime import JaxRuntime

PIECES = [((slice(0, 2),), np.zeros(2, np.float32))]


@pytest.fixture
def runtime():
    return JaxRuntime(GangShape(1, 1, 1), 0)


def test_an_abandoned_put_is_dropped_now_and_when_its_pieces_come_late(runtime):
    later = int(time.time()) + 60
    runtime.stage("k", PIECES, later)
    assert runtime.stats()["staged"] == 1
    runtime.drop_staged("k", later)
    assert runtime.stats()["staged"] == 0
    with pytest.raises(KeyError, match="has ended"):
        runtime.stage("k", PIECES, later)
    assert runtime.stats()["staged"] == 0
    runtime.stage("other", PIECES, later)  # other keys are not affected
    assert runtime.stats()["staged"] == 1


def test_ended_keys_are_forgotten_once_their_capability_expired(runtime):
    runtime.drop_staged("old", int(time.time()) - 1)
    runtime.drop_staged("new", int(time.time()) + 60)
    runtime.stage("k", PIECES, int(time.time()) + 60)  # forgets what has expired
    assert list(runtime._closed) == ["new"]


def test_the_controllers_own_puts_are_never_refused(runtime):
    runtime.drop_staged("k", int(time.time()) + 60)
    runtime.stage("k", PIECES)  # the token's put: no capability, no deadline
    assert runtime.stats()["staged"] == 1
