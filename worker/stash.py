"""Handing a job's state from a failed gang's surviving slice to the next gang, host to
host, without disk and without the controller in the path.

With data parallelism over slices every slice holds a full replica of the training state.
When one slice fails, a surviving slice's workers still hold the state at the last step
the job recorded (the job keeps that step's input alive until the step completes, see
controller/jobs.py). Each of them copies its pieces of it into a `StateStash` on its own
host: a small Ray actor outside the gang's reservation, so it outlives the gang's workers,
which must go (they hold the devices, and their jax.distributed cluster is broken). The
new gang's workers then read the pieces their devices need straight from the stashes
(PeerRestoreOp: Ray moves the bytes between hosts), and the job goes on from the very step
it had reached: nothing is computed twice.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# (source handle, index key) -> the piece of that array at that index.
PieceKey = tuple[str, tuple[tuple[int, int], ...]]


class StateStash:
    """Host memory for a surviving worker's pieces of a job's state, until the next gang
    has read them (created by `HostWorker.stash_state`; killed by the controller)."""

    def __init__(self) -> None:
        self._pieces: dict[PieceKey, np.ndarray] = {}

    def put(self, pieces: list[tuple[PieceKey, np.ndarray]]) -> int:
        """Keeps pieces; returns the bytes now held."""
        for key, data in pieces:
            self._pieces[key] = data
        return sum(a.nbytes for a in self._pieces.values())

    def keys(self) -> list[PieceKey]:
        return list(self._pieces)

    def get(self, keys: list[PieceKey]) -> list[np.ndarray]:
        """The pieces asked for.

        Raises:
            KeyError: a piece is not held here.
        """
        missing = [k for k in keys if k not in self._pieces]
        if missing:
            raise KeyError(f"{len(missing)} piece(s) are not in this stash, e.g. {missing[0]}")
        return [self._pieces[k] for k in keys]


def stash_options(node_id: str) -> dict[str, Any]:
    """Where a stash runs: on the worker's own host (its pieces never cross the network
    to get there), with no resources, detached from the worker that creates it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {
        "num_cpus": 0,
        "lifetime": "detached",
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
    }
