"""Which goes first on a simulated host's cores: its devices, or the work that feeds them.

On a TPU host the chips compute and the host's cores dispatch: the two never compete.
On the simulation the "chips" are XLA:CPU threads on the same few cores as everything
else, so every microsecond a worker spends receiving, launching and reporting an
operation is taken from the computation it feeds, though the cores sit idle about a
third of the time (the devices of two hosts wait on each other's collectives). On the
2-core VM, 70 us of Python spent before each launch made a multi-controller loop of
1.2-ms calls 15% slower, while a 200-us sleep there cost 2%: what matters is whose turn
it is on a core, not how soon a launch comes.

So a simulated host's dispatch threads (the executor that launches operations, the
control channel's receiver and sender) run under SCHED_IDLE: they get a core whenever no
device thread wants one, and a device thread that wakes takes it back at once. Measured
in 8 paired rounds of 600 OpByOp calls of 1.2 ms (2026-12-05, switching the policy of
the same workers' threads between rounds): 1.046 times the calls per second of the
default policy, 7 rounds of 8 faster. The threads whose timing is reported keep the
default policy: the watcher, which notes when a long program finished, and the
heartbeat. The baselines of `benchmarks/` keep it too, as a user's multi-controller
program would (their loop under SCHED_IDLE ran 0.94 times as fast, in the same rounds).

A thread starts under the policy of the thread that starts it: the receiver starts the
heartbeat before it goes idle, and the threads the executor starts run idle too (XLA's
compiler threads, started by the first compile; orbax's writers): they also wait for a
core the devices leave free (a checkpoint's writes among them: not measured since). On a
host whose devices keep every core busy a SCHED_IDLE thread still runs, but rarely, and
the heartbeat needs the interpreter lock the executor may hold when it loses its core:
a beat can be late by as long as the executor waits for one (not measured here; the
controller calls a host silent after ControllerOptions.heartbeat_timeout_s, 10 s).

The controller sets SCHEDULING_ENV only in a simulated host's environment
(controller/hostenv.py); a real TPU host's threads keep the default policy.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

# "idle": the dispatch threads of this process run under SCHED_IDLE; unset: as started.
SCHEDULING_ENV = "SLICEWISE_DISPATCH_SCHED"


def dispatch_thread() -> bool:
    """Puts the calling thread, a dispatch thread, under SCHED_IDLE when this host's
    environment asks for it; returns whether it did. A system that refuses leaves the
    thread as it was (logged once)."""
    if os.environ.get(SCHEDULING_ENV) != "idle" or not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:
        global _refused
        if not _refused:
            _refused = True
            log.warning("dispatch threads keep the default scheduling policy: %s", exc)
        return False
    return True


_refused = False
