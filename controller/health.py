"""How the controller tells that a gang's worker is gone, stopped or stuck.

A worker process that dies closes its control channel, and the dispatcher notices at
once. Two failures close nothing, and multi-controller JAX waits forever on both (jax
issue 38503):

- a worker, or its whole host, that stops answering: no frame arrives on its control
  channel, although every worker sends a heartbeat every half second
  (worker/channel.py);
- a collective that never completes: one host is stuck (in a collective, or before it)
  while the others wait in it. Every host's heartbeat says which operation it has held
  the longest without completing it, and for how long it has completed nothing. When
  that stall passes the gang's step deadline (set by the job that runs on it, from its
  own step times), the gang fails, naming the host that is behind.

  A host that is behind its peers is told apart sooner, at the gang's lag deadline (a
  few seconds): it has held a step its peers completed, and completed nothing since,
  while they wait in the next step's collectives, for which they need it. A step is
  one program for every host, so the hosts of a healthy gang are never a whole step
  apart for long: the peers could not have completed the step without the laggard in
  its collectives, and what the laggard has left of it after the last one is a
  fraction of a step. A slow step keeps every host in the same one (the step deadline
  judges it), a compile stops all judging, and a host behind on anything but a step
  (a checkpoint save, a copy) is left to the step deadline.

`diagnose` is the judgement, a pure function of what the heartbeats said; `Gang` runs it
every `WATCH_PERIOD_S` while it is usable. When a gang fails, `raylet_answers` tells
whether its hosts are still there (admission.py marks the ones that are not as lost, so
no new gang is placed on them while Ray has not noticed yet).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

# How often a gang looks at its workers' heartbeats.
WATCH_PERIOD_S = 0.25

# Operations that may rightly take long with nothing completing: reading a checkpoint,
# waiting for one to commit, loading a program. A host compiling a program (its first
# call) says so in its heartbeat, and no stall counts while one does: the others wait for
# it in the first collective.
UNWATCHED_KINDS = frozenset({"restore", "closecheckpoints", "load"})

# The operations a host may be caught behind on by the lag deadline: a program's call (and
# the chaos hang, which stands in for a host stuck before one).
LAG_KINDS = frozenset({"exec", "hang"})

# The lag deadline never goes below this, whatever the steps take: a host descheduled for
# a moment on a loaded machine is no fault. A hang costs this much before its recovery
# begins (a quarter of the faults of `slicewise bench soak` are hangs; it was 3 s until
# the soak's other costs came down); a program's first call (a compile or a load),
# saves and restores are never judged by it, only a host behind its peers in ordinary
# steps.
LAG_FLOOR_S = 2.0


@dataclass(frozen=True)
class HostReport:
    """What the controller knows of one worker from its control channel.

    Attributes:
        name: the host, in words ("host 0 of slice sim-1-v5litepod-4").
        silent_s: seconds since anything arrived from its worker.
        oldest_seq: the oldest operation the worker holds and has not completed (0: none).
        oldest_kind: that operation's type ("exec", "save", "hang", ...).
        stalled_s: seconds the worker has completed nothing while holding work.
        compiling: the program it is compiling, if any.
    """

    name: str
    silent_s: float
    oldest_seq: int = 0
    oldest_kind: str = ""
    stalled_s: float = 0.0
    compiling: str = ""


def lag_deadline(slowest_step_s: float) -> float:
    """How long a host may stay a step behind its waiting peers before its gang fails:
    3x the job's slowest step so far, never less than `LAG_FLOOR_S`."""
    return max(LAG_FLOOR_S, 3.0 * slowest_step_s)


def holding_up(hosts: Sequence[HostReport]) -> str:
    """Which hosts the others wait for, in words, for a job whose step is late: those
    compiling, else those behind their peers on an older operation; "" when every busy
    host is on the same one (or none is busy)."""
    compiling = [h for h in hosts if h.compiling]
    if compiling:
        return ", ".join(f"{h.name} compiling {h.compiling}" for h in compiling)
    busy = [h for h in hosts if h.oldest_seq]
    if not busy:
        return ""
    behind = min(h.oldest_seq for h in busy)
    laggards = [h for h in busy if h.oldest_seq == behind]
    if len(laggards) == len(busy):
        return ""
    names = ", ".join(h.name for h in laggards)
    return f"{names} not done with it ({len(busy) - len(laggards)} other host(s) waiting)"


def diagnose(
    hosts: Sequence[HostReport],
    *,
    heartbeat_timeout_s: float,
    step_deadline_s: float | None,
    lag_deadline_s: float | None = None,
) -> str | None:
    """Why the gang must fail now, or None while every host is answering and moving.

    Args:
        hosts: one report per worker of the gang.
        heartbeat_timeout_s: a worker silent this long has stopped answering.
        step_deadline_s: a stall this long is a stuck collective; None: stalls are not
            judged (a client's gang, whose programs may run as long as they like).
        lag_deadline_s: a host behind on a step this long, while its peers wait for it
            as long in a later one, is stuck (see the module's docstring); None: only
            the step deadline judges stalls.
    """
    silent = [h for h in hosts if h.silent_s > heartbeat_timeout_s]
    if silent:
        quietest = max(silent, key=lambda h: h.silent_s)
        others = f" (and {len(silent) - 1} more)" if len(silent) > 1 else ""
        return (
            f"{quietest.name}{others} stopped answering: nothing heard from its worker for "
            f"{quietest.silent_s:.1f} s (limit {heartbeat_timeout_s:g} s, "
            "--heartbeat-timeout): the process is hung or stopped, or its host is unreachable"
        )
    if step_deadline_s is None or any(h.compiling for h in hosts):
        return None
    busy = [h for h in hosts if h.oldest_seq]
    if not busy:
        return None
    behind = min(h.oldest_seq for h in busy)
    laggards = [h for h in busy if h.oldest_seq == behind]
    waiting = [h for h in busy if h.oldest_seq != behind]
    first = laggards[0]
    lagging = (
        lag_deadline_s is not None
        and waiting
        and all(h.oldest_kind in LAG_KINDS for h in busy)
        and min(h.stalled_s for h in busy) > lag_deadline_s
    )
    stuck = [h for h in busy if h.oldest_kind not in UNWATCHED_KINDS]
    if lagging:
        limit = (
            f"limit {lag_deadline_s:.1f} s for a host behind its peers: 3x the slowest "
            f"step, at least {LAG_FLOOR_S:g} s"
        )
    elif any(h.stalled_s > step_deadline_s for h in stuck):
        limit = f"limit {step_deadline_s:.1f} s, --step-timeout"
    else:
        return None
    if not waiting:
        return (
            f"op {behind} ({first.oldest_kind}) has not completed on any of the "
            f"{len(laggards)} host(s) working on it for {max(h.stalled_s for h in laggards):.1f} s "
            f"({limit}): a collective that never completes"
        )
    names = ", ".join(h.name for h in laggards)
    ahead = min(h.oldest_seq for h in waiting)
    kind = next(h.oldest_kind for h in waiting if h.oldest_seq == ahead)
    return (
        f"a collective is stuck on {names}: stuck at op {behind} ({first.oldest_kind}) for "
        f"{first.stalled_s:.1f} s while {len(waiting)} other host(s) wait in op {ahead} "
        f"({kind}) ({limit})"
    )


def raylet_answers(address: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a host's raylet accepts a connection: when a worker's channel closes,
    this tells a dead process (the raylet answers) from a lost host (it does not),
    seconds before Ray's own health checks mark the node dead. Unknown: True."""
    if not address or not port:
        return True
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False
