"""Training jobs: submitted by name (installed programs only), driven by the controller.

The controller is the single driver of a job's step loop: it allocates the gang, exports
the program's init and step functions for the gang's mesh, and then for every step
queues "build your rows of batch s" on every host, the step itself, and the deletion of
the previous state. It keeps `ControllerOptions.steps_ahead` steps queued beyond the last one whose
metrics it has read, so the workers never wait for a round trip to the controller.

Checkpoints: after every `checkpoint_every`-th step (and the last) the loop queues a
save of the new state, in order with the steps and without waiting for it; the workers
copy the state out and commit it in the background while training goes on. A step
counts as committed only once its commit marker is in storage: the loop looks for it
whenever it records a step's metrics, and journals the newest committed step. A job
that starts where committed steps exist (its own, or those of an earlier job given the
same directory) restores the newest instead of initialising, and continues after it:
the batch of a step is a function of (seed, step), so it sees the batches it would have
seen (see controller/checkpoints.py).

Step times are the workers' own measurements, carried back with each step's completion
(`step_seconds`): completions travel in batches, so when they reach the controller says
nothing about how long a step took.

Preemption: a job watches the gang it allocated. When the scheduler tells the gang to
make room (PREEMPTING, with a grace period), the loop stops queuing steps, queues a save
of the state it has reached behind the steps already queued, waits (within the grace)
for that save to commit and journals it, then yields the gang (`release(requeue=True)`)
and goes back to QUEUED. When the gang is re-admitted on new workers ("resumed", a new
gang epoch) the job starts again as it first did: exports and loads its programs, and
restores the newest committed step. If the grace runs out first, the gang is stopped
under it and the job resumes from the newest step that did commit. Work of the old gang
epoch (its queued steps and saves) is dropped, never awaited again; steps re-run after a
resume overwrite their earlier records. A job on a gang its client holds cannot yield
it: it fails, saying so, if that gang is preempted under it.

A job's state changes in exactly one place (`Job.transition`, job.py), along its table;
every change is journalled and published to whoever watches the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from controller import chaos, dcn, exports, metrics
from controller.auth import Identity, may_see, run_as
from controller.checkpoints import SavePlan, resume_step, yield_save
from controller.dataroots import check_corpus
from controller.dcn import DcnMeter
from controller.gang import failpoint
from controller.gangstate import GangState
from controller.health import holding_up, lag_deadline
from controller.job import (
    DATA_AXIS,
    EXPERT_AXIS,
    FSDP_AXIS,
    TENSOR_AXIS,
    Job,
    JobSpec,
    JobState,
    PeerSource,
    Recovery,
    _spec_from_json,
    check_keep_step,
)
from controller.journal import ExpertLoad, Journal, StepRecord
from controller.logs import set_log_context
from controller.placement import plan, routing_by_slice
from slicewise.common import heap
from slicewise.common.arrays import ArraySpec
from slicewise.common.checkpoints import committed_steps, is_committed
from slicewise.common.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    ShuttingDownError,
)
from slicewise.common.ids import id_order, unguessable_id
from slicewise.common.mesh import MeshSpec, ShardingSpec
from slicewise.common.topology import slice_type as lookup_slice_type

if TYPE_CHECKING:
    from controller.core import Controller
    from controller.gang import Gang
    from programs.base import ParallelAxes

log = logging.getLogger(__name__)


# Measure the traffic between slices every this many steps (where it is measured): the
# steps `slicewise watch` shows routing and traffic on (controller/jobview.py).
DCN_EVERY = 10
# Exported training programs the runner keeps for jobs that start again (see _exported).
EXPORTS_KEPT = 8


def training_axes(mesh: MeshSpec) -> ParallelAxes:
    """The parallelism of a job's mesh: each axis's role by its name (`MESH_ROLES`), bound
    to the mesh's sizes, with the slices each axis spans."""
    from programs.base import ParallelAxes

    names = mesh.names
    return ParallelAxes.for_mesh(
        mesh.abstract(),
        data=tuple(n for n in names if n == DATA_AXIS),
        fsdp=FSDP_AXIS if FSDP_AXIS in names else None,
        tensor=TENSOR_AXIS if TENSOR_AXIS in names else None,
        expert=EXPERT_AXIS if EXPERT_AXIS in names else None,
        dcn={a.name: a.dcn for a in mesh.axes},
    )


def completed_steps(step: int, ahead: Iterable[tuple[int, Any]]) -> int:
    """How many steps are done: through `step`, and those queued after it (`ahead`, in
    order, with their tickets) whose completion has arrived, up to the first that has not."""
    completed = step + 1
    for _, ticket in ahead:
        if not ticket.done.done():
            break
        completed += 1
    return completed


async def _read_dcn(
    meter: DcnMeter, step: int, ahead: Iterable[tuple[int, Any]]
) -> tuple[int, int, int]:
    """(steps done, bytes, segments) from one reading of `meter`: the steps counted just
    before and just after the reading agree, or (after three tries) the count after it.
    A step that completes during the reading would otherwise be counted on one side of
    the window and its traffic on the other."""
    ahead = list(ahead)
    for _ in range(3):
        before = completed_steps(step, ahead)
        sent, segments = await asyncio.to_thread(meter.read)
        after = completed_steps(step, ahead)
        if before == after:
            break
    return after, sent, segments


