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
- Between the two barriers, on the primary process, orbax calls
  `AsyncOptions.post_finalization_callback`: every shard is written then and only the
  commit is left. The failpoint `save_commit_delay_s` holds saves there (of steps from
  `save_commit_delay_from_step` on), so a test can kill a gang while a save is in flight.

Even the part of orbax's `save` that returns before the commit takes tens of ms per
save (copying each array to host memory, a handful of barrier round trips, a new event
loop and threads), so the worker runs it on a thread of its own (`QueuedCheckpointer`)
and its executor goes on to the next step at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
import traceback
from collections import deque
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
from slicewise.common.failpoints import failpoint

log = logging.getLogger(__name__)


# Replica-parallel saving (orbax's default off GPU) splits each replicated array among
# its replicas, so that every host copies a part of it to host memory: one eager
# `lax.slice_in_dim` per array shape, compiled anew in each worker process. A new gang's
# first save paid 1.1-1.5 s for the LM's 38 small arrays here (2 cores), a stall of the
# whole gang after every recovery; below this size a part copies in well under a
# millisecond, so one replica copies the array whole, as orbax does on GPU.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20


def _array_handler() -> Any:
    """orbax's jax.Array handler, replica-parallel for the parts of at least
    `REPLICA_PARALLEL_MIN_BYTES` only; the per-array metadata it writes by default."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    return ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES,
        array_metadata_store=array_metadata_store.Store(),
    )


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
        self._newest = LatestN(n=_checked_max_to_keep(max_to_keep))
        self.directory = epath.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._keep = {int(s) for s in keep_steps}
        processes = ocp.options.MultiprocessingOptions(
            primary_host=0,
            active_processes=set(range(jax.process_count())),
            barrier_sync_key_prefix=barrier_prefix,
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=AnyPreservationPolicy([self._newest, _MarkedSteps(self._keep)]),
            create=False,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(
                timeout_secs=commit_timeout_s, post_finalization_callback=self._before_commit
            ),
            multiprocessing_options=processes,
        )
        # zstd (orbax's default) saves ~8% of the bytes of trained float state and costs
        # ~60 ms of CPU per 38 MB saved, CPU the training step needs. Each array's zarr
        # metadata names its compressor, so steps saved compressed still restore.
        state = ocp.PyTreeCheckpointHandler(
            use_compression=False,
            multiprocessing_options=processes,
            type_handler_registry=ocp.type_handlers.create_type_handler_registry(
                (jax.Array, _array_handler())
            ),
        )
        meta = ocp.JsonCheckpointHandler(multiprocessing_options=processes)
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, handler, args in (
            ("state", state, (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)),
            ("meta", meta, (ocp.args.JsonSave, ocp.args.JsonRestore)),
        ):
            for arg in args:
                registry.add(item, arg, handler)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=registry
        )
        # Completes when the manager's save_finalize thread for that step has ended.
        self._watcher = futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-commit")
        self._pending: tuple[int, futures.Future[None]] | None = None
        self._saving = -1  # the step of the newest save started

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
        self._saving = step
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._pending = (step, self._watcher.submit(self._manager.wait_until_finished))

    def _before_commit(self) -> None:
        """Runs on the primary process when every process has written its shards of the
        save in flight and only its commit is left (the failpoint's place)."""
        delay = failpoint("save_commit_delay_s")
        if not delay or self._saving < failpoint("save_commit_delay_from_step"):
            return
        log.warning(
            "checkpoint step %d: failpoint: holding its commit for %g s in %s",
            self._saving,
            delay,
            self.directory,
        )
        # Until the time is up or the test clears the failpoint, whichever comes first.
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and failpoint("save_commit_delay_s"):
            time.sleep(0.05)
        log.warning("checkpoint step %d: failpoint: commit released", self._saving)

    def keep(self, step: int) -> None:
        """Marks `step` to be kept forever. Applies from the next save on (that is when
        old steps are chosen for deletion); a step already deleted stays deleted. The
        marks live in memory: whoever journals them passes them back as `keep_steps`."""
        self._keep.add(int(step))

    def keep_newest(self, max_to_keep: int | None) -> None:
        """Keeps the newest `max_to_keep` steps (None: all) from the next save on."""
        self._newest.n = _checked_max_to_keep(max_to_keep)

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
                state=ocp.args.PyTreeRestore(
                    target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
                ),
                meta=ocp.args.JsonRestore(),
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


def _checked_max_to_keep(max_to_keep: int | None) -> int | None:
    if max_to_keep is not None and max_to_keep < 1:
        raise ValueError(f"max_to_keep must be at least 1 or None, got {max_to_keep}")
    return max_to_keep


class SaveFailedError(RuntimeError):
    """A save queued to a QueuedCheckpointer failed: that step is not committed, and the
    directory takes no more saves from this process."""


@dataclasses.dataclass
class _Queued:
    """A save queued to a QueuedCheckpointer, as its caller sees it."""

    step: int
    max_to_keep: int | None  # the retention the save applies
    keep_steps: tuple[int, ...]
    copied: threading.Event  # the arrays are in host memory (or the save failed first)
    done: futures.Future[None]  # committed, or failed


class QueuedCheckpointer:
    """A HostCheckpointer whose saves run on a thread of their own, in the order they
    were queued, so that the thread queueing them (the worker's executor) goes straight
    on instead of waiting in orbax's `save`.

    Every process of the gang queues the same saves in the same order and runs them in
    that order, one at a time, so orbax's barriers meet. A queued save holds its arrays
    until orbax has copied them to host memory: dropping other references to them is
    safe meanwhile, deleting or donating their buffers is not.

    A failed save is raised (as SaveFailedError) by the next call, and by every call
    after it: the processes may disagree now on which saves ran, so the directory takes
    no more saves from this process (a restart opens it again), and saves queued behind
    the failed one are not run.

    Args:
        checkpointer: the directory's HostCheckpointer, owned by this object from now on.
    """

    def __init__(self, checkpointer: HostCheckpointer) -> None:
        self.checkpointer = checkpointer
        self._queue: queue.SimpleQueue[tuple[_Queued, Any, dict[str, Any]] | None] = (
            queue.SimpleQueue()
        )
        self._queued: deque[_Queued] = deque()  # not yet known to have committed
        self._failed: tuple[int, BaseException] | None = None  # the first failed save
        self._broken: int | None = None  # the same save's step, as the thread saw it
        self.saves = 0  # saves queued so far
        # A daemon: a save stuck in a barrier of a gang that is gone must not hold up exit.
        self._thread = threading.Thread(target=self._run, name="checkpoint-save", daemon=True)
        self._thread.start()

    @property
    def directory(self) -> epath.Path:
        return self.checkpointer.directory

    def save(
        self,
        step: int,
        state: Any,
        meta: Mapping[str, Any],
        *,
        max_to_keep: int | None = None,
        keep_steps: Iterable[int] = (),
        wait_for_copy: bool = False,
    ) -> None:
        """Queues a save of `state` (a pytree of jax.Arrays) and `meta` (JSON-able) at
        `step` and returns at once, unless the save queued before it has not yet copied
        its arrays (it waits for the commit before it): then it waits for that first, so
        that at most one queued state is held. With `wait_for_copy`, it returns only once
        this save's arrays are in host memory (the commit still goes on behind).

        Args:
            max_to_keep: how many of the newest steps to keep from this save on (None:
                all), as `HostCheckpointer.keep_newest`.
            keep_steps: steps to keep besides, as `HostCheckpointer.keep`.

        Raises:
            SaveFailedError: an earlier save failed; this one is not queued.
        """
        plain: dict[str, Any] = json.loads(json.dumps(dict(meta)))  # fail here, not later
        max_to_keep = _checked_max_to_keep(max_to_keep)
        if self._queued:
            self._queued[-1].copied.wait()
        self._raise_failed()
        queued = _Queued(step, max_to_keep, tuple(keep_steps), threading.Event(), futures.Future())
        self._queued.append(queued)
        self._queue.put((queued, state, plain))
        self.saves += 1
        if wait_for_copy:
            queued.copied.wait()

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """Waits until the queued saves have committed, then restores `step` (see
        `HostCheckpointer.restore`, which says what else it raises).

        Raises:
            SaveFailedError: a save failed.
        """
        self._wait(None)
        return self.checkpointer.restore(step, target)

    def close(self, timeout: float | None = None) -> None:
        """Waits until the queued saves have committed, then closes the HostCheckpointer.

        Raises:
            TimeoutError: a save has not committed after `timeout` s; nothing is closed.
            SaveFailedError: a save failed (the HostCheckpointer is closed all the same).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._wait(timeout)
        except SaveFailedError:
            self._stop(deadline)
            raise
        self._stop(deadline, check=True)

    def _stop(self, deadline: float | None, *, check: bool = False) -> None:
        self._queue.put(None)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            self.checkpointer.close(left)
        except Exception:
            if check:
                raise
            log.exception("closing %s after a failed save", self.directory)

    def _wait(self, timeout: float | None) -> None:
        """Waits until every queued save has committed, then raises the first failure.

        Raises:
            TimeoutError: a save has not committed after `timeout` s.
            SaveFailedError: a save failed.
        """
        waiting = futures.wait([q.done for q in self._queued], timeout).not_done
        if waiting:
            step = next(q.step for q in self._queued if q.done in waiting)
            raise TimeoutError(f"checkpoint step {step} not committed after {timeout} s")
        self._raise_failed()

    def _raise_failed(self) -> None:
        while self._queued and self._queued[0].done.done():
            queued = self._queued.popleft()
            error = queued.done.exception()
            if error is not None and self._failed is None:
                self._failed = (queued.step, error)
        if self._failed is not None:
            step, error = self._failed
            raise SaveFailedError(
                f"checkpoint step {step} was not saved in {self.directory}: "
                f"{type(error).__name__}: {error}"
            ) from error

    def _run(self) -> None:
        while self._save_next():
            pass

    def _save_next(self) -> bool:
        """The thread: runs the next queued save until it has committed (or failed, or
        an earlier one failed). Returns False once the checkpointer is closed."""
        item = self._queue.get()
        if item is None:
            return False
        queued, state, meta = item
        del item  # from here `state` alone holds the arrays
        try:
            try:
                if self._broken is not None:
                    raise SaveFailedError(f"not run: the save of step {self._broken} failed")
                self.checkpointer.keep_newest(queued.max_to_keep)
                for step in queued.keep_steps:
                    self.checkpointer.keep(step)
                self.checkpointer.save(queued.step, state, meta)
            finally:
                del state  # copied to host memory, or failed: not to be held any longer
            queued.copied.set()
            self.checkpointer.wait_until_committed(None)
        except Exception as exc:  # noqa: BLE001 - the caller's next call raises it
            traceback.clear_frames(exc.__traceback__)  # they would hold the arrays
            self._broken = queued.step if self._broken is None else self._broken
            queued.done.set_exception(exc)
        else:
            queued.done.set_result(None)
        finally:
            queued.copied.set()
        return True
