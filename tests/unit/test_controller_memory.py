"""What a controller keeps of the calls on a gang once the gang is released: nothing that
grows with the number of calls. Counted as entries of the containers the controller's own
objects reach, round after round of a shared gang's calls, against an in-memory cluster
(no processes); never as bytes or time."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from controller.core import Controller
from controller.timelines import TimelineArchive
from slicewise.common.arrays import ArraySpec
from slicewise.common.mesh import MeshSpec
from tests.unit.fake_cluster import Clock, FakeCluster

TIMEOUT = 60.0
V4 = "v5litepod-4"  # one host of 4 chips: a slice is a host
MESH = MeshSpec.build({"slice": 2}, {"chip": 4})
SPEC = ArraySpec((8,), "int32")


def plus_one() -> bytes:
    aval = jax.ShapeDtypeStruct(
        (8,), jnp.int32, sharding=NamedSharding(MESH.abstract(), PartitionSpec())
    )
    return bytes(jax.export.export(jax.jit(lambda a: a + 1), platforms=["cpu"])(aval).serialize())


def census(root: object) -> Counter[str]:
    """Entries of every dict, list, set, deque and tuple reachable from `root` through the
    objects of the controller's own modules (not the test's fake cluster, not asyncio's),
    summed by where they are (`manager.gangs[]._watchers`, `arrays._deleted`, ...)."""
    sizes: Counter[str] = Counter()
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("controller", root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            sizes[path] += len(obj)
            stack += [(f"{path}[]", v) for v in obj.values()]
        elif isinstance(obj, list | tuple | set | frozenset | deque):
            sizes[path] += len(obj)
            stack += [(f"{path}[]", v) for v in obj]
        elif type(obj).__module__.startswith(("controller.", "slicewise.")):
            fields = getattr(obj, "__dict__", None) or {
                name: getattr(obj, name)
                for name in getattr(type(obj), "__slots__", ())
                if hasattr(obj, name)
            }
            stack += [(f"{path}.{name}", value) for name, value in fields.items()]
    return sizes


async def shared_gang_round(controller: Controller, serialized: bytes, calls: int) -> str:
    """Two clients attach to one shared gang; each makes `calls` calls, each on the
    previous call's output (dropped once used), and fetches every output; both detach,
    which releases the gang. Returns the gang's id."""
    gang, first = await controller.allocate(2, V4, client="a", shared="pool")
    _, second = await controller.allocate(2, V4, client="b", shared="pool")

    async def read(pin_id: str) -> list[Any]:  # the data port, without processes
        return [[((slice(0, 8),), np.arange(8, dtype=np.int32))], []]

    gang.read = read  # type: ignore[method-assign]
    for gang_id in (first, second):
        program = await controller.register_program(gang_id, "plus_one", MESH, serialized)
        x = controller.arrays.new(gang.gang_id, SPEC)
        x.settle(None)
        x.numbered = True
        handle = x.handle
        for _ in range(calls):
            _, (out,) = controller.execute(gang_id, program.program_id, [handle])
            await controller.fetch(out.handle)
            controller.delete([handle])
            handle = out.handle
    await controller.release(second)
    await controller.release(first)
    return gang.gang_id


def test_a_released_gang_leaves_nothing_that_grows_with_its_calls():
    async def scenario() -> tuple[Controller, list[Counter[str]], dict[str, Any]]:
        controller = Controller(backend=FakeCluster(V4, V4), clock=Clock(), simulated=True)
        # Released gangs' timelines are kept up to a budget of spans (test_timelines.py):
        # a small one, full from the first round on.
        controller.timelines = TimelineArchive(budget=10)
        await controller.refresh_inventory()
        serialized = await asyncio.to_thread(plus_one)
        counts = []
        for calls in (20, 20, 100):
            gang_id = await shared_gang_round(controller, serialized, calls)
            counts.append(census(controller))
        return controller, counts, await controller.trace(gang_id)

    controller, (first, second, third), trace = asyncio.run(asyncio.wait_for(scenario(), TIMEOUT))
    # Each round leaves the same few entries (the ids of its gang and attachments, kept
    # to explain them), however many calls it made: 20 calls, then 100.
    assert growth(second, third) == growth(first, second)
    assert len(controller.arrays) == 0 and controller.spans.spans() == []
    assert controller.gangs == {} and not controller._unpinning
    # What is kept of the last gang still traces it: the controller's most recent spans.
    mine = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    assert mine and all(e["cat"] in ("dispatch", "transfer") for e in mine)


def growth(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before | after if after[k] != before[k]}