class JobRunner:
    """Accepts jobs, drives their step loops on gangs, keeps and publishes their progress."""

    def __init__(
        self, controller: Controller, journal: Journal, state_dir: str | Path | None = None
    ) -> None:
        self.controller = controller
        self.journal = journal
        # A job's checkpoints go to <state dir>/checkpoints/<job id> unless it names a
        # directory.
        self.checkpoint_root = Path(state_dir or Path(journal.path).parent) / "checkpoints"
        # Exported training programs, kept across restarts (controller/exports.py).
        self.exports_dir = Path(state_dir or Path(journal.path).parent) / "exports"
        self.jobs: dict[str, Job] = {}
        self._next = journal.next_job_number()
        self._stopping = False
        # Exported training programs by (program, overrides, mesh, platform), newest last.
        self._exports: OrderedDict[tuple[Any, ...], ExportedTraining] = OrderedDict()
        # Preparations a job's first steps need not wait for (`_meanwhile`), held until
        # they end (the event loop keeps only weak references to tasks).
        self._meanwhile_tasks: set[asyncio.Future[Any]] = set()
        # Jobs an earlier run of this controller left unfinished; `resume` restarts them.
        self._unfinished: list[Job] = []
        for record in journal.jobs():  # jobs of an earlier run of this controller
            spec = record["spec"]
            job = Job(
                record["job_id"],
                _spec_from_json(spec),
                JobState(record["state"]),
                record["step"],
                record["gang_id"],
                record["error"],
                record["epoch"],
                record["flops_per_step"],
                created_at=record["created_at"],
                updated_at=record["updated_at"],
                committed_step=record["committed_step"],
                preemptions=record["preemptions"],
                resumed_from=record["resumed_from_step"],
                restarts=record["restarts"],
                failures=record["failures"],
                keep_steps={*spec.get("keep_steps", ()), *record["keep_steps"]},
                recoveries=[Recovery(**r) for r in record["recoveries"]],
            )
            job.recent.extend(journal.steps(job.job_id, since=max(0, job.step - 200)))
            self.jobs[job.job_id] = job
            if job.state.terminal:
                continue
            if job.spec.gang_id:
                # Its gang was the client's; it stopped with the old controller's workers.
                job.state = JobState.FAILED
                job.error = (
                    f"the controller restarted, and gang {job.spec.gang_id}, which the job ran "
                    "on for its client, stopped with it; submit the job again (it restores "
                    f"its newest committed checkpoint from {job.spec.checkpoint_dir})"
                )
                journal.update_job(job.job_id, time.time(), state=job.state.value, error=job.error)
                continue
            # Back in the queue; it restores its newest committed step when it starts.
            job.state = JobState.QUEUED
            job.restarts += 1
            journal.update_job(
                job.job_id, time.time(), state=job.state.value, restarts=job.restarts
            )
            self._unfinished.append(job)

    def resume(self) -> list[Job]:
        """Starts again the jobs an earlier run of this controller left unfinished (each
        takes a new gang and restores its newest committed checkpoint); returns them."""
        resumed, self._unfinished = self._unfinished, []
        for job in resumed:
            log.info(
                "job %s resumes after the controller restarted (step %d recorded, newest "
                "committed checkpoint %s)",
                job.job_id,
                job.step,
                "none" if job.committed_step is None else f"step {job.committed_step}",
            )
            job.task = asyncio.create_task(self._run(job), name=f"job-{job.job_id}")
        return resumed

    # -- API --------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> Job:
        """Checks the request (program, config, slice type) and starts the job."""
        from programs.base import get_program

        if self._stopping:
            raise ShuttingDownError(
                "the controller is shutting down; submit the job again once it is back"
            )
        program = get_program(spec.program)
        config = program.make_config(dict(spec.overrides))
        corpus = getattr(config, "corpus", None)
        if corpus is not None:
            check_corpus(corpus, self.controller.options.data_roots)
        lookup_slice_type(spec.slice_type)
        if spec.gang_id:
            self._check_gang_free(spec.gang_id)
        job_id = unguessable_id("j", self._next)
        if not spec.checkpoint_dir:
            spec = dataclasses.replace(spec, checkpoint_dir=str(self.checkpoint_root / job_id))
        job = Job(job_id, spec, keep_steps=set(spec.keep_steps))
        self._next += 1
        self.jobs[job.job_id] = job
        self.journal.add_job(
            job.job_id, self._next - 1, spec.to_json(), job.state.value, job.created_at
        )
        job.task = asyncio.create_task(self._run(job), name=f"job-{job.job_id}")
        log.info(
            "job %s submitted: %s on %d x %s for %d steps",
            job.job_id,
            spec.program,
            spec.num_slices,
            spec.slice_type,
            spec.steps,
            extra={"job": job.job_id},
        )
        return job

    def _check_gang_free(self, gang_id: str) -> None:
        gang = self.controller.manager.get(gang_id)
        if gang.shared_name or "@" in gang_id:
            raise InvalidRequestError(
                f"gang {gang_id} is shared; a job runs on a gang of its own (allocate one, or "
                "let the job allocate it)"
            )
        for other in self.jobs.values():
            if not other.state.terminal and gang.gang_id in (other.gang_id, other.spec.gang_id):
                raise FailedPreconditionError(
                    f"gang {gang_id} is already running job {other.job_id}; wait for it or "
                    f"cancel it (`slicewise cancel {other.job_id}`)"
                )

    def find(self, job_id: str) -> Job | None:
        """The job, if there is one the caller may see."""
        job = self.jobs.get(job_id)
        return job if job is not None and may_see(job.spec.tenant) else None

    def visible(self) -> list[Job]:
        """The jobs the caller may see, in submission order (by number: j9 before j10)."""
        jobs = [j for j in self.jobs.values() if may_see(j.spec.tenant)]
        return sorted(jobs, key=lambda j: id_order(j.job_id))

    def get(self, job_id: str) -> Job:
        job = self.find(job_id)
        if job is None:
            raise NotFoundError(
                f"job {job_id!r} is unknown to this controller; `slicewise jobs` lists the jobs"
            )
        return job

    async def keep(self, job_id: str, step: int) -> Job:
        """Marks checkpoint `step` of the job to keep beyond its newest
        `keep_checkpoints`: a committed step it still holds, or one it will save. The
        mark is journalled and goes to the workers with the job's next save (they delete
        old steps only when a save commits).

        Raises:
            InvalidRequestError: no job of its length has such a step.
            FailedPreconditionError: the step is gone already, or will never be saved.
        """
        job = self.get(job_id)
        check_keep_step(step, job.spec.steps)
        if step not in job.keep_steps:
            try:
                held = await asyncio.to_thread(committed_steps, job.spec.checkpoint_dir)
            except (ImportError, KeyError, OSError, ValueError) as exc:
                # epath knows no filesystem for its scheme (KeyError) or lacks the package
                # (ImportError); or it is no directory, or cannot be read (OSError).
                raise FailedPreconditionError(
                    f"job {job_id}'s checkpoint directory {job.spec.checkpoint_dir!r} cannot "
                    f"be read ({type(exc).__name__}: {exc}); its checkpoints cannot be kept"
                ) from None
            coming = not job.state.terminal and (
                step in SavePlan(job.step, job.spec.steps, job.spec.checkpoint_every)
                or any(s == step for s, _ in job.saving)
            )
            if step not in held and not coming:
                raise FailedPreconditionError(
                    f"job {job_id} holds no checkpoint of step {step} and will not save one "
                    f"(committed and held: {held or 'none'}; it saves every "
                    f"{job.spec.checkpoint_every} steps and its last)"
                )
            job.keep_steps.add(step)
            self.journal.update_job(
                job.job_id, time.time(), keep_steps=json.dumps(sorted(job.keep_steps))
            )
            log.info(
                "job %s: checkpoint step %d marked to keep", job.job_id, step, extra={"job": job_id}
            )
        return job

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state.terminal:
            raise FailedPreconditionError(f"job {job_id} already {job.state.value}")
        job.cancel_requested = True
        waiting = (JobState.QUEUED, JobState.ADMITTED, JobState.STARTING, JobState.RECOVERING)
        if job.state in waiting and job.task:
            job.task.cancel()  # still waiting for slices or workers: stop waiting
        elif job.task:
            # A running job stops at its next step boundary; one whose step does not
            # end (a stuck collective) is stopped where it is once the grace is over.
            grace = max(CANCEL_GRACE_S, 3.0 * job.slowest_step_s)
            asyncio.get_running_loop().call_later(grace, _stop_if_running, job)
        return job

    async def watch(self, job_id: str) -> AsyncIterator[dict[str, Any]]:
        """A snapshot (state and recent steps), then every change until the job ends."""
        job = self.get(job_id)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1000)
        job.watchers.add(queue)
        try:
            yield {"job": job, "steps": list(job.recent), "message": "attached"}
            while not job.state.terminal or not queue.empty():
                try:
                    yield await asyncio.wait_for(queue.get(), timeout=5.0)
                except TimeoutError:
                    yield {"job": job, "steps": [], "message": ""}  # keeps the stream alive
        finally:
            job.watchers.discard(queue)

    async def worker_log_tails(self, job: Job, lines: int) -> list[tuple[str, str]]:
        """(host, its worker's last `lines` lines of stderr) for the gang the job runs on
        now; [] when it holds none (queued, or ended: its workers have exited)."""
        gang = self.controller.gangs.get(job.gang_id) if job.gang_id else None
        if gang is None or job.state.terminal:
            return []
        return await gang.log_tails(lines)

    def steps(self, job_id: str) -> list[StepRecord]:
        self.get(job_id)
        return self.journal.steps(job_id)

    async def shutdown(self, grace_s: float) -> None:
        """Stops every job for a controller that is stopping, so that its next run on
        the same state directory continues them: a running job saves the step it has
        reached (within `grace_s`, as if preempted) and stops; the others stop at once.
        Their journalled state stays unfinished; what they committed stays committed."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        active = [j for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for job in active:
            job.interrupted = True
            job.stop_deadline = deadline
            if job.state is not JobState.RUNNING:
                job.task.cancel()  # type: ignore[union-attr]
        tasks = [j.task for j in active if j.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s + 5.0)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- the step loop -----------------------------------------------------------------

    def _publish(self, job: Job, steps: list[StepRecord] | None = None, message: str = "") -> None:
        event = {"job": job, "steps": steps or [], "message": message}
        for queue in list(job.watchers):
            if queue.full():  # a watcher that does not read must not hold up the job
                queue.get_nowait()
            queue.put_nowait(event)

    def _move(self, job: Job, state: JobState, message: str = "") -> None:
        job.transition(state)
        self.journal.update_job(
            job.job_id,
            job.updated_at,
            state=state.value,
            epoch=job.epoch,
            error=job.error,
            gang_id=job.gang_id,
        )
        log.info("job %s %s%s", job.job_id, state.value, f": {message}" if message else "")
        self._publish(job, message=message or state.value)

    async def _run(self, job: Job) -> None:
        # What the job makes (its gangs, arrays, programs) is its tenant's, also when it
        # resumes after a restart of the controller.
        run_as(Identity(job.spec.tenant))
        set_log_context(job=job.job_id)
        gang = None
        events = None
        owned = not job.spec.gang_id  # a gang the job allocated is released with it
        try:
            while True:
                if gang is None:  # the first start, a recovery, or growing back
                    if owned:
                        gang, _ = await self.controller.allocate(
                            self._slices_to_take(job),
                            job.spec.slice_type,
                            client=f"job {job.job_id}",
                        )
                    else:
                        gang = self.controller.manager.get(job.spec.gang_id)
                    events = gang.watch()
                    job.gang_id = gang.gang_id
                    job.gang_slices = gang.shape.num_slices
                    set_log_context(gang=gang.gang_id)
                    if job.state is not JobState.RECOVERING:
                        self._move(
                            job,
                            JobState.ADMITTED,
                            f"gang {gang.gang_id}: {', '.join(s.name for s in gang.slices)}",
                        )
                self._move(job, JobState.STARTING)
                epoch = gang.epoch
                try:
                    if await self._train(job, gang, epoch):
                        break
                except _GrowBack:
                    assert events is not None
                    gang.unwatch(events)
                    await self._grow_back(job, gang)
                    gang = events = None
                    continue
                except Exception as exc:
                    cause = self._recoverable(job, gang, exc)
                    if cause is None:
                        raise
                    assert events is not None
                    gang.unwatch(events)
                    await self._recover(job, gang, cause)
                    gang = events = None
                    continue
                if job.interrupted:
                    self._stopped_with_controller(job)
                    return
                assert events is not None
                await self._yield(job, gang, epoch)
                await self._wait_resumed(job, gang, epoch, events)
                self._move(
                    job,
                    JobState.ADMITTED,
                    f"gang {gang.gang_id} re-admitted: {', '.join(s.name for s in gang.slices)}",
                )
            self._move(job, JobState.CANCELLED if job.cancel_requested else JobState.SUCCEEDED)
        except asyncio.CancelledError:
            if job.interrupted and not job.cancel_requested:
                self._stopped_with_controller(job)
                return
            job.error = job.error or "cancelled"
            self._move(job, JobState.CANCELLED, "cancelled")
        except Exception as exc:  # noqa: BLE001 - the job fails, the controller goes on
            job.error = f"{type(exc).__name__}: {exc}"
            if job.cancel_requested:  # what the user asked for, whatever broke meanwhile
                log.info("job %s: cancelled; while it stopped: %s", job.job_id, job.error)
                if not job.state.terminal:
                    self._move(job, JobState.CANCELLED, f"cancelled (while it stopped: {exc})")
                return
            log.exception("job %s failed", job.job_id)
            if not job.state.terminal:
                self._move(job, JobState.FAILED, job.error)
        finally:
            if gang is not None and events is not None:
                gang.unwatch(events)
            if owned and gang is not None and gang.gang_id in self.controller.gangs:
                await self.controller.release(
                    gang.gang_id, why=f"was released by job {job.job_id} ({job.state.value})"
                )

    def _slices_to_take(self, job: Job) -> int:
        """The slices to ask for: all of the spec's; for an elastic job that recovers,
        only as many as are free now (but at least its minimum, which it then waits
        for), so that it goes on without waiting for a lost slice to come back."""
        spec = job.spec
        if not spec.elastic_min_slices or job.state is not JobState.RECOVERING:
            return spec.num_slices
        free = len(self.controller.scheduler.free_slices(lookup_slice_type(spec.slice_type)))
        take = max(spec.elastic_min_slices, min(spec.num_slices, free))
        if take < spec.num_slices:
            self._publish(
                job,
                message=f"elastic: {free} slice(s) free, continuing on {take} of "
                f"{spec.num_slices} (same global batch); back to {spec.num_slices} at a "
                "checkpoint once slices are free",
            )
        return take

    def _meanwhile(self, job: Job, gang: Gang, work: Awaitable[Any], what: str) -> None:
        """Runs `work` beside the job's start; if it fails while the gang is still up,
        says so (the job goes on; a failed gang has said why already)."""

        def done(task: asyncio.Future[Any]) -> None:
            self._meanwhile_tasks.discard(task)
            if task.cancelled() or (exc := task.exception()) is None:
                return
            if gang.state.usable:
                log.warning("job %s: %s failed: %s", job.job_id, what, exc)

        task = asyncio.ensure_future(work)
        self._meanwhile_tasks.add(task)
        task.add_done_callback(done)

    async def _say_when_late(self, job: Job, gang: Gang, epoch: int) -> None:
        """While the job runs on this start: a step later than `STEP_LATE_S` (or 5x the
        slowest step) is said to its watchers, with the hosts holding it up when the
        controller knows them, and again every `STEP_LATE_EVERY_S` it stays late. The
        gang's watchdog decides when late is stuck; until then, nothing else says it."""
        said = 0.0  # how late the step was when last said (0: not said)
        while job.state is JobState.RUNNING and job.epoch == epoch and gang.state.usable:
            await asyncio.sleep(STEP_LATE_POLL_S)
            late = time.monotonic() - job.progressed_at
            if late < max(STEP_LATE_S, 5.0 * job.slowest_step_s):
                said = 0.0
                continue
            if said and late - said < STEP_LATE_EVERY_S:
                continue
            said = late
            who = holding_up(gang.host_reports())
            message = f"waiting on step {job.step + 1} for {late:.0f} s" + (
                f": {who}" if who else " (every host is in it)"
            )
            log.info("job %s: %s", job.job_id, message)
            self._publish(job, message=message)

    def _can_grow(self, job: Job, gang: Gang) -> bool:
        """Whether an elastic job on fewer slices than it asked for could have them all."""
        missing = job.spec.num_slices - gang.shape.num_slices
        stype = lookup_slice_type(job.spec.slice_type)
        return missing > 0 and len(self.controller.scheduler.free_slices(stype)) >= missing

    async def _exported(
        self, job: Job, program: Any, config: Any, mesh: MeshSpec, axes: ParallelAxes, platform: str
    ) -> ExportedTraining:
        """The program's init and step exported for the mesh, made once per (program,
        overrides, mesh, platform) and kept, in memory and in the state directory
        (controller/exports.py): a job that recovers, resumes (also after a controller
        restart) or is submitted again starts without tracing and lowering them anew
        (1-1.6 s of CPU for the small LM here, far more for a large model)."""
        from programs.base import make_flat_train_fns

        program_name = job.spec.program
        overrides = tuple(sorted(job.spec.overrides))
        key = (program_name, overrides, mesh, platform)
        exported = self._exports.get(key)
        if exported is not None:
            self._exports.move_to_end(key)
            log.info(
                "job %s: %s for mesh %s exported before; reused",
                job.job_id,
                program_name,
                mesh.describe(),
            )
            return exported
        started = time.monotonic()
        file_key = await asyncio.to_thread(exports.key_of, program_name, overrides, mesh, platform)
        exported = await asyncio.to_thread(exports.load, self.exports_dir, file_key)
        if exported is not None:
            log.info(
                "job %s: %s for mesh %s exported by an earlier run of this controller; "
                "read back in %.2f s",
                job.job_id,
                program_name,
                mesh.describe(),
                time.monotonic() - started,
            )
        else:
            exported = await asyncio.to_thread(
                _export,
                make_flat_train_fns,
                program,
                config,
                mesh.abstract(),
                axes,
                platform,
            )
            await asyncio.to_thread(exports.store, self.exports_dir, file_key, exported)
            # Tracing and lowering loaded much of jax for good (slicewise/common/heap.py).
            heap.settle("the first export")
            log.info(
                "job %s: %s exported for mesh %s in %.1f s",
                job.job_id,
                program_name,
                mesh.describe(),
                time.monotonic() - started,
            )
        self._exports[key] = exported
        while len(self._exports) > EXPORTS_KEPT:
            self._exports.popitem(last=False)
        return exported

    async def _grow_back(self, job: Job, gang: Gang) -> None:
        """Lets go of the smaller gang (its last checkpoint committed) and queues for one
        of the job's full size; `_run` then restores that checkpoint on it."""
        self._move(
            job,
            JobState.QUEUED,
            f"elastic: slices are free again; growing back from {gang.shape.num_slices} to "
            f"{job.spec.num_slices} slices from checkpoint step {job.committed_step}",
        )
        await self.controller.release(
            gang.gang_id, why=f"was released by job {job.job_id} to grow back to more slices"
        )

    def _recoverable(self, job: Job, gang: Gang, exc: Exception) -> str | None:
        """What broke the job's gang under it, if the job recovers from that: a worker or
        host of a gang the job allocated was lost. None: the job fails (its own error, a
        cancel, a stopping controller, or its client's gang).

        Raises:
            FailedPreconditionError: it would recover, but its failure budget is spent.
        """
        if job.cancel_requested or job.interrupted or job.spec.gang_id:
            return None
        if gang.state is not GangState.FAILED:
            return None
        cause = gang.why or str(exc)
        if job.failures >= job.spec.max_failures:
            raise FailedPreconditionError(
                f"its gang failed and its failure budget is spent ({job.failures} of "
                f"{job.spec.max_failures} recoveries used; --max-failures): {cause}"
            ) from exc
        return cause

    async def _recover(self, job: Job, gang: Gang, cause: str) -> None:
        """Moves the job to RECOVERING and lets go of its failed gang (every worker of
        it, and with them its jax.distributed cluster); `_run` then takes a new gang
        (never on a host found lost) and restores the newest committed step, as a
        preempted job does."""
        # A replica is stashed at once, while the hosts are checked: on the simulation a
        # surviving worker may abort soon after its peer died (HostWorker.stash_state).
        stashing = None
        if job.spec.peer_recovery and job.step in job.live_states:
            stashing = self._stash_everywhere(job, gang)
        lost = await self.controller.manager.check_hosts(gang)
        if lost:
            hosts = ", ".join(f"host {h} of slice {name}" for name, h in lost)
            cause = (
                f"{hosts} lost (its raylet does not answer: the host is down or "
                f"unreachable); {cause}"
            )
        if stashing is not None:
            job.peer = await self._pick_replica(job, gang, stashing, {name for name, _ in lost})
        job.failures += 1
        fault_at = max((f.fired_at for f in job.faults if f.fired_at), default=0.0)
        job.recoveries.append(
            Recovery(
                cause,
                job.step,
                fault_at=gang.fault_at or fault_at,
                detected_at=gang.failed_at or time.time(),
            )
        )
        job.faults = [f for f in job.faults if not f.fired_at]
        self._journal_recoveries(job, failures=job.failures)
        since = (
            f"the surviving replica of step {job.peer.step}"
            if job.peer is not None
            else "nothing committed yet"
            if job.committed_step is None
            else f"newest committed step {job.committed_step}"
        )
        self._move(
            job,
            JobState.RECOVERING,
            f"gang {gang.gang_id} failed at step {job.step}: {cause}; recovering "
            f"({job.failures}/{job.spec.max_failures}): a new gang, then {since}",
        )
        job.saving.clear()  # saves queued on the failed gang never finish
        if gang.gang_id in self.controller.gangs:
            await self.controller.release(
                gang.gang_id, why=f"failed under job {job.job_id}, which recovers on a new one"
            )

    def _journal_recoveries(self, job: Job, **fields: Any) -> None:
        recoveries = json.dumps([r.to_json() for r in job.recoveries])
        self.journal.update_job(job.job_id, time.time(), recoveries=recoveries, **fields)

    async def inject_fault(
        self, job_id: str, kind: str, at_step: int | None, process: int | None
    ) -> str:
        """Injects a fault into a running job's gang, now or once it has completed
        `at_step` steps (see controller/chaos.py); says what will happen.

        Raises:
            NotFoundError: no such job.
            FailedPreconditionError: the job is not running, or injection is off.
            InvalidRequestError: an unknown kind, host or step.
        """
        job = self.get(job_id)
        gang = self.controller.gangs.get(job.gang_id)
        running = job.state is JobState.RUNNING and gang is not None and gang.state.usable
        if job.state.terminal or (at_step is None and not running):
            raise FailedPreconditionError(
                f"job {job_id} is {job.state.value}: a fault can be injected now only into a "
                "running job, and for a later step (--at-step) into one that has not ended"
            )
        fault = chaos.plan_fault(
            kind,
            at_step=at_step,
            process=process,
            num_processes=job.spec.num_slices * lookup_slice_type(job.spec.slice_type).hosts,
            step=job.step,
            steps=job.spec.steps,
            simulated=self.controller.simulated,
            allowed=self.controller.options.allow_chaos,
        )
        where = "" if kind == "kill-controller" else f" of process {fault.process}"
        when = f"once step {fault.at_step} is done" if fault.at_step else "now"
        message = f"job {job_id}: {kind}{where}, {when}"
        self._publish(job, message=f"fault injection: {message}")
        job.faults.append(fault)  # the step loop fires it, unless it is for now
        if kind != "hang-collective" and not fault.at_step:
            assert gang is not None
            await chaos.fire(fault, self.controller, gang)
        return message

    async def _fire_due(self, job: Job, gang: Gang) -> None:
        """Fires the faults waiting for a step the job has now completed."""
        for fault in job.faults:
            if not fault.fired_at and fault.kind != "hang-collective" and fault.at_step <= job.step:
                await chaos.fire(fault, self.controller, gang)

    def _stash_names(self, job: Job, gang: Gang) -> list[str]:
        """The stash actor of each worker of the gang, for the job (worker/stash.py)."""
        prefix = f"slicewise-stash-{job.job_id}-{gang.gang_id}-e{gang.epoch}"
        return [f"{prefix}-p{p}" for p in range(gang.shape.num_processes)]

    def _stash_everywhere(self, job: Job, gang: Gang) -> list[asyncio.Future[list[Any]]]:
        """Has the workers of every slice copy the input state of the job's next step into
        the stashes on their hosts (worker/stash.py), all at once; one future per slice,
        of its workers' results (bytes stashed, or the exception)."""
        handles = job.live_states[job.step]
        names = self._stash_names(job, gang)
        per_slice = gang.shape.hosts_per_slice
        return [
            asyncio.ensure_future(
                asyncio.gather(
                    *(
                        asyncio.wait_for(gang.stash_state(p, names[p], handles), STASH_TIMEOUT_S)
                        for p in range(index * per_slice, (index + 1) * per_slice)
                    ),
                    return_exceptions=True,
                )
            )
            for index in range(len(gang.slices))
        ]

    async def _pick_replica(
        self, job: Job, gang: Gang, stashing: list[asyncio.Future[list[Any]]], lost: set[str]
    ) -> PeerSource | None:
        """The replica of the first slice, not on a lost host, whose workers all stashed
        theirs; None when no slice could (the job then restores its newest checkpoint).
        The other slices' stashes go with the failed gang."""
        names = self._stash_names(job, gang)
        per_slice = gang.shape.hosts_per_slice
        chosen = None
        for index, (piece, attempt) in enumerate(zip(gang.slices, stashing, strict=True)):
            if chosen is not None or piece.name in lost:
                attempt.cancel()
                continue
            results = await attempt
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                log.info(
                    "job %s: slice %s cannot give its replica: %s",
                    job.job_id,
                    piece.name,
                    failed[0],
                )
                continue
            log.info(
                "job %s: slice %s stashed its replica of step %d (%d bytes)",
                job.job_id,
                piece.name,
                job.step,
                sum(r for r in results if isinstance(r, int)),
            )
            chosen = names[index * per_slice : (index + 1) * per_slice]
        if chosen is None:
            return None
        gang.hand_over_stashes(chosen)
        return PeerSource(job.step, tuple(job.live_states[job.step]), tuple(chosen))

    async def _restore_from_peer(
        self, job: Job, gang: Gang, specs: Sequence[ArraySpec], shardings: Sequence[ShardingSpec]
    ) -> list[Any] | None:
        """The state rebuilt on the new gang from the replica a recovery stashed; None
        (after saying why) when that cannot be done: the job restores a checkpoint."""
        peer, job.peer = job.peer, None
        assert peer is not None
        c = self.controller
        try:
            if peer.step != job.step:
                return None
            ticket, state = c.peer_restore(
                gang.gang_id, peer.handles, specs, shardings, peer.stashes
            )
            error = await ticket.done
            if error:
                log.warning(
                    "job %s: rebuilding step %d from the surviving replica failed (%s); "
                    "restoring the newest checkpoint instead",
                    job.job_id,
                    peer.step,
                    error,
                )
                c.delete([r.handle for r in state])
                return None
            return state
        finally:
            for name in peer.stashes:
                gang.drop_stash(name)

    def _stopped_with_controller(self, job: Job) -> None:
        resume = (
            "from the start (nothing committed)"
            if job.committed_step is None
            else f"from step {job.committed_step}"
        )
        log.info("job %s stopped with the controller; it resumes %s", job.job_id, resume)
        self._publish(
            job,
            message=f"the controller is stopping; the job resumes {resume} when a "
            "controller starts again on the same state directory",
        )

    async def _yield(self, job: Job, gang: Gang, epoch: int) -> None:
        """Lets go of a preempted gang (unless the grace ran out and it was stopped under
        the job already); the job waits in QUEUED for the gang to be re-admitted."""
        if gang.state is GangState.PREEMPTING and gang.epoch == epoch:
            try:
                await self.controller.release(
                    gang.gang_id,
                    why=f"was yielded by job {job.job_id} to {gang.preempted_by}",
                    requeue=True,
                )
            except FailedPreconditionError as exc:  # stopped or resumed meanwhile
                log.info("job %s: gang %s: %s", job.job_id, gang.gang_id, exc)
        job.preemptions += 1
        self.journal.update_job(job.job_id, time.time(), preemptions=job.preemptions)
        check_preemption_budget(job, gang.preempted_by)
        resume = (
            "its newest committed step, if any"
            if job.committed_step is None
            else f"its newest committed step ({job.committed_step} as journalled)"
        )
        self._move(
            job,
            JobState.QUEUED,
            f"preempted by {gang.preempted_by or 'a higher-priority request'} at step "
            f"{job.step}; waiting to be re-admitted, then resumes from {resume}",
        )

    async def _wait_resumed(
        self, job: Job, gang: Gang, epoch: int, events: asyncio.Queue[tuple[str, str]]
    ) -> None:
        """Returns once the gang runs again on new workers (an epoch after `epoch`).

        Raises:
            FailedPreconditionError: the gang failed or was released meanwhile.
        """
        while True:
            if self.controller.gangs.get(gang.gang_id) is not gang:
                raise FailedPreconditionError(
                    f"gang {gang.gang_id} was released while job {job.job_id} waited to resume"
                )
            if gang.state is GangState.FAILED:
                raise FailedPreconditionError(
                    f"gang {gang.gang_id} failed while job {job.job_id} waited to resume: "
                    f"{gang.why}"
                )
            if gang.state.usable and gang.epoch > epoch:
                return
            # Events only wake this up; the gang's state is what counts.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(events.get(), timeout=1.0)

    def _lost_to_preemption(self, job: Job, gang: Gang, epoch: int) -> bool:
        """Whether the gang of start `epoch` was stopped by preemption (the job then
        resumes; anything that failed on the stopped gang failed for that reason).

        Raises:
            FailedPreconditionError: it was, but the gang is the client's, not the job's.
        """
        lost = gang.epoch != epoch or GangState.PREEMPTED in (gang.state, gang.stopping_to)
        if lost and job.spec.gang_id:
            at = "none" if job.committed_step is None else f"step {job.committed_step}"
            raise FailedPreconditionError(
                f"gang {gang.gang_id}, which job {job.job_id} ran on and its client holds, "
                f"was preempted by {gang.preempted_by or 'a higher-priority request'}; a job "
                "can only yield and resume on a gang it allocated itself (submit it without a "
                f"gang). Last committed checkpoint: {at}"
            )
        return lost

    async def _train(self, job: Job, gang: Gang, epoch: int) -> bool:
        """Trains on the gang's start `epoch` until the job's last step (True), or until
        the gang is preempted under the job (False: the job then yields and resumes).

        Raises:
            FailedPreconditionError: a step, save or restore failed; or the gang the
                client holds was preempted.
        """
        try:
            return await self._train_on(job, gang)
        except Exception:
            if not self._lost_to_preemption(job, gang, epoch):
                raise
            log.warning(
                "job %s: gang %s was stopped by preemption before the job yielded it",
                job.job_id,
                gang.gang_id,
            )
            return False

    async def _train_on(self, job: Job, gang: Gang) -> bool:
        import jax

        from programs.base import get_program

        c = self.controller
        spec = job.spec
        program = get_program(spec.program)
        config = program.make_config(dict(spec.overrides))
        # New workers read the program's data while the programs load and the state is
        # restored, rather than when the first batch is built (about a second here).
        self._meanwhile(
            job,
            gang,
            gang.prepare_data(spec.program, tuple(sorted(spec.overrides))),
            "loading the data of the program ahead of its first batch",
        )
        mesh = job.mesh = spec.mesh_for(gang.shape)
        axes = training_axes(mesh)
        exported = await self._exported(job, program, config, mesh, axes, gang.platform)
        init_art, step_art, flops = exported.init, exported.step, exported.flops
        state_specs = exported.state_specs
        job.stat_shapes = exported.stat_shapes
        job.flops_per_step = flops
        self.journal.update_job(job.job_id, time.time(), flops_per_step=flops)
        # Workers compile the step from the moment it is loaded; the init only when it is
        # called: a job that restores a checkpoint or a replica never calls it.
        init = await c.register_program(
            gang.gang_id, f"{spec.program}.init", mesh, init_art, ahead=False
        )
        step_program = await c.register_program(
            gang.gang_id, f"{spec.program}.step", mesh, step_art
        )
        # Load-aware expert placement, when the program asks for it and its experts span
        # slices (`tokens_by_slice` has a row per slice).
        every = getattr(config, "rebalance_every", 0)
        slices = exported.stat_shapes.get("tokens_by_slice", (0, 1))[1]
        permute = None
        if exported.permute is not None and slices > 1:
            permute = await c.register_program(
                gang.gang_id, f"{spec.program}.place_experts", mesh, exported.permute, ahead=False
            )
        n_state = len(init.outputs)
        batch_sharding = ShardingSpec(mesh, (axes.batch,))
        batch_spec = program.batch_spec(config)
        fields = [
            ArraySpec.of(batch_spec[k].shape, batch_spec[k].dtype) for k in sorted(batch_spec)
        ]
        overrides = tuple(sorted(spec.overrides))
        # The data position: the batch of a step is a function of these and the step.
        position = {
            "program": spec.program,
            "seed": program.seed(config),
            "global_batch_size": fields[0].shape[0],
        }
        directory, prefix = spec.checkpoint_dir, f"{job.job_id}.{job.epoch}"
        job.saving.clear()  # saves of an earlier start are no concern of this one
        held = await asyncio.to_thread(committed_steps, directory)
        # After a preemption or a controller restart, from no later than the last step
        # recorded: steps after it ran on the old gang, but their metrics were lost with
        # it, so they run again.
        interrupted = bool(job.preemptions or job.restarts or job.failures)
        state = None
        shardings = [ShardingSpec.from_partition_spec(mesh, p) for p in state_specs]
        if job.peer is not None:
            state = await self._restore_from_peer(job, gang, init.outputs, shardings)
        start: int | None = None  # the checkpoint step restored, if one is
        if state is not None:
            job.resumed_from = job.step
            self.journal.update_job(job.job_id, time.time(), resumed_from_step=job.step)
            job.recoveries[-1].source = "peer"
            begun = (
                f"resumed at step {job.step} after {_why_resumed(job)} from a surviving "
                "slice's replica (no step lost)"
            )
        else:
            start = resume_step(
                held, job.committed_step, spec.steps, job.step if interrupted else None
            )
            if start is None:
                key = np.asarray(jax.random.PRNGKey(program.seed(config)))
                key_record = await c.put_array(gang.gang_id, key, ShardingSpec(mesh, ()))
                _, state = c.execute(gang.gang_id, init.program_id, [key_record.handle])
                c.delete([key_record.handle])
                begun = "initialised"
                if job.step:  # interrupted before anything committed: from the start again
                    begun = (
                        f"started again from step 0 after {_why_resumed(job)} (nothing committed)"
                    )
                    job.step, job.resumed_from = 0, 0
                    job.recent.clear()
                    self.journal.update_job(job.job_id, time.time(), step=0)
            else:
                restored, state = c.restore_checkpoint(
                    gang.gang_id,
                    directory,
                    start,
                    init.outputs,
                    shardings,
                    expect=(*position.items(), ("step", start)),
                    barrier_prefix=prefix,
                )
                error = await restored.done
                if error:
                    raise FailedPreconditionError(
                        f"restoring checkpoint step {start} failed: {error}"
                    )
                recorded, job.step = job.step, start
                # Steps after `start` run again; their records are replaced as they do.
                job.recent = deque((r for r in job.recent if r.step < start), maxlen=200)
                self.journal.update_job(job.job_id, time.time(), step=start)
                newest = max(s for s in held if s <= spec.steps)
                self._committed(job, newest, announce=False)  # the RUNNING message says it
                begun = f"restored step {start} from {directory}"
                if interrupted:
                    job.resumed_from = start
                    self.journal.update_job(job.job_id, time.time(), resumed_from_step=start)
                    begun = f"resumed from step {start} after {_why_resumed(job)} ({directory})"
                    if start > recorded:  # storage held nothing earlier (retention, timing)
                        begun += (
                            f"; steps {recorded}-{start - 1} ran before it, but their metrics "
                            "were lost with the gang"
                        )
        state_handles = [r.handle for r in state]
        job.live_states = {job.step: state_handles} if spec.peer_recovery else {}
        if spec.peer_recovery:
            # Started now, not when a slice fails (an actor takes about a second to
            # start), while the first steps run: a failure before they answer puts into
            # the same actors (HostWorker.prepare_stash), or starts them if they failed.
            self._meanwhile(
                job,
                gang,
                gang.prepare_stashes(self._stash_names(job, gang)),
                "starting the stash actors for peer recovery (a failure starts them then)",
            )
        tokens = program.tokens_per_step(config)
        if job.recoveries and job.recoveries[-1].resumed_from is None:
            job.recoveries[-1].resumed_from = job.step
            self._journal_recoveries(job)
        gang.step_deadline_s = step_deadline(c.options.step_timeout_s, job.slowest_step_s)
        gang.lag_deadline_s = lag_deadline(job.slowest_step_s)
        job.compiled_at = job.step  # new workers compile the step program on this one
        job.step_program_id = step_program.program_id
        job.dcn_predicted = job.dcn_meter = None  # this start's mesh and workers
        self._move(
            job,
            JobState.RUNNING,
            f"mesh {mesh.describe()}, {flops / 1e9:.2f} GFLOP/step, {begun}",
        )
        job.progressed_at = time.monotonic()
        self._meanwhile(
            job, gang, self._say_when_late(job, gang, job.epoch), "watching for late steps"
        )

        # Steps committed already (by a start before a preemption) are not saved again.
        saves = SavePlan(job.step, spec.steps, spec.checkpoint_every, frozenset(held))
        pending: deque[tuple[int, Any]] = deque()
        metrics_index = len(step_program.outputs) - 1
        start_step = job.step
        for step in range(job.step, spec.steps):
            if job.cancel_requested:
                break
            if job.interrupted or (gang.state is GangState.PREEMPTING and not spec.gang_id):
                await self._save_before_yield(
                    job, gang, step, state_handles, pending, tokens, position, prefix, held
                )
                return False
            for fault in job.faults:
                if fault.kind == "hang-collective" and not fault.fired_at and fault.at_step <= step:
                    chaos.hang(fault, c, gang)
            if step in saves and step != start_step and self._can_grow(job, gang):
                # The save of `step` is queued: once it commits, the job moves.
                while pending:
                    await self._record(job, *pending.popleft(), tokens, gang, pending)
                closed = c.close_checkpoints(gang.gang_id, directory, prefix)
                error = await closed.done
                if error:
                    raise FailedPreconditionError(f"checkpoint {step} did not commit: {error}")
                await self._check_commits(job)
                if job.committed_step == step:
                    raise _GrowBack
            if permute is not None and step > start_step and step % every == 0:
                while pending:  # the routing of the window's steps decides
                    await self._record(job, *pending.popleft(), tokens, gang, pending)
                state_handles = await self._place_experts(
                    job, gang, config, permute.program_id, state_handles, step
                )
            batch = c.load_batch(
                gang.gang_id, spec.program, overrides, step, batch_sharding, fields
            )
            ticket, outs = c.call(
                gang.gang_id,
                step_program.program_id,
                [*state_handles, *batch],
                report=[metrics_index],
            )
            # A peer-recovering job keeps a step's input until the step is done (_record).
            keep = spec.peer_recovery
            c.delete([*batch, outs[n_state].handle, *([] if keep else state_handles)])
            state_handles = [r.handle for r in outs[:n_state]]
            if keep:
                job.live_states[step + 1] = state_handles
            if step + 1 in saves:
                self._save(job, gang, state_handles, step + 1, position, prefix)
            pending.append((step, ticket))
            while len(pending) > c.options.steps_ahead:
                await self._record(job, *pending.popleft(), tokens, gang, pending)
        while pending:
            await self._record(job, *pending.popleft(), tokens, gang, pending)
        if saves or start is not None:
            closed = c.close_checkpoints(gang.gang_id, directory, prefix)
            error = await closed.done
            if error:
                raise FailedPreconditionError(f"the last checkpoint did not commit: {error}")
            await self._check_commits(job)
        c.delete(state_handles)
        job.live_states.clear()
        if spec.peer_recovery:
            for name in self._stash_names(job, gang):
                gang.drop_stash(name)
        return True

    async def _place_experts(
        self,
        job: Job,
        gang: Gang,
        config: Any,
        program_id: str,
        state_handles: list[str],
        step: int,
    ) -> list[str]:
        """Before `step`, re-places the experts over the slices if the routing of the last
        `rebalance_every` steps says a placement serves enough more choices on their own
        slice (`controller.placement.plan`); returns the state to train on, moved or not.
        The move runs on the gang as one program over the state (weights and optimizer
        moments together), queued like a step, and changes no value the job computes."""
        c = self.controller
        window = [r.experts for r in job.recent if step - config.rebalance_every <= r.step < step]
        by_slice = routing_by_slice(window) if window else None
        placement = None if by_slice is None else plan(by_slice, config.rebalance_min_gain)
        if placement is None:
            return state_handles
        assert job.mesh is not None  # set when the start began
        order = await c.put_array(
            gang.gang_id, placement.order.astype(np.int32), ShardingSpec(job.mesh, ())
        )
        _, moved = c.execute(gang.gang_id, program_id, [*state_handles, order.handle])
        c.delete([order.handle, *state_handles])
        handles = [r.handle for r in moved]
        if step in job.live_states:  # a peer-recovering job's input to `step`
            job.live_states[step] = handles
        job.placements += 1
        message = f"before step {step}: {placement.describe()}"
        log.info("job %s: %s", job.job_id, message)
        self._publish(job, message=message)
        return handles

    async def _save_before_yield(
        self,
        job: Job,
        gang: Gang,
        reached: int,
        state_handles: list[str],
        pending: deque[tuple[int, Any]],
        tokens: int,
        position: dict[str, Any],
        prefix: str,
        held: list[int],
    ) -> None:
        """The gang is being preempted (or the controller is stopping) and the steps
        before `reached` are queued: saves the state they lead to, in order behind them,
        and waits (within the grace period) until it commits and is journalled. If it
        cannot, the job resumes from the newest step that did commit."""
        c = self.controller
        delay = failpoint("yield_delay_s")
        if delay:  # tests: outlast the grace period, so the gang is stopped under the job
            log.info("job %s: failpoint: pausing %g s before saving", job.job_id, delay)
            await asyncio.sleep(delay)
        if job.interrupted:
            grace = max(0.0, job.stop_deadline - time.monotonic())
            reason = "the controller is stopping"
        else:
            grace = c.manager.grace_left(gang)
            reason = f"preempted by {gang.preempted_by}"
        directory = job.spec.checkpoint_dir
        queued = [s for s, _ in job.saving]
        committed = [] if job.committed_step is None else [job.committed_step]
        target = yield_save(reached, [*queued, *committed, *held])
        if target is not None:
            self._save(job, gang, state_handles, target, position, prefix)
        saving = (
            f"{reason}: saving step {reached} within {grace:.0f} s before letting go of the gang"
        )
        log.info("job %s: %s", job.job_id, saving)
        self._publish(job, message=saving)

        async def finish() -> None:
            while pending:
                await self._record(job, *pending.popleft(), tokens, gang, pending)
            closed = c.close_checkpoints(gang.gang_id, directory, prefix)
            error = await closed.done
            if error:
                raise FailedPreconditionError(f"the checkpoint did not commit: {error}")
            await self._check_commits(job)

        try:
            # A second of the grace is left for yielding the gang.
            await asyncio.wait_for(finish(), max(0.0, grace - 1.0))
        except Exception as exc:  # noqa: BLE001 - the committed steps are what counts
            log.warning(
                "job %s: step %d was not saved within the grace period (%s: %s); it "
                "resumes from step %s",
                job.job_id,
                reached,
                type(exc).__name__,
                exc,
                job.committed_step,
            )

    def _save(
        self,
        job: Job,
        gang: Gang,
        state: list[str],
        step: int,
        position: dict[str, Any],
        prefix: str,
    ) -> None:
        """Queues a save of the state that is the input of `step`, with the data position
        and the job's retention (the newest `keep_checkpoints`, plus the marked steps)."""
        saved = self.controller.save_checkpoint(
            gang.gang_id,
            state,
            job.spec.checkpoint_dir,
            step,
            json.dumps(position | {"step": step}),
            prefix,
            max_to_keep=job.spec.keep_checkpoints,
            keep_steps=sorted(job.keep_steps),
        )
        job.saving.append((step, saved))

    async def _account_dcn(
        self,
        job: Job,
        gang: Gang,
        step: int,
        record: StepRecord,
        ahead: Iterable[tuple[int, Any]],
    ) -> StepRecord:
        """DCN accounting as steps are recorded. Once the first step of a start has run
        (its program is compiled): predicts a step's traffic between slices from the
        compiled program, and on the simulation takes the baseline of the measurement.
        Then every `DCN_EVERY` steps, the record carries the measured bytes and TCP
        segments per step since the previous reading.

        A reading counts the steps the workers have completed when it is taken (see
        `_read_dcn`): the workers run ahead of what is recorded, and dividing by the
        recorded steps would credit the traffic of steps done early to the window before,
        and leave the last window short."""
        if step == job.compiled_at:
            if job.dcn_predicted is None and job.mesh is not None:
                # Once per start; the workers go on with the queued steps meanwhile.
                await self._predict_dcn(job, gang, job.step_program_id)
            # One slice has no DCN to measure, and a reading (`ss` over every socket of
            # the machine) cost a 5-ms step job a tenth of a core.
            if self.controller.simulated and gang.shape.num_slices > 1:
                await self._start_dcn_meter(job, gang, step, ahead)
            return record
        meter = job.dcn_meter
        if meter is None or (step + 1) % DCN_EVERY:
            return record
        try:
            completed, sent, segments = await _read_dcn(meter, step, ahead)
        except Exception as exc:  # noqa: BLE001 - a figure, never a reason to stop the job
            log.warning("job %s: cannot measure DCN traffic: %s", job.job_id, exc)
            job.dcn_meter = None
            return record
        at, was_sent, was_segments = job.dcn_read_at
        window = completed - at
        job.dcn_read_at = (completed, sent, segments)
        if window < 1:
            return record
        return dataclasses.replace(
            record,
            dcn_bytes=(sent - was_sent) / window,
            dcn_segments=(segments - was_segments) / window,
            dcn_window=window,
        )

    async def _start_dcn_meter(
        self, job: Job, gang: Gang, step: int, ahead: Iterable[tuple[int, Any]]
    ) -> None:
        """Starts measuring what the gang's worker processes send between slices (all of
        them run on this machine), from a reading taken now, once `step` is done."""
        try:
            workers = await gang.worker_stats()
            per_slice = gang.shape.hosts_per_slice
            meter = DcnMeter({int(w["pid"]): int(w["process_id"]) // per_slice for w in workers})
            completed, sent, segments = await _read_dcn(meter, step, ahead)
        except Exception as exc:  # noqa: BLE001 - a figure, never a reason to stop the job
            log.warning("job %s: cannot measure DCN traffic: %s", job.job_id, exc)
            return
        job.dcn_meter, job.dcn_read_at = meter, (completed, sent, segments)

    async def _predict_dcn(self, job: Job, gang: Gang, program_id: str) -> None:
        mesh = job.mesh
        try:
            text = await gang.compiled_text(program_id)
            found = await asyncio.to_thread(dcn.collectives, text)
            traffic = dcn.predict(found, dcn.slices_of_mesh(mesh)) if mesh else None
        except Exception as exc:  # noqa: BLE001 - a figure, never a reason to stop the job
            log.warning("job %s: cannot predict its DCN traffic: %s", job.job_id, exc)
            return
        if job.step_program_id != program_id or traffic is None:
            return  # the job moved on to another start meanwhile
        job.dcn_predicted = traffic
        kinds = ", ".join(f"{k} {b:,} B in {m}" for k, b, m in traffic.by_kind if m)
        log.info(
            "job %s: a step sends %s bytes in %d messages between slices (predicted: %s)",
            job.job_id,
            f"{traffic.bytes:,}",
            traffic.messages,
            kinds or "none",
        )

    async def _record(
        self,
        job: Job,
        step: int,
        ticket: Any,
        tokens: int,
        gang: Gang | None = None,
        ahead: Iterable[tuple[int, Any]] = (),
    ) -> None:
        """Records a step once it is done; with the gang it ran on, also moves the gang's
        step deadline, fires the faults waiting for the step and accounts its DCN traffic
        (`ahead`: the steps queued after it, with their tickets)."""
        error = await ticket.done
        if error:
            raise FailedPreconditionError(f"step {step} failed: {error}")
        measured = step_record(step, ticket.values[0], ticket.ran, tokens, job.stat_shapes)
        job.note_step_time(step, measured.step_time_s)
        job.progressed_at = time.monotonic()
        if gang is not None:
            measured = await self._account_dcn(job, gang, step, measured, ahead)
        if gang is not None:
            gang.step_deadline_s = step_deadline(
                self.controller.options.step_timeout_s, job.slowest_step_s
            )
            gang.lag_deadline_s = lag_deadline(job.slowest_step_s)
        if job.recoveries and not job.recoveries[-1].resumed_at:
            job.recoveries[-1].resumed_at = measured.wall_time
            self._journal_recoveries(job)
        job.step = step + 1
        job.recent.append(measured)
        self.journal.add_steps(job.job_id, [measured])
        self.journal.update_job(job.job_id, measured.wall_time, step=job.step)
        metrics.STEPS.inc()
        metrics.STEP_SECONDS.observe(measured.step_time_s)
        self._publish(job, [measured])
        await self._check_commits(job)
        if gang is not None and step in job.live_states:
            self.controller.delete(job.live_states.pop(step))
        if gang is not None and job.faults:
            await self._fire_due(job, gang)

    async def _check_commits(self, job: Job) -> None:
        """Journals the saves whose commit marker is now in storage. Saves commit in the
        order they were queued (a worker's save waits for the one before), so this stops
        at the first that has not.

        Raises:
            FailedPreconditionError: a save failed on the workers.
        """
        while job.saving and job.saving[0][1].done.done():
            step, ticket = job.saving[0]
            error = ticket.done.result()
            if error:
                raise FailedPreconditionError(f"checkpoint of step {step} failed: {error}")
            if not await asyncio.to_thread(is_committed, job.spec.checkpoint_dir, step):
                return
            job.saving.popleft()
            self._committed(job, step)

    def _committed(self, job: Job, step: int, *, announce: bool = True) -> None:
        if job.committed_step is not None and step < job.committed_step:
            return  # an older step saved after a resume from before the newest
        job.committed_step = step
        self.journal.update_job(job.job_id, time.time(), committed_step=step)
        if announce:
            log.info("job %s: checkpoint step %d committed", job.job_id, step)
            self._publish(job, message=f"checkpoint step {step} committed")


# How long a surviving worker may take to stash its replica of the state.
STASH_TIMEOUT_S = 60.0


def check_preemption_budget(job: Job, by: str) -> None:
    """Raises FailedPreconditionError once a job has been preempted more often than its
    --max-preemptions allows (a budget apart from its failures'; unset: no limit)."""
    budget = job.spec.max_preemptions
    if budget is not None and job.preemptions > budget:
        raise FailedPreconditionError(
            f"preempted {job.preemptions} times (last by {by or 'a higher-priority request'}); "
            f"its preemption budget is spent (--max-preemptions {budget}): submit it again at "
            f"a higher priority, or with a larger budget, to go on from step "
            f"{job.committed_step if job.committed_step is not None else 0}"
        )


class _GrowBack(Exception):
    """An elastic job on fewer slices stops at a committed checkpoint to grow back."""


# A step this late (or 5x the job's slowest step, when longer) is said to the job's
# watchers, again every STEP_LATE_EVERY_S while it stays late; checked every
# STEP_LATE_POLL_S.
STEP_LATE_S = 3.0
STEP_LATE_EVERY_S = 10.0
STEP_LATE_POLL_S = 1.0
# How long a cancelled running job has to reach its next step boundary before it is
# stopped where it is (at least; 3x its slowest step when that is longer).
CANCEL_GRACE_S = 5.0


def _stop_if_running(job: Job) -> None:
    """A cancel's grace is over: a job still running is stopped where it is."""
    if not job.state.terminal and job.task is not None and not job.task.done():
        log.info(
            "job %s: no step boundary within the cancel's grace; stopping it",
            job.job_id,
            extra={"job": job.job_id},
        )
        job.task.cancel()


def step_deadline(floor_s: float, slowest_step_s: float) -> float:
    """How long a step may stall on a host before its gang fails as stuck: 10x the
    slowest step so far, and never less than `floor_s` (--step-timeout)."""
    return max(floor_s, 10.0 * slowest_step_s)


def _why_resumed(job: Job) -> str:
    """What interrupted a job that is starting again, in a few words (the latest cause
    is not recorded apart: all that happened is named)."""
    causes = [
        name
        for count, name in (
            (job.preemptions, "preemption"),
            (job.restarts, "a controller restart"),
            (job.failures, "a gang failure"),
        )
        if count
    ]
    return " and ".join(causes) or "an interruption"


def step_seconds(ran: Mapping[int, tuple[int, int]]) -> float:
    """How long a step took on its gang, from when each host ran it (worker index ->
    (started_ns, finished_ns) by that host's clock; see worker/executor.py).

    The longest of the hosts' times: every host runs the same program, joined by its
    collectives, so the step is done when the slowest host is, and the hosts that got
    there first spend the difference waiting inside the collectives (their intervals
    include it). Host 0's time alone would miss a host that finishes after it. Each
    interval is measured on one host's clock, so the hosts' clocks need not agree.

    Raises:
        ValueError: no host said when it ran the step.
    """
    if not ran:
        raise ValueError("no worker reported when it ran the step")
    return max(end - start for start, end in ran.values()) / 1e9


def step_record(
    step: int,
    values: Sequence[float],
    ran: Mapping[int, tuple[int, int]],
    tokens: int,
    stat_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> StepRecord:
    """A step's record from its completion: the reported metrics vector (see `_export`:
    [grad_norm, learning_rate, loss], then the program's statistics of `stat_shapes`
    flattened in key order), when each host ran it (see `step_seconds`) and how many tokens
    a step trains on. The first step's time includes compiling the program, which each
    worker does when it launches it. A program that reports routing (`tokens_per_expert`
    [L, E], `dropped_fraction` and `local_fraction` [L]) gets an `ExpertLoad` per MoE layer.
    """
    grad_norm, learning_rate, loss = (float(v) for v in values[:3])
    stats = unpack_stats(values[3:], stat_shapes or {})
    seconds = step_seconds(ran)
    return StepRecord(
        step,
        loss,
        grad_norm,
        learning_rate,
        seconds,
        tokens / seconds if seconds > 0 else 0.0,
        max(end for _, end in ran.values()) / 1e9,
        experts=expert_loads(stats),
    )


def unpack_stats(
    values: Sequence[float], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, np.ndarray]:
    """The statistics of a metrics vector's tail, by name (packed in sorted key order).

    Raises:
        ValueError: the tail is not as long as the shapes say.
    """
    flat = np.asarray(values, np.float64).ravel()
    sizes = {k: int(np.prod(shapes[k], dtype=np.int64)) for k in sorted(shapes)}
    if flat.size != sum(sizes.values()):
        raise ValueError(
            f"the step reported {flat.size} statistics, but their shapes {dict(shapes)} "
            f"make {sum(sizes.values())}"
        )
    out, at = {}, 0
    for key, size in sizes.items():
        out[key] = flat[at : at + size].reshape(shapes[key])
        at += size
    return out


def expert_loads(stats: Mapping[str, np.ndarray]) -> tuple[ExpertLoad, ...]:
    """One `ExpertLoad` per MoE layer from a step's routing statistics (none without)."""
    counts = stats.get("tokens_per_expert")
    if counts is None or counts.ndim != 2:
        return ()
    layers = counts.shape[0]
    dropped = stats.get("dropped_fraction", np.zeros(layers))
    local = stats.get("local_fraction", np.ones(layers))
    by_slice = stats.get("tokens_by_slice", np.zeros((layers, 0, 0)))
    return tuple(
        ExpertLoad(
            layer=i,
            tokens_per_expert=tuple(int(round(c)) for c in counts[i]),
            dropped_fraction=float(dropped[i]),
            local_fraction=float(local[i]),
            tokens_by_slice=tuple(tuple(int(round(c)) for c in row) for row in by_slice[i]),
        )
        for i in range(layers)
    )


class ExportedTraining(NamedTuple):
    """What `_export` makes of a program for a mesh."""

    init: bytes  # serialized `jax.export` of init(key) -> state leaves
    step: bytes  # of step(state, batch) -> (state leaves, metrics vector)
    flops: float  # of one step, by XLA's cost analysis
    state_specs: list[Any]  # the `PartitionSpec` of every state leaf
    stat_shapes: dict[str, tuple[int, ...]]  # the program's statistics in the vector
    # of permute(state, order int32 [L, E]) -> state, for a program that re-places its
    # experts (`rebalance_every` > 0, see `controller.placement`); else None
    permute: bytes | None = None


def _export(
    make_fns: Any, program: Any, config: Any, abstract: Any, axes: Any, platform: str
) -> ExportedTraining:
    """Exports the flat init and a step that returns its metrics as one float32 vector
    [grad_norm, learning_rate, loss, *statistics] (one fetch per step however many there
    are; statistics flattened in key order); also the step's FLOPs from XLA's cost analysis
    of the lowered program, and the `PartitionSpec` of every state leaf (what a checkpoint
    is restored onto)."""
    import jax
    import jax.numpy as jnp

    from programs.base import METRICS

    fns = make_fns(program, config, abstract, axes)
    state_shardings = [s.sharding for s in fns.layout.state]
    _, metric_shapes = jax.eval_shape(fns.step, fns.layout.state, fns.layout.batch)
    stat_shapes = {k: tuple(v.shape) for k, v in sorted(metric_shapes.items()) if k not in METRICS}

    def step(
        state: list[jax.Array], batch: dict[str, jax.Array]
    ) -> tuple[list[jax.Array], jax.Array]:
        new_state, values = fns.step(state, batch)
        packed = [values[k].reshape(1) for k in METRICS]
        packed += [values[k].reshape(-1) for k in stat_shapes]
        return new_state, jnp.concatenate(packed)

    replicated = jax.sharding.NamedSharding(abstract, jax.sharding.PartitionSpec())
    packed = jax.jit(step, out_shardings=(state_shardings, replicated))
    init = jax.export.export(fns.init, platforms=[platform])(fns.layout.key)
    exported = jax.export.export(packed, platforms=[platform])(fns.layout.state, fns.layout.batch)
    lowered = packed.trace(fns.layout.state, fns.layout.batch).lower(lowering_platforms=(platform,))
    flops = float((lowered.cost_analysis() or {}).get("flops", 0.0))
    permute = None
    if getattr(config, "rebalance_every", 0) and hasattr(program, "permute_experts"):
        layout = fns.layout

        def permute_fn(state: list[jax.Array], order: jax.Array) -> list[jax.Array]:
            params, opt_state = layout.unflatten_state(state)
            return layout.flatten_state(*program.permute_experts(config, params, opt_state, order))

        experts = stat_shapes["tokens_per_expert"]
        order = jax.ShapeDtypeStruct(experts, jnp.int32, sharding=replicated)
        moves = jax.jit(permute_fn, out_shardings=state_shardings)
        permute = bytes(
            jax.export.export(moves, platforms=[platform])(layout.state, order).serialize()
        )
    return ExportedTraining(
        init=bytes(init.serialize()),
        step=bytes(exported.serialize()),
        flops=flops,
        state_specs=[tuple(s.sharding.spec) for s in fns.layout.state],
        stat_shapes=stat_shapes,
        permute=permute,
    )
