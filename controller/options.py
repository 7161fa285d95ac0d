"""The controller's tunables in one place: set once from the `slicewise controller` flags
(or by a test), validated on creation, and handed to the parts that use them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ControllerOptions:
    """How a controller runs its gangs, dispatch and jobs.

    Attributes:
        worker_window: programs in flight per host before the executor waits for the
            oldest (XLA:CPU with gloo slows down and can hang with dozens in flight).
        preemption_grace_s: time a preempted gang's holder gets to save its work.
        exclusive_in_flight: operations numbered ahead of their completion on a gang with
            one client: many, so that a chain of calls goes out as one batch.
        shared_in_flight: the same on a shared gang: fewer, since numbering late is what
            lets each client's work interleave by its weight.
        allocate_timeout_s: how long an allocation waits when its caller gives no timeout.
        gang_start_timeout_s: reserving a gang's hosts and forming its cluster.
        reserve_attempts: reservations that lose a slice mid-way are retried this often.
        inventory_period_s: how often the Ray node table is read.
        fetch_timeout_s: how long a fetch waits when its caller gives no timeout.
        steps_ahead: steps a training job queues beyond the last one it has read.
        heartbeat_timeout_s: a worker that sends nothing (not even its heartbeat, every
            half second) for this long has stopped answering: its gang fails.
        step_timeout_s: the least time a training step may stall on a worker before its
            gang fails as stuck (the deadline is 10x the job's slowest step, if more).
        allow_chaos: accept fault injection (`slicewise chaos`), which kills processes.
        compilation_cache_dir: where the workers keep compiled programs ("": nowhere):
            a gang started again after a failure loads its programs from it instead of
            compiling them again (seconds of a restart on CPU; minutes for a large model
            on TPU). A filesystem path on every host (each worker keeps its own
            executables there, see worker/executables.py); on TPU, also JAX's
            persistent compilation cache.
        direct_transfer_ttl_s: how long a client's direct put or fetch (one hop between
            client and workers) may take: its capabilities expire then, and what it left
            unfinished on the workers (staged pieces, a pin) is dropped.
        data_roots: the directories jobs may read data from (controller/dataroots.py);
            () allows only the "stdlib" corpus, None every path (--insecure-local).
    """

    worker_window: int = 3
    preemption_grace_s: float = 30.0
    exclusive_in_flight: int = 256
    shared_in_flight: int = 32
    allocate_timeout_s: float = 600.0
    gang_start_timeout_s: float = 240.0
    reserve_attempts: int = 3
    inventory_period_s: float = 1.0
    fetch_timeout_s: float = 600.0
    steps_ahead: int = 4
    heartbeat_timeout_s: float = 10.0
    step_timeout_s: float = 20.0
    allow_chaos: bool = False
    compilation_cache_dir: str = ""
    direct_transfer_ttl_s: float = 300.0
    data_roots: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in _COUNTS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        for name in _DURATIONS:
            if not getattr(self, name) > 0:  # NaN fails this too
                raise ValueError(
                    f"{name} must be a positive number of seconds, got {getattr(self, name)!r}"
                )
        if not self.preemption_grace_s >= 0:
            raise ValueError(
                f"preemption_grace_s must be 0 or more seconds, got {self.preemption_grace_s!r}"
            )


_COUNTS = (
    "worker_window",
    "exclusive_in_flight",
    "shared_in_flight",
    "reserve_attempts",
    "steps_ahead",
)
_DURATIONS = (
    "allocate_timeout_s",
    "gang_start_timeout_s",
    "inventory_period_s",
    "fetch_timeout_s",
    "heartbeat_timeout_s",
    "step_timeout_s",
    "direct_transfer_ttl_s",
)


# Frozen, so one instance can be every default.
DEFAULT_OPTIONS = ControllerOptions()
