"""The archive of released gangs' timelines: bounded by spans, whatever the gangs ran."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.core import Controller
from controller.gangstate import GangState
from controller.timelines import TimelineArchive
from slicewise.common.trace import Span
from tests.unit.fake_cluster import Clock, FakeCluster

TIMEOUT = 60.0
V4 = "v5litepod-4"


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


def test_a_trace_asked_for_while_its_gang_is_being_released_waits_for_the_archive():
    """Between a gang leaving the live gangs and its timelines being archived (while its
    workers stop) a trace neither finds it live nor archived: it waits, and answers."""

    async def scenario() -> tuple[bool, dict[str, Any]]:
        controller = Controller(backend=FakeCluster(V4), clock=Clock(), simulated=True)
        await controller.refresh_inventory()
        gang, gang_id = await controller.allocate(1, V4)
        stop, stopping, may_stop = gang.stop, asyncio.Event(), asyncio.Event()

        async def held_stop(then: GangState, why: str) -> None:
            stopping.set()
            await may_stop.wait()
            await stop(then, why)

        gang.stop = held_stop  # type: ignore[method-assign]
        release = asyncio.create_task(controller.release(gang_id))
        await asyncio.wait_for(stopping.wait(), TIMEOUT)
        assert gang_id not in controller.gangs  # gone from the live gangs, not yet archived
        trace = asyncio.create_task(controller.trace(gang_id))
        await asyncio.sleep(0)  # let the trace start before the stop ends (order, not time)
        answered_early = trace.done()
        may_stop.set()
        await release
        return answered_early, await trace

    answered_early, trace = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    assert not answered_early
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names[0] == "controller" and len(names) == 2, names  # and the one host's track
