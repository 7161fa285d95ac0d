"""Fault injection into a running job (`slicewise chaos`, the InjectFault RPC): the
failures recovery exists for, made the way they happen, so that tests, benchmarks and
users can watch a job come back by itself.

- kill-worker: one host's worker process gets SIGKILL (on a real cluster, Ray kills the
  actor). Its control channel closes; the gang fails at once.
- remove-host: the simulated host goes away, raylet and every process on it (`--sim`
  only: on a real cluster, delete the VM).
- hang-collective: one host's executor stops before a step (a HangOp, ops.py) while the
  others go on into the step and wait in its collectives. Nothing closes: the step
  watchdog (controller/health.py) has to notice.
- kill-controller: the controller SIGKILLs itself; a controller started again on the
  same state directory continues the job.

A fault may wait for a step (`at_step`: once the job has completed that many steps); the
job's step loop fires it (controller/jobs.py). Off unless the controller was started with
`--allow-chaos`: it kills processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slicewise.common.errors import FailedPreconditionError, InvalidRequestError

if TYPE_CHECKING:
    from controller.core import Controller
    from controller.gang import Gang

log = logging.getLogger(__name__)

KINDS = ("kill-worker", "remove-host", "hang-collective", "kill-controller")

# A hung host stays hung until its gang is torn down; this only bounds it if nobody does.
HANG_S = 24 * 3600.0


@dataclass
class Fault:
    """A fault to inject into a job: `kind`, on jax.distributed process `process`, once
    the job has completed `at_step` steps (0: as soon as possible)."""

    kind: str
    at_step: int
    process: int
    fired_at: float = 0.0  # time.time() when injected

    def describe(self) -> str:
        what = self.kind if self.kind == "kill-controller" else f"{self.kind} of process "
        if self.kind != "kill-controller":
            what += str(self.process)
        return what + (f" at step {self.at_step}" if self.at_step else " now")


def plan_fault(
    kind: str,
    *,
    at_step: int | None,
    process: int | None,
    num_processes: int,
    step: int,
    steps: int,
    simulated: bool,
    allowed: bool,
    rng: random.Random | None = None,
) -> Fault:
    """Checks a fault request against the job it is for and fills in what was left out.

    Args:
        at_step: inject once the job has completed this many steps; None: now.
        process: the host to hit; None: one at random.
        num_processes, step, steps: the job's gang size, progress and length.
        simulated: the job's gang runs on the embedded simulation.
        allowed: the controller accepts fault injection (--allow-chaos).

    Raises:
        FailedPreconditionError: injection is off, or the fault needs the simulation.
        InvalidRequestError: an unknown kind, a host or step out of range.
    """
    if not allowed:
        raise FailedPreconditionError(
            "fault injection is off on this controller: start it with --allow-chaos "
            "(it kills processes; meant for tests and the simulation)"
        )
    if kind not in KINDS:
        raise InvalidRequestError(f"unknown fault {kind!r}; one of {', '.join(KINDS)}")
    if kind == "remove-host" and not simulated:
        raise FailedPreconditionError(
            "remove-host needs the embedded simulation (--sim); on a real cluster, delete "
            "the host's VM or stop its raylet"
        )
    if process is None:
        process = (rng or random.Random()).randrange(num_processes)
    elif not 0 <= process < num_processes:
        raise InvalidRequestError(
            f"process {process} is not in the job's gang (processes 0..{num_processes - 1})"
        )
    if at_step is None:
        at_step = 0
    elif not step < at_step < steps:
        raise InvalidRequestError(
            f"at_step {at_step} must be after the job's current step ({step}) and before "
            f"its last ({steps})"
        )
    return Fault(kind, at_step, process)


async def fire(fault: Fault, controller: Controller, gang: Gang) -> None:
    """Injects a fault that is not a hang (see `hang`) into `gang`, now."""
    fault.fired_at = time.time()
    log.warning("fault injection: %s (gang %s)", fault.describe(), gang.gang_id)
    if fault.kind == "kill-worker":
        gang.kill_worker(fault.process)
    elif fault.kind == "remove-host":
        simulation = controller.simulation
        if simulation is None:
            raise FailedPreconditionError("remove-host needs the embedded simulation (--sim)")
        s, h = divmod(fault.process, gang.shape.hosts_per_slice)
        await asyncio.to_thread(simulation.remove_host, gang.slices[s].name, h)
    elif fault.kind == "kill-controller":
        # After the reply (or the step record) is on its way: a moment, not a promise.
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGKILL)
    else:
        raise AssertionError(f"{fault.kind} is not fired by fire()")


def hang(fault: Fault, controller: Controller, gang: Gang) -> Any:
    """Queues a HangOp for the fault's host (an empty op for the others) behind what the
    job has queued: that host stops there, the others go on into the next step."""
    fault.fired_at = time.time()
    log.warning("fault injection: %s (gang %s)", fault.describe(), gang.gang_id)
    return controller.inject_hang(gang.gang_id, fault.process, HANG_S)
