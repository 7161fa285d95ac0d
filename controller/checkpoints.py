"""What the controller knows of a job's checkpoints: which steps get saved, which are
committed in storage, and where a (re)started job resumes.

The workers write checkpoints (worker/checkpoint.py); the controller only reads the
commit markers. A committed step is a directory `<dir>/<step>` holding
`commit_success.txt` (orbax writes the marker last, then renames the temporary
directory into place; on a bucket the marker itself is the commit). The checkpoint
directory is shared storage, a local directory in the simulation and a bucket on real
clusters, so the controller reads it directly through etils' `epath`, which speaks both.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from etils import epath

from slicewise.common.errors import FailedPreconditionError

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


def save_steps(first: int, last: int, every: int) -> list[int]:
    """The steps a job that trains from step `first` to `last` saves (a step is the
    number of steps done, so the state saved at step s is the input of step s): every
    `every`-th step, and the last one; none when `every` is 0."""
    if every <= 0:
        return []
    return [s for s in range(first + 1, last + 1) if s % every == 0 or s == last]


def resume_step(committed: Iterable[int], journalled: int | None, steps: int) -> int | None:
    """Where a job of `steps` steps starts: the newest committed step in storage that is
    not past its end (None: from the initial state).

    Raises:
        FailedPreconditionError: the journal names a committed step that storage no
            longer holds: something deleted it, and resuming from an older one would
            silently redo work the user was told was done.
    """
    held = sorted(s for s in committed if s <= steps)
    if journalled is not None and journalled <= steps and journalled not in held:
        raise FailedPreconditionError(
            f"the journal records checkpoint step {journalled} as committed, but its "
            f"directory no longer holds it (committed there: {held or 'none'})"
        )
    return held[-1] if held else None
