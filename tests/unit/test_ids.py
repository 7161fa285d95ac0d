"""Gang and job ids (slicewise/common/ids.py): the documented format, a random part that
neither the counter nor another id tells, numbers that go on across a restart with the
old ids kept as they were, and listings in number order past 9 (no processes)."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

from controller.admission import GangManager
from controller.inventory import Host, Slice
from controller.job import JobSpec
from controller.jobs import JobRunner
from controller.journal import Journal
from controller.scheduler import GangRequest, Scheduler
from slicewise.common import ids
from slicewise.common.ids import ID_PATTERN, id_order, unguessable_id
from slicewise.common.topology import slice_type
from tests.unit.fake_cluster import Clock, FakeCluster

V4 = "v5litepod-4"


def spec() -> JobSpec:
    return JobSpec(program="lm", num_slices=1, slice_type=V4, steps=10)


def submitted(runner: JobRunner, count: int) -> list[str]:
    """Ids of `count` jobs submitted to `runner`, whose step loops are cancelled before
    they start (the runner has no gangs to run them on)."""

    async def scenario():
        jobs = [runner.submit(spec()) for _ in range(count)]
        for job in jobs:
            job.task.cancel()
        await asyncio.gather(*(job.task for job in jobs), return_exceptions=True)
        return [job.job_id for job in jobs]

    return asyncio.run(scenario())


def runner_on(path) -> JobRunner:
    controller = SimpleNamespace(options=SimpleNamespace(data_roots=()))
    return JobRunner(controller=controller, journal=Journal(path))


def first_gang_id() -> str:
    async def scenario():
        manager = GangManager(FakeCluster(V4), clock=Clock())
        await manager.refresh_inventory()
        gang, _ = await manager.allocate(1, V4)
        return gang.gang_id

    return asyncio.run(asyncio.wait_for(scenario(), 10))


def test_an_id_is_kind_number_dash_thirteen_base32_characters_as_documented():
    gang, job = unguessable_id("g", 3), unguessable_id("j", 12)
    assert re.fullmatch(r"g3-[a-z2-7]{13}", gang) and re.fullmatch(r"j12-[a-z2-7]{13}", job)
    match = ID_PATTERN.fullmatch(job)
    assert match and (match["kind"], match["number"]) == ("j", "12")
    assert len(ids.ALPHABET) == len(set(ids.ALPHABET)) == 32
    assert ids.SUFFIX_CHARS * 5 >= 64  # bits of entropy
    assert "`<kind><number>-<suffix>`" in ids.__doc__ and "13 characters" in ids.__doc__
    # Nothing that parses an id or a handle built on one trips over the dash.
    handle = f"{gang}/a1"
    assert handle.partition("/")[0] == gang and f"{gang}@a2".partition("@")[0] == gang


def test_the_suffix_is_not_derivable_from_the_number_or_from_other_ids():
    same_number = [unguessable_id("j", 3) for _ in range(2000)]
    assert len(set(same_number)) == len(same_number)
    numbered = [unguessable_id("g", n) for n in range(1, 2001)]
    assert len({i.partition("-")[2] for i in numbered}) == len(numbered)
    # Every character of the alphabet turns up in every position: no position is fixed
    # or follows from the counter (each misses with probability ~32 * (31/32)**2000).
    suffixes = [i.partition("-")[2] for i in same_number]
    for position in range(ids.SUFFIX_CHARS):
        assert {s[position] for s in suffixes} == set(ids.ALPHABET), position


def test_two_fresh_controllers_give_their_first_gang_and_job_different_ids(tmp_path):
    one, two = first_gang_id(), first_gang_id()
    assert one.startswith("g1-") and two.startswith("g1-") and one != two
    (a,) = submitted(runner_on(tmp_path / "a.sqlite"), 1)
    (b,) = submitted(runner_on(tmp_path / "b.sqlite"), 1)
    assert a.startswith("j1-") and b.startswith("j1-") and a != b
    assert ID_PATTERN.fullmatch(one) and ID_PATTERN.fullmatch(a)


def test_a_restarted_runner_keeps_the_old_ids_and_counts_on_in_number_order(tmp_path):
    old = runner_on(tmp_path / "j.sqlite")
    first = submitted(old, 11)
    assert [i.partition("-")[0] for i in first] == [f"j{n}" for n in range(1, 12)]
    # A job's default checkpoint directory is named by its whole id.
    assert old.jobs[first[9]].spec.checkpoint_dir == str(old.checkpoint_root / first[9])
    new = runner_on(tmp_path / "j.sqlite")
    assert list(new.jobs) == first  # restored unchanged
    (later,) = submitted(new, 1)
    assert later.startswith("j12-") and later not in first
    assert [j.job_id for j in new.visible()] == [*first, later]  # j10 after j9, not after j1


def test_ids_sort_by_kind_then_number_then_the_rest():
    shuffled = [unguessable_id("j", n) for n in (10, 9, 2, 11, 1)]
    ordered = sorted(shuffled, key=id_order)
    assert [i.partition("-")[0] for i in ordered] == ["j1", "j2", "j9", "j10", "j11"]
    gang = unguessable_id("g", 3)
    assert sorted([f"{gang}@a2", "j1", gang, "g10", "zz", "g2"], key=id_order) == [
        "g2",
        gang,
        f"{gang}@a2",
        "g10",
        "j1",
        "zz",
    ]


def test_the_schedulers_reasons_name_holders_in_number_order():
    stype = slice_type(V4)
    scheduler = Scheduler(clock=lambda: 42.0)
    names = [f"s{n}" for n in range(11)]
    scheduler.set_inventory(
        {
            n: Slice(n, stype, (Host(f"{n}-h0", "10.0.0.1", 0, 4, True),), simulated=True)
            for n in names
        }
    )
    holders = [unguessable_id("g", n) for n in range(1, 12)]
    for gang_id in holders:
        scheduler.submit(GangRequest(gang_id, 1, stype))
    assert len(scheduler.schedule()) == 11
    scheduler.submit(GangRequest(unguessable_id("g", 12), 1, stype))
    scheduler.schedule()
    reason = scheduler.why_waiting(scheduler.queued()[0].request_id)
    assert reason.endswith(f"held by {', '.join(holders[:5])} and 6 more"), reason
