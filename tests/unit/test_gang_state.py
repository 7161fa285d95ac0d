"""The gang life cycle: its transition table, epochs that fence stale replies, one place
that changes the state, and start/stop on an in-memory cluster (no processes)."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from controller.gang import Gang, SliceLostError
from controller.gangstate import TRANSITIONS as TABLE
from controller.gangstate import GangState
from controller.inventory import slices_from_nodes
from slicewise.common.errors import InvalidTransitionError, WorkerError
from slicewise.common.files import last_lines
from slicewise.common.topology import slice_type
from tests.unit.fake_cluster import FakeCluster

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [(a, b) for a in GangState for b in GangState]
V4 = "v5litepod-4"


def gang_in(state: GangState, cluster=None) -> Gang:
    gang = Gang("g1", "test", slice_type(V4), 2, backend=cluster or FakeCluster(V4, V4))
    gang.state = state  # tests may put a gang anywhere; the code under test may not
    return gang


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10.0))


@pytest.mark.parametrize(("old", "new"), [p for p in PAIRS if p[1] in TABLE[p[0]]])
def test_every_transition_in_the_table_is_allowed(old, new):
    gang = gang_in(old)
    assert gang.transition(new, why="because") is True
    assert gang.state is new and gang.why == "because"


@pytest.mark.parametrize(("old", "new"), [p for p in PAIRS if p[1] not in TABLE[p[0]]])
def test_every_transition_outside_the_table_is_refused(old, new):
    gang = gang_in(old)
    with pytest.raises(InvalidTransitionError, match=f"{old.value} -> {new.value}"):
        gang.transition(new)
    assert gang.state is old


def test_released_is_final_and_only_ready_and_preempting_run_work():
    assert TABLE[GangState.RELEASED] == frozenset()
    assert {s for s in GangState if s.usable} == {GangState.READY, GangState.PREEMPTING}
    # Every state but the final one can be left, and every state can be reached.
    assert all(TABLE[s] for s in GangState if s is not GangState.RELEASED)
    assert set().union(*TABLE.values()) == set(GangState)


def test_each_start_bumps_the_epoch_and_changes_from_an_older_epoch_are_ignored():
    gang = gang_in(GangState.QUEUED)
    gang.transition(GangState.STARTING)
    gang.transition(GangState.READY, epoch=1)
    gang.transition(GangState.STOPPING)
    gang.transition(GangState.PREEMPTED)
    gang.transition(GangState.STARTING)
    assert gang.epoch == 2
    assert gang.transition(GangState.READY, epoch=1) is False  # a late reply of start 1
    assert gang.state is GangState.STARTING
    assert gang.transition(GangState.READY, epoch=2) is True


def test_the_state_of_a_gang_is_assigned_only_in_gang_transition():
    """No other code that handles gangs writes `<anything>.state = ...`."""
    offenders = []
    for name in ("gang.py", "admission.py", "core.py", "servicer.py", "backend.py"):
        path = ROOT / "controller" / name
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AugAssign | ast.AnnAssign)
                    else []
                )
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Attribute) and leaf.attr == "state":
                            where = f"{path.name}:{node.lineno} in {func.name}"
                            if (path.name, func.name) not in {
                                ("gang.py", "transition"),
                                ("gang.py", "__init__"),
                            }:
                                offenders.append(where)
    assert offenders == []


# -- start and stop on an in-memory cluster --------------------------------------------


async def started(cluster: FakeCluster) -> Gang:
    gang = Gang("g1", "test", slice_type(V4), 2, backend=cluster)
    slices = slices_from_nodes(cluster.nodes())
    await gang.start([slices[n] for n in sorted(slices)[:2]], timeout_s=5)
    return gang


def test_a_start_forms_the_gang_and_a_stop_leaves_nothing_behind():
    async def scenario():
        cluster = FakeCluster(V4, V4)
        gang = await started(cluster)
        ready = (gang.state, gang.epoch, len(cluster.live_workers()), len(cluster.held()))
        await gang.stop(GangState.RELEASED, "was released")
        return cluster, gang, ready

    cluster, gang, ready = run(scenario())
    assert ready == (GangState.READY, 1, 2, 1)
    assert gang.state is GangState.RELEASED
    assert cluster.live_workers() == [] and cluster.held() == []
    assert all(c.closed for c in cluster.channels)
    assert gang.dispatcher.broken == "gang g1 was released"


def test_a_failed_start_is_rolled_back_to_queued_and_says_why():
    async def scenario():
        cluster = FakeCluster(V4, V4, auto_ready=False)
        gang = Gang("g1", "test", slice_type(V4), 2, backend=cluster)
        slices = slices_from_nodes(cluster.nodes())
        starting = asyncio.create_task(gang.start(list(slices.values()), timeout_s=5))
        (await cluster.reservation()).fail(RuntimeError("bundle infeasible"))
        with pytest.raises(WorkerError, match="failed to start: RuntimeError: bundle infeasible"):
            await starting
        return cluster, gang

    cluster, gang = run(scenario())
    assert gang.state is GangState.QUEUED and cluster.held() == []


def test_a_failed_start_quotes_what_the_dead_worker_wrote_last():
    async def scenario():
        cluster = FakeCluster(V4, V4, auto_ready=False)
        cluster.dying_words = "Fatal Python error: Segmentation fault"
        gang = Gang("g1", "test", slice_type(V4), 2, backend=cluster)
        starting = asyncio.create_task(
            gang.start(list(slices_from_nodes(cluster.nodes()).values()), timeout_s=5)
        )
        (await cluster.reservation()).fail(RuntimeError("worker died"))
        with pytest.raises(WorkerError) as raised:
            await starting
        return str(raised.value)

    message = run(scenario())
    assert message.endswith(
        "RuntimeError: worker died\nThe worker's last output (stderr):\n"
        "Fatal Python error: Segmentation fault"
    ), message


def test_a_start_that_loses_a_slice_is_rolled_back_at_once():
    async def scenario():
        cluster = FakeCluster(V4, V4, auto_ready=False)
        gang = Gang("g1", "test", slice_type(V4), 2, backend=cluster, lost_poll_s=0.001)
        slices = slices_from_nodes(cluster.nodes())
        lost: list[str] = []
        starting = asyncio.create_task(
            gang.start(list(slices.values()), timeout_s=5, lost=lambda: lost[0] if lost else None)
        )
        await cluster.reservation()
        lost.append("sim-1-v5litepod-4")
        with pytest.raises(SliceLostError, match="slice sim-1-v5litepod-4 lost a host"):
            await starting
        return cluster, gang

    cluster, gang = run(scenario())
    assert gang.state is GangState.QUEUED and cluster.held() == []


def test_a_stop_asked_for_during_another_stop_follows_it():
    async def scenario():
        cluster = FakeCluster(V4, V4)
        gang = await started(cluster)
        gang.transition(GangState.PREEMPTING)
        history = []
        transition = gang.transition
        gang.transition = lambda new, **kw: (history.append(new), transition(new, **kw))[1]
        preempting = gang.stop(GangState.PREEMPTED, "is being preempted by g2")
        releasing = gang.stop(GangState.RELEASED, "was released")
        await asyncio.gather(preempting, releasing)
        return history, gang.state

    history, state = run(scenario())
    assert history == [
        GangState.STOPPING,
        GangState.PREEMPTED,
        GangState.STOPPING,
        GangState.RELEASED,
    ]
    assert state is GangState.RELEASED


def test_a_failure_reported_by_the_dispatcher_of_an_earlier_start_is_ignored():
    async def scenario():
        cluster = FakeCluster(V4, V4)
        gang = await started(cluster)
        old = gang.dispatcher
        await gang.stop(GangState.PREEMPTED, "is being preempted by g2")
        slices = slices_from_nodes(cluster.nodes())
        await gang.start([slices[n] for n in sorted(slices)], timeout_s=5)
        gang._on_broken("a worker of start 1 died", epoch=1)
        stale = gang.state
        gang._on_broken("a worker of start 2 died", epoch=2)
        return old, stale, gang

    old, stale, gang = run(scenario())
    assert old is not gang.dispatcher
    assert stale is GangState.READY
    assert gang.state is GangState.FAILED and gang.why == "a worker of start 2 died"


def test_the_tail_of_a_workers_stderr_is_its_last_lines_of_its_last_bytes(tmp_path):
    def tail(path, lines=20, max_bytes=4096):  # as RayBackend.last_words reads one
        return last_lines(path, lines, max_bytes).rstrip("\n")

    err = tmp_path / "worker-1-2-3.err"
    err.write_text("".join(f"line {i}\n" for i in range(30)))
    assert tail(err) == "\n".join(f"line {i}" for i in range(10, 30))
    assert tail(err, lines=3, max_bytes=12) == "line 29"  # " 28" began earlier
    err.write_text("")
    assert tail(err) == ""
