"""Checkpoint I/O of one job on one host: orbax-checkpoint's CheckpointManager, used the
same way by every worker process of a gang, each writing only its own shards.

The commit protocol relied on (orbax-checkpoint 0.12.8, paths under
`orbax/checkpoint/`):

- `CheckpointManager.save` (`checkpoint_manager.py`) copies the arrays to host memory
  and returns; a "save_finalize" thread then waits for the writes. On a POSIX path the
  step is written into `<step>.orbax-checkpoint-tmp`; once every process has written its
  shards (barrier "async_write_complete", `_src/checkpointers/async_checkpointer.py`),
  the primary process writes `commit_success.txt` into it and renames it to `<step>`
  (`AtomicRenameTemporaryPath.finalize`, `_src/path/atomicity.py`); the others wait at
  "async_commit_complete". On a bucket (gs://) the step is written in place and
  `commit_success.txt` is the commit (`CommitFileTemporaryPath`). Either way a committed
  step is a directory named `<step>` that holds `commit_success.txt`.
- The manager's own step list is not a commit record: it names a step as soon as its
  save starts, and in rename mode it takes any `<step>` directory for finalized
  (`validate_final` checks only the name). So committed steps are read from storage and
  must hold the marker; a restore is refused for anything else.
- Barriers: with `active_processes` unset, orbax's foreground barriers are
  `multihost_utils.sync_global_devices`, an XLA collective over every device. Naming
  all processes routes every barrier through the jax.distributed coordination service
  (`get_barrier_sync_fn`, `_src/multihost/multihost.py`), so checkpoint I/O puts no
  collective into the gang's device stream; it also means orbax will not create the
  root directory (`create=True` is refused), so it is made here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent import futures
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_managers import (
    AnyPreservationPolicy,
    LatestN,
    PolicyCheckpointInfo,
    PreservationContext,
)

from slicewise.common import checkpoints as stored


class UncommittedStepError(LookupError):
    """A restore asked for a step that is not committed in the checkpoint directory."""

    def __str__(self) -> str:  # LookupError would quote the message like a dict key
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass
class _MarkedSteps:
    """Preservation policy: keep the steps in a set that may grow while the job runs."""

    steps: set[int]

    def should_preserve(
        self, checkpoints: Sequence[PolicyCheckpointInfo], *, context: PreservationContext
    ) -> Sequence[bool]:
        return [info.step in self.steps for info in checkpoints]


class HostCheckpointer:
    """One process's handle on a job's checkpoint directory.

    Every process of the gang constructs it and calls `save`, `restore` and `close` with
    the same arguments in the same order (they contain barriers); the queries are local.
    One thread uses it at a time.

    Args:
        directory: the job's checkpoint directory (a local path or a bucket URL).
        max_to_keep: how many of the newest steps to keep; None keeps all.
        keep_steps: steps kept whatever `max_to_keep` says (see `keep`).
        barrier_prefix: makes barrier names unique to this job and epoch, for when
            another checkpointer shares the jax.distributed cluster.
        commit_timeout_s: how long the background commit may take before it fails.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        keep_steps: Iterable[int] = (),
        barrier_prefix: str | None = None,
        commit_timeout_s: int = 1200,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
        self.directory = epath.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._keep = {int(s) for s in keep_steps}
        options = ocp.CheckpointManagerOptions(
            preservation_policy=AnyPreservationPolicy(
                [LatestN(n=max_to_keep), _MarkedSteps(self._keep)]
            ),
            create=False,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(timeout_secs=commit_timeout_s),
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=0,
                active_processes=set(range(jax.process_count())),
                barrier_sync_key_prefix=barrier_prefix,
            ),
        )
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "meta"), options=options
        )
        # Completes when the manager's save_finalize thread for that step has ended.
        self._watcher = futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit")
        self._pending: tuple[int, futures.Future[None]] | None = None

    # -- saving ----------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
        """Starts an asynchronous save of `state` (a pytree of jax.Arrays) and `meta`
        (JSON-able: the data position and whatever else a resume needs) at `step`.

        Returns once the arrays are copied to host memory, so their buffers may then
        be donated or deleted; the commit goes on in the background. A save still in
        flight is waited for first. If the previous save failed, its error is raised
        here (orbax reports a failed background commit on the next call) and nothing is
        saved; calling again saves.
        """
        meta = json.loads(json.dumps(dict(meta)))  # fail here, not in the background
        if self._pending is not None:
            futures.wait([self._pending[1]])
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self._pending = (step, self._watcher.submit(self._manager.wait_until_finished))

    def keep(self, step: int) -> None:
        """Marks `step` to be kept forever. Applies from the next save on (that is when
        old steps are chosen for deletion); a step already deleted stays deleted. The
        marks live in memory: whoever journals them passes them back as `keep_steps`."""
        self._keep.add(int(step))

    @property
    def in_flight(self) -> int | None:
        """The step whose save has neither committed nor failed yet, if any."""
        if self._pending is None or self._pending[1].done():
            return None
        return self._pending[0]

    def wait_until_committed(self, timeout: float | None) -> int | None:
        """Blocks until the last save has committed and returns its step (None when
        nothing was saved since the last wait).

        Raises:
            TimeoutError: the save is still running after `timeout` seconds.
            Exception: the save failed; its step is not committed.
        """
        if self._pending is None:
            return None
        step, done = self._pending
        if not futures.wait([done], timeout).done:
            raise TimeoutError(f"checkpoint step {step} not committed after {timeout} s")
        self._pending = None
        done.result()
        return step

    # -- what storage holds ----------------------------------------------------------

    def is_committed(self, step: int) -> bool:
        """Whether `step` is committed in storage, without blocking on a save.

        Raises:
            Exception: the save of `step` failed.
        """
        if self._pending is not None and self._pending[0] == step:
            done = self._pending[1]
            error = done.exception() if done.done() else None
            if error is not None:
                raise error
        return stored.is_committed(self.directory, step)

    def committed_steps(self) -> list[int]:
        """The committed steps in storage, oldest first; partial saves are not listed."""
        return stored.committed_steps(self.directory)

    def latest_committed_step(self) -> int | None:
        """The newest committed step in storage (None when there is none): where a
        resume starts."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    # -- restoring -------------------------------------------------------------------

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """Reads committed `step` onto `target` and returns (state, meta).

        `target` is a pytree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`
        mirroring the saved state; the arrays come back with those shardings, which may
        lay out the devices of another mesh shape than the one that saved them.

        Raises:
            UncommittedStepError: `step` is not committed.
            ValueError: a leaf of `target` has no sharding.
        """
        for path, leaf in jax.tree_util.tree_leaves_with_path(target):
            if getattr(leaf, "sharding", None) is None:
                where = jax.tree_util.keystr(path)
                raise ValueError(f"restore target leaf {where} has no sharding: {leaf!r}")
        if not self.is_committed(step):
            raise UncommittedStepError(
                f"checkpoint step {step} is not committed in {self.directory}; "
                f"committed steps: {self.committed_steps()}"
            )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], dict(restored["meta"])

    def close(self, timeout: float | None = None) -> None:
        """Waits for the save in flight, then closes the manager.

        Raises:
            TimeoutError: the save is still running after `timeout` s; nothing is closed.
            Exception: the save failed (the manager's close raises it again).
        """
        if self._pending is not None and not futures.wait([self._pending[1]], timeout).done:
            raise TimeoutError(f"checkpoint step {self._pending[0]} still saving at close")
        self._pending = None
        try:
            self._manager.close()
        finally:
            self._watcher.shutdown()
