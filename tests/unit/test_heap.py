"""slicewise/common/heap.py: a process settles its heap once per stage, collecting its
garbage before freezing the rest, so that no garbage is frozen for good."""

from __future__ import annotations

import gc
import weakref

import pytest

from slicewise.common import heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def unfrozen():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()  # this test process's objects go back to the collector
    gc.set_threshold(*thresholds)


def test_a_stage_settles_once_and_collects_its_garbage_before_freezing(unfrozen):
    kept = [_Node() for _ in range(10)]
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle only the collector can free
    dropped = weakref.ref(a)
    del a, b
    assert heap.settle("the test's first stage")
    assert dropped() is None  # collected, not frozen
    assert gc.get_freeze_count() > len(kept)
    # and full collections wait longer: with the heap frozen they would run every few
    # thousand calls (see heap.py)
    assert gc.get_threshold()[2] == heap.FULL_EVERY
    frozen = gc.get_freeze_count()
    assert not heap.settle("the test's first stage")
    assert gc.get_freeze_count() == frozen
    more = [_Node() for _ in range(10)]
    assert heap.settle("the test's second stage")
    assert gc.get_freeze_count() >= frozen + len(more)
