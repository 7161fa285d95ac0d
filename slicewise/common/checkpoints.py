"""The layout of a committed checkpoint step in storage, which the workers write
(worker/checkpoint.py) and the controller reads (controller/checkpoints.py).

A committed step is a directory `<dir>/<step>` holding `commit_success.txt`: orbax writes
the marker last, then renames the temporary directory into place; on a bucket the marker
itself is the commit. A partial save is therefore never taken for a step. The directory
is shared storage (a local directory in the simulation, a bucket on real clusters), read
through etils' `epath`, which speaks both.
"""

from __future__ import annotations

import os

from etils import epath

# orbax's marker of a committed step (orbax.checkpoint.path.atomicity_types).
COMMIT_FILE = "commit_success.txt"


def is_committed(directory: str | os.PathLike[str], step: int) -> bool:
    """Whether `step` is committed in `directory`: its marker is in storage."""
    return bool((epath.Path(directory) / str(step) / COMMIT_FILE).exists())


def committed_steps(directory: str | os.PathLike[str]) -> list[int]:
    """The committed steps in `directory`, oldest first (partial saves are not listed;
    a directory that does not exist holds none)."""
    root = epath.Path(directory)
    if not root.exists():
        return []
    steps = []
    for child in root.iterdir():
        if child.name.isdigit() and (child / COMMIT_FILE).exists():
            steps.append(int(child.name))
    return sorted(steps)
