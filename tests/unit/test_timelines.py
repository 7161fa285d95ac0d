"""The archive of released gangs' timelines: bounded by spans, whatever the gangs ran."""

from __future__ import annotations

import pytest

from controller.timelines import TimelineArchive
from slicewise.common.trace import Span


def spans(n: int, start: int = 0) -> list[Span]:
    return [Span(f"s{start + i}", "dispatch", start + i, 1) for i in range(n)]


def test_a_gang_keeps_the_most_recent_spans_of_each_track_within_the_budget():
    archive = TimelineArchive(budget=10)
    assert archive.share(3) == 3 and archive.share(0) == 10 and archive.share(100) == 1
    archive.add("g1", [("controller", spans(100)), ("host 0", spans(2)), ("host 1", spans(7))])
    tracks = archive.get("g1")
    assert tracks is not None
    assert [(name, [s.name for s in kept]) for name, kept in tracks] == [
        ("controller", ["s97", "s98", "s99"]),
        ("host 0", ["s0", "s1"]),
        ("host 1", ["s4", "s5", "s6"]),
    ]
    assert len(archive) == 8 and "g1" in archive


def test_the_gangs_released_longest_ago_are_forgotten_first():
    archive = TimelineArchive(budget=10)
    for g in ("g1", "g2", "g3"):
        archive.add(g, [("controller", spans(4))])
    assert len(archive) == 8 and archive.gangs == 2
    assert archive.get("g1") is None and "g2" in archive and "g3" in archive
    archive.add("g4", [("controller", spans(1000))])  # alone, it takes the whole budget
    assert len(archive) == 10 and archive.gangs == 1 and "g4" in archive


def test_adding_a_gang_again_replaces_what_was_kept_of_it():
    archive = TimelineArchive(budget=10)
    archive.add("g1", [("controller", spans(8))])
    first = archive.get("g1")
    assert first is not None
    archive.add("g1", [*first, ("host 0", spans(8))])
    assert len(archive) == 10 and archive.gangs == 1
    assert [len(kept) for _, kept in archive.get("g1") or []] == [5, 5]


def test_a_budget_keeps_at_least_one_span():
    with pytest.raises(ValueError, match="at least one span"):
        TimelineArchive(budget=0)
