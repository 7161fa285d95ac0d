"""What the controller decides about a job's checkpoints: which steps get saved, and
where a (re)started job resumes. The workers write checkpoints (worker/checkpoint.py);
the controller only reads their commit markers (slicewise/common/checkpoints.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from slicewise.common.errors import FailedPreconditionError


def save_steps(first: int, last: int, every: int) -> list[int]:
    """The steps a job that trains from step `first` to `last` saves (a step is the
    number of steps done, so the state saved at step s is the input of step s): every
    `every`-th step, and the last one; none when `every` is 0. As many as there are:
    `SavePlan` answers for a job of any length without listing them."""
    if every <= 0 or first >= last:
        return []
    steps = list(range((first // every + 1) * every, last + 1, every))
    return steps if steps and steps[-1] == last else [*steps, last]


@dataclass(frozen=True)
class SavePlan:
    """`save_steps(first, last, every)` less the steps in `held`, as a set that is never
    listed: a job may be 2**63 - 1 steps long."""

    first: int
    last: int
    every: int
    held: frozenset[int] = frozenset()

    def __contains__(self, step: object) -> bool:
        return (
            isinstance(step, int)
            and self.every > 0
            and self.first < step <= self.last
            and (step % self.every == 0 or step == self.last)
            and step not in self.held
        )

    def __bool__(self) -> bool:
        if self.every <= 0 or self.first >= self.last:
            return False
        planned = self.last // self.every - self.first // self.every + (self.last % self.every > 0)
        # More steps planned than held: one is not held. Else few enough to list.
        return planned > len(self.held) or any(
            s not in self.held for s in save_steps(self.first, self.last, self.every)
        )


def resume_step(
    committed: Iterable[int],
    journalled: int | None,
    steps: int,
    recorded: int | None = None,
) -> int | None:
    """Where a job of `steps` steps starts: the newest committed step in storage that is
    not past its end (None: from the initial state). A job that was interrupted gives
    `recorded`, the steps whose metrics it has recorded: it prefers a step no later than
    that (the steps after it run again, and record their metrics), and takes a later one
    only when storage holds nothing earlier (retention may have deleted it).

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
    if recorded is not None and any(s <= recorded for s in held):
        return max(s for s in held if s <= recorded)
    return held[-1] if held else None


def yield_save(reached: int, saved: Iterable[int]) -> int | None:
    """The step a job told to yield saves before it lets go of its gang: the step it has
    reached (its state is the input of that step), unless that is the initial state or
    a save of it is queued or committed already (None: nothing to save)."""
    if reached <= 0 or reached in set(saved):
        return None
    return reached
