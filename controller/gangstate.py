"""The gang life cycle: its states, the table of allowed transitions, and what a client
is told when it uses a gang that cannot run work. Pure; `Gang.transition` (gang.py) is
the one place that changes a gang's state, along this table:

    QUEUED     -> STARTING | FAILED | STOPPING    start | allocation gave up | release
    STARTING   -> READY | STOPPING                formed | rolled back (on to QUEUED)
    READY      -> PREEMPTING | STOPPING | FAILED  preempt notice | stop | a worker died
    PREEMPTING -> STOPPING | FAILED               yielded, grace over | a worker died
    STOPPING   -> QUEUED | PREEMPTED | FAILED | RELEASED   wherever the stop leads
    PREEMPTED  -> STARTING | STOPPING | FAILED    resume | release | could not resume
    FAILED     -> STOPPING                        stop its workers (stays FAILED), release
    RELEASED   -> nothing: final

Only READY and PREEMPTING gangs run work. STOPPING covers the window in which the
dispatcher is closed and the workers are being stopped, so that nothing submitted then
reaches a closed dispatcher. Each start bumps the gang's epoch; changes reported from an
older epoch (a dispatcher of an earlier start reporting a failure) are ignored.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controller.gang import Gang


class GangState(enum.Enum):
    """Where a gang is in its life cycle (see the table above)."""

    # Admitted or waiting to be, not started: before its first start, or after a start
    # that was rolled back.
    QUEUED = "queued"
    # Reserving its slices, starting its workers, forming the jax.distributed cluster.
    STARTING = "starting"
    READY = "ready"
    # Told to make room for a higher-priority request; still running until it yields or
    # its grace period ends.
    PREEMPTING = "preempting"
    # Dispatch closed, workers being stopped: nothing runs any more.
    STOPPING = "stopping"
    # Workers stopped by preemption; queued to resume on new workers.
    PREEMPTED = "preempted"
    # A worker died, or the gang could not resume: its owner must release it.
    FAILED = "failed"
    RELEASED = "released"

    @property
    def usable(self) -> bool:
        """Whether work may be submitted to a gang in this state."""
        return self in (GangState.READY, GangState.PREEMPTING)


TRANSITIONS: dict[GangState, frozenset[GangState]] = {
    GangState.QUEUED: frozenset({GangState.STARTING, GangState.FAILED, GangState.STOPPING}),
    GangState.STARTING: frozenset({GangState.READY, GangState.STOPPING}),
    GangState.READY: frozenset({GangState.PREEMPTING, GangState.STOPPING, GangState.FAILED}),
    GangState.PREEMPTING: frozenset({GangState.STOPPING, GangState.FAILED}),
    GangState.STOPPING: frozenset(
        {GangState.QUEUED, GangState.PREEMPTED, GangState.FAILED, GangState.RELEASED}
    ),
    GangState.PREEMPTED: frozenset({GangState.STARTING, GangState.STOPPING, GangState.FAILED}),
    GangState.FAILED: frozenset({GangState.STOPPING}),
    GangState.RELEASED: frozenset(),
}

_ARRAYS_GONE = "its arrays are gone: upload them again once it is back"


def why_unusable(gang: Gang, name: str, position: int | None) -> str | None:
    """The sentence a client reads when it uses `gang` (as `name`, e.g. `g3-...@a1`) and the
    gang cannot run work now, saying what to do; None when it can. `position` is the
    gang's place in the admission queue, if it is queued."""
    state, to = gang.state, gang.stopping_to
    if state.usable:
        return None
    where = f" (queue position {position})" if position is not None else ""
    if state is GangState.FAILED or to is GangState.FAILED:
        return f"gang {name} failed ({gang.why}); release it and allocate a new one"
    if to is GangState.RELEASED:
        return f"gang {name} {gang.why}; allocate a new gang to run more work"
    if to is GangState.PREEMPTED:
        return (
            f"gang {name} is being preempted by {gang.preempted_by}: its workers are "
            f"stopping, and it is queued to resume on new workers{where}; {_ARRAYS_GONE}"
        )
    if state is GangState.PREEMPTED:
        return (
            f"gang {name} was preempted by {gang.preempted_by} and is queued to resume"
            f"{where}; {_ARRAYS_GONE}"
        )
    if gang.preempted_by:  # starting again, or rolling back a start that failed
        return (
            f"gang {name} was preempted by {gang.preempted_by} and is starting again on new "
            f"workers; try again in a moment ({_ARRAYS_GONE})"
        )
    return f"gang {name} is still being allocated; use it once its allocation returns"
