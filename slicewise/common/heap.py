"""Keeping Python's cyclic garbage collector off the dispatch path of long-lived
processes (the controller and the workers).

A controller or worker that has loaded jax holds ~160,000-180,000 objects the collector
tracks: modules, functions, jax's and XLA's tables, nearly all of them alive as long as
the process. Every full collection walks all of them: measured on the 2-core simulation
during `slicewise bench dispatch` (OpByOp), one full collection per ~2,000 calls in the
controller took 140-210 ms, 70-104 us per call on average of the controller's ~150-200 us
of CPU per call, and one per ~4,000 calls in each worker took ~80 ms. Frozen
(`gc.freeze`), those objects are no longer walked; the collector then only looks at what
came later (14,000-38,000 objects in the same run, 10-30 ms a full collection).

A process freezes once after each stage that loads a lot for good (jax imported and a
gang formed, the first program compiled, the first program exported...): `settle(stage)`
collects what is garbage now, so that nothing unreachable is frozen, and freezes the
rest. Objects frozen and later dropped are still freed by their reference counts; only
a cycle among them would never be collected, which is why this runs at a few stages and
not after every program. It costs one full collection per stage (~200 ms on the 2-core
simulation; in the controller, a pause of its event loop). Unit tests that run a
controller or a worker runtime inside the test process freeze that process's heap too.

Freezing also makes full collections frequent: Python starts one when the objects that
reached the oldest generation since the last one outnumber a quarter of those it kept
then, and with the heap frozen those are few (~20,000 in the controller). Work queued
lives long enough to reach the oldest generation before it dies by its reference count:
a stream of a thousand calls queues a thousand tickets, each with its records, sets and
callbacks, a dozen objects each. Measured in-process (the controller and a fake gang,
20,000 streamed calls): 6 full collections of 40-45 ms each, 13 of the controller's
~46 us of CPU per call, and none with FULL_EVERY at 100 (35 us per call). So a settled
process makes a full collection wait for FULL_EVERY collections of the middle
generation (700 x 10 x FULL_EVERY allocations net of frees); cycles of garbage, which
the runtime hardly makes, are collected that much later.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

# Collections of the middle generation before a full one may run (Python's default: 10).
FULL_EVERY = 100

_settled: set[str] = set()
_lock = threading.Lock()


def settle(stage: str) -> bool:
    """Collects the garbage and freezes what this process holds, the first time `stage`
    is reached; returns whether it did (False: this stage settled before)."""
    with _lock:
        if stage in _settled:
            return False
        _settled.add(stage)
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)
    log.info(
        "heap settled after %s: %d objects frozen in all, %.0f ms",
        stage,
        gc.get_freeze_count(),
        1e3 * (time.perf_counter() - started),
    )
    return True
