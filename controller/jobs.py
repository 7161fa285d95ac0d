"""Training jobs: submitted by name (installed programs only), driven by the controller.

The controller is the single driver of a job's step loop: it allocates the gang, exports
the program's init and step functions for the gang's mesh, and then for every step
queues "build your rows of batch s" on every host, the step itself, and the deletion of
the previous state. It keeps `ControllerOptions.steps_ahead` steps queued beyond the last one whose
metrics it has read, so the workers never wait for a round trip to the controller.

Step times are the workers' own measurements, carried back with each step's completion
(`step_seconds`): completions travel in batches, so when they reach the controller says
nothing about how long a step took.

A job's state changes in exactly one place (`Job.transition`), along the table below;
every change is journalled and published to whoever watches the job.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from controller import metrics
from controller.journal import Journal, StepRecord
from controller.logs import set_log_context
from slicewise.common.arrays import ArraySpec
from slicewise.common.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    InvalidTransitionError,
    NotFoundError,
)
from slicewise.common.mesh import GangShape, MeshAxis, MeshSpec, ShardingSpec
from slicewise.common.topology import slice_type as lookup_slice_type

if TYPE_CHECKING:
    from controller.core import Controller

log = logging.getLogger(__name__)

# Mesh axis names and the parallelism they carry.
DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = "data", "fsdp", "tensor"


class JobState(enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


_ALLOWED: dict[JobState, set[JobState]] = {
    JobState.QUEUED: {JobState.ADMITTED, JobState.FAILED, JobState.CANCELLED},
    JobState.ADMITTED: {JobState.STARTING, JobState.FAILED, JobState.CANCELLED},
    JobState.STARTING: {JobState.RUNNING, JobState.FAILED, JobState.CANCELLED},
    JobState.RUNNING: {
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.RECOVERING,
    },
    JobState.RECOVERING: {JobState.STARTING, JobState.FAILED, JobState.CANCELLED},
    JobState.SUCCEEDED: set(),
    JobState.FAILED: set(),
    JobState.CANCELLED: set(),
}


@dataclass(frozen=True)
class JobSpec:
    """What a user asked for; validated before the job is accepted."""

    program: str
    num_slices: int
    slice_type: str
    steps: int
    overrides: tuple[tuple[str, str], ...] = ()
    # The training mesh as (axis, dcn ways, ici ways); empty for the default.
    mesh: tuple[tuple[str, int, int], ...] = ()
    client: str = ""
    # A gang the submitter holds, to run on instead of allocating one (kept afterwards).
    gang_id: str = ""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise InvalidRequestError(f"steps must be at least 1, got {self.steps}")
        if self.num_slices < 1:
            raise InvalidRequestError(f"a job needs at least 1 slice, asked for {self.num_slices}")
        for name, _, _ in self.mesh:
            if name not in (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS):
                raise InvalidRequestError(
                    f"mesh axis {name!r} has no role; name training mesh axes "
                    f"{DATA_AXIS!r} (data parallel), {FSDP_AXIS!r} (FSDP) or {TENSOR_AXIS!r} "
                    "(tensor parallel)"
                )

    def mesh_for(self, gang: GangShape) -> MeshSpec:
        """The job's mesh on a gang; by default data parallel across slices (DCN) and FSDP
        over the chips of each slice (ICI)."""
        if self.mesh:
            mesh = MeshSpec(tuple(MeshAxis(n, d, i) for n, d, i in self.mesh))
        else:
            mesh = MeshSpec.build({DATA_AXIS: gang.num_slices}, {FSDP_AXIS: gang.chips_per_slice})
        mesh.check_fits(gang)
        return mesh

    def to_json(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "num_slices": self.num_slices,
            "slice_type": self.slice_type,
            "steps": self.steps,
            "overrides": dict(self.overrides),
            "mesh": [list(a) for a in self.mesh],
            "client": self.client,
            "gang_id": self.gang_id,
        }


@dataclass
class Job:
    """One training job and everything the controller knows about it."""

    job_id: str
    spec: JobSpec
    state: JobState = JobState.QUEUED
    step: int = 0
    gang_id: str = ""
    error: str = ""
    epoch: int = 0
    flops_per_step: float = 0.0
    mesh: MeshSpec | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=200))
    cancel_requested: bool = False
    watchers: set[asyncio.Queue[dict[str, Any]]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None

    def transition(self, new: JobState, *, epoch: int | None = None) -> None:
        """The one place a job's state changes. A change from an older epoch (a start that
        has since been superseded) is ignored.

        Raises:
            InvalidTransitionError: the table does not allow it.
        """
        if epoch is not None and epoch != self.epoch:
            log.info(
                "job %s: ignoring %s from epoch %d (now %d)",
                self.job_id,
                new.value,
                epoch,
                self.epoch,
            )
            return
        if new not in _ALLOWED[self.state]:
            raise InvalidTransitionError(f"job {self.job_id}: {self.state.value} -> {new.value}")
        if new is JobState.STARTING:
            self.epoch += 1
        self.state = new
        self.updated_at = time.time()

    @property
    def last(self) -> StepRecord | None:
        return self.recent[-1] if self.recent else None


class JobRunner:
    """Accepts jobs, drives their step loops on gangs, keeps and publishes their progress."""

    def __init__(self, controller: Controller, journal: Journal) -> None:
        self.controller = controller
        self.journal = journal
        self.jobs: dict[str, Job] = {}
        self._next = journal.next_job_number()
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
            )
            job.recent.extend(journal.steps(job.job_id, since=max(0, job.step - 200)))
            if not job.state.terminal:
                job.state, job.error = JobState.FAILED, "the controller restarted"
                journal.update_job(job.job_id, time.time(), state=job.state.value, error=job.error)
            self.jobs[job.job_id] = job

    # -- API --------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> Job:
        """Checks the request (program, config, slice type) and starts the job."""
        from programs.base import get_program

        program = get_program(spec.program)
        program.make_config(dict(spec.overrides))
        lookup_slice_type(spec.slice_type)
        if spec.gang_id:
            self._check_gang_free(spec.gang_id)
        job = Job(f"j{self._next}", spec)
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

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError(
                f"job {job_id!r} is unknown to this controller; `slicewise jobs` lists the jobs"
            )
        return job

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state.terminal:
            raise FailedPreconditionError(f"job {job_id} already {job.state.value}")
        job.cancel_requested = True
        if job.state in (JobState.QUEUED, JobState.ADMITTED, JobState.STARTING) and job.task:
            job.task.cancel()  # still waiting for slices or workers: stop waiting
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

    def steps(self, job_id: str) -> list[StepRecord]:
        self.get(job_id)
        return self.journal.steps(job_id)

    async def shutdown(self) -> None:
        for job in self.jobs.values():
            if job.task is not None and not job.task.done():
                job.cancel_requested = True
                job.task.cancel()
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
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
        set_log_context(job=job.job_id)
        gang = None
        owned = not job.spec.gang_id  # a gang the job allocated is released with it
        try:
            if owned:
                gang, _ = await self.controller.allocate(
                    job.spec.num_slices, job.spec.slice_type, client=f"job {job.job_id}"
                )
            else:
                gang = self.controller.manager.get(job.spec.gang_id)
            job.gang_id = gang.gang_id
            set_log_context(gang=gang.gang_id)
            self._move(
                job,
                JobState.ADMITTED,
                f"gang {gang.gang_id}: {', '.join(s.name for s in gang.slices)}",
            )
            self._move(job, JobState.STARTING)
            await self._train(job, gang)
            self._move(job, JobState.CANCELLED if job.cancel_requested else JobState.SUCCEEDED)
        except asyncio.CancelledError:
            job.error = job.error or "cancelled"
            self._move(job, JobState.CANCELLED, "cancelled")
        except Exception as exc:  # noqa: BLE001 - the job fails, the controller goes on
            job.error = f"{type(exc).__name__}: {exc}"
            log.exception("job %s failed", job.job_id)
            if not job.state.terminal:
                self._move(job, JobState.FAILED, job.error)
        finally:
            if owned and gang is not None and gang.gang_id in self.controller.gangs:
                await self.controller.release(
                    gang.gang_id, why=f"was released by job {job.job_id} ({job.state.value})"
                )

    async def _train(self, job: Job, gang: Any) -> None:
        import jax

        from programs.base import ParallelAxes, get_program, make_flat_train_fns

        c = self.controller
        spec = job.spec
        program = get_program(spec.program)
        config = program.make_config(dict(spec.overrides))
        mesh = job.mesh = spec.mesh_for(gang.shape)
        abstract = mesh.abstract()
        names = mesh.names
        axes = ParallelAxes.for_mesh(
            abstract,
            data=tuple(n for n in names if n == DATA_AXIS),
            fsdp=FSDP_AXIS if FSDP_AXIS in names else None,
            tensor=TENSOR_AXIS if TENSOR_AXIS in names else None,
        )
        init_art, step_art, flops = await asyncio.to_thread(
            _export, make_flat_train_fns, program, config, abstract, axes, gang.platform
        )
        job.flops_per_step = flops
        self.journal.update_job(job.job_id, time.time(), flops_per_step=flops)
        init = await c.register_program(gang.gang_id, f"{spec.program}.init", mesh, init_art)
        step_program = await c.register_program(
            gang.gang_id, f"{spec.program}.step", mesh, step_art
        )
        n_state = len(init.outputs)
        batch_sharding = ShardingSpec(
            mesh, (tuple(n for n in names if n in (DATA_AXIS, FSDP_AXIS)),)
        )
        batch_spec = program.batch_spec(config)
        fields = [
            ArraySpec.of(batch_spec[k].shape, batch_spec[k].dtype) for k in sorted(batch_spec)
        ]
        overrides = tuple(sorted(spec.overrides))
        key = np.asarray(jax.random.PRNGKey(program.seed(config)))
        key_record = await c.put_array(gang.gang_id, key, ShardingSpec(mesh, ()))
        _, state = c.execute(gang.gang_id, init.program_id, [key_record.handle])
        c.delete([key_record.handle])
        state_handles = [r.handle for r in state]
        tokens = program.tokens_per_step(config)
        self._move(job, JobState.RUNNING, f"mesh {mesh.describe()}, {flops / 1e9:.2f} GFLOP/step")

        pending: deque[tuple[int, Any]] = deque()
        metrics_index = len(step_program.outputs) - 1
        for step in range(job.step, spec.steps):
            if job.cancel_requested:
                break
            batch = c.load_batch(
                gang.gang_id, spec.program, overrides, step, batch_sharding, fields
            )
            ticket, outs = c.call(
                gang.gang_id,
                step_program.program_id,
                [*state_handles, *batch],
                report=[metrics_index],
            )
            c.delete([*state_handles, *batch, outs[n_state].handle])
            state_handles = [r.handle for r in outs[:n_state]]
            pending.append((step, ticket))
            while len(pending) > c.options.steps_ahead:
                await self._record(job, *pending.popleft(), tokens)
        while pending:
            await self._record(job, *pending.popleft(), tokens)
        c.delete(state_handles)

    async def _record(self, job: Job, step: int, ticket: Any, tokens: int) -> None:
        error = await ticket.done
        if error:
            raise FailedPreconditionError(f"step {step} failed: {error}")
        measured = step_record(step, ticket.values[0], ticket.ran, tokens)
        job.step = step + 1
        job.recent.append(measured)
        self.journal.add_steps(job.job_id, [measured])
        self.journal.update_job(job.job_id, measured.wall_time, step=job.step)
        metrics.STEPS.inc()
        metrics.STEP_SECONDS.observe(measured.step_time_s)
        self._publish(job, [measured])


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
    step: int, values: Sequence[float], ran: Mapping[int, tuple[int, int]], tokens: int
) -> StepRecord:
    """A step's record from its completion: the reported metrics vector
    [grad_norm, learning_rate, loss], when each host ran it (see `step_seconds`) and how
    many tokens a step trains on. The first step's time includes compiling the program,
    which each worker does when it launches it."""
    grad_norm, learning_rate, loss = (float(v) for v in values)
    seconds = step_seconds(ran)
    return StepRecord(
        step,
        loss,
        grad_norm,
        learning_rate,
        seconds,
        tokens / seconds if seconds > 0 else 0.0,
        max(end for _, end in ran.values()) / 1e9,
    )


def _export(
    make_fns: Any, program: Any, config: Any, abstract: Any, axes: Any, platform: str
) -> tuple[bytes, bytes, float]:
    """Exports the flat init and a step that returns its metrics as one vector
    [grad_norm, learning_rate, loss] (one fetch per step instead of three); also the
    step's FLOPs from XLA's cost analysis of the lowered program."""
    import jax
    import jax.numpy as jnp

    from programs.base import METRICS

    fns = make_fns(program, config, abstract, axes)
    state_shardings = [s.sharding for s in fns.layout.state]

    def step(
        state: list[jax.Array], batch: dict[str, jax.Array]
    ) -> tuple[list[jax.Array], jax.Array]:
        new_state, values = fns.step(state, batch)
        return new_state, jnp.stack([values[k] for k in METRICS])

    replicated = jax.sharding.NamedSharding(abstract, jax.sharding.PartitionSpec())
    packed = jax.jit(step, out_shardings=(state_shardings, replicated))
    init = jax.export.export(fns.init, platforms=[platform])(fns.layout.key)
    exported = jax.export.export(packed, platforms=[platform])(fns.layout.state, fns.layout.batch)
    lowered = packed.trace(fns.layout.state, fns.layout.batch).lower(lowering_platforms=(platform,))
    flops = float((lowered.cost_analysis() or {}).get("flops", 0.0))
    return bytes(init.serialize()), bytes(exported.serialize()), flops


def _spec_from_json(data: Mapping[str, Any]) -> JobSpec:
    return JobSpec(
        data["program"],
        data["num_slices"],
        data["slice_type"],
        data["steps"],
        tuple(sorted(data["overrides"].items())),
        tuple(tuple(a) for a in data["mesh"]),
        data.get("client", ""),
        data.get("gang_id", ""),
    )
