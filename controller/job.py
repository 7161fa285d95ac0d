"""A training job as the controller records it: its spec, its state and the one table of
allowed state changes (the job runner that drives it is jobs.py).

    QUEUED -> ADMITTED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED, and
    back to QUEUED when its gang is preempted (it resumes from its last checkpoint);
    RUNNING or STARTING -> RECOVERING -> STARTING when its gang fails under it (a new
    gang, the newest committed step restored), until its failure budget is spent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.chaos import Fault
from controller.dcn import DcnMeter, DcnTraffic
from controller.journal import StepRecord
from slicewise.common.errors import InvalidRequestError, InvalidTransitionError
from slicewise.common.mesh import GangShape, MeshAxis, MeshSpec

log = logging.getLogger(__name__)

# Checkpoint every this many steps unless the submitter says otherwise (0: never).
DEFAULT_CHECKPOINT_EVERY = 50
# The steps whose slowest sets a job's step deadlines: the latest ones, not all. A step
# slowed once (the steps right after a recovery run beside its last work: stash actors
# starting, a first call's setup) would otherwise loosen the lag deadline for the rest of
# the job: in a soak, one 1.07-s step made it 3.2 s instead of 2 s, and every later hang
# was detected that much later.
DEADLINE_STEPS = 200
# Keep this many of the newest committed checkpoints, plus the marked steps (0: all).
DEFAULT_KEEP_CHECKPOINTS = 3
# Gang failures a job recovers from before it fails (preemptions do not count).
DEFAULT_MAX_FAILURES = 3

# Mesh axis names and the parallelism they carry.
DATA_AXIS, FSDP_AXIS, TENSOR_AXIS, EXPERT_AXIS = "data", "fsdp", "tensor", "expert"
MESH_ROLES = {
    DATA_AXIS: "data parallel",
    FSDP_AXIS: "FSDP",
    TENSOR_AXIS: "tensor parallel",
    EXPERT_AXIS: "expert parallel",
}


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
    # -> QUEUED: its gang was preempted; it waits to be re-admitted.
    JobState.STARTING: {
        JobState.RUNNING,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.QUEUED,
        JobState.RECOVERING,
    },
    JobState.RUNNING: {
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.RECOVERING,
        JobState.QUEUED,
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
    # Save a checkpoint after every this many steps and after the last (0: never).
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    # Where (a directory or bucket path); "" until the runner picks the default.
    checkpoint_dir: str = ""
    # The newest committed checkpoints kept (0: all), and steps kept whatever that says
    # (more can be marked while the job runs: Job.keep_steps).
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS
    keep_steps: tuple[int, ...] = ()
    # Failures of its gang (a worker or host lost) it recovers from; then it fails.
    max_failures: int = DEFAULT_MAX_FAILURES
    # Elastic: the fewest slices it continues on after losing one (0: not elastic).
    elastic_min_slices: int = 0
    # Recover a lost slice from a surviving slice's replica (no step lost), see
    # worker/stash.py; keeps each step's input state until the step completes. None:
    # on whenever it can be (`peer_recovery_by_default`); the spec keeps the answer.
    peer_recovery: bool | None = None
    # Preemptions it yields to and resumes from before it fails (None: no limit).
    max_preemptions: int | None = None
    # The tenant that submitted it (controller/auth.py): only it (and admins) see it.
    tenant: str = "local"

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise InvalidRequestError(
                f"checkpoint_every must be >= 0 (0 turns checkpoints off), got "
                f"{self.checkpoint_every}"
            )
        if self.checkpoint_dir and not (
            "://" in self.checkpoint_dir or Path(self.checkpoint_dir).is_absolute()
        ):
            raise InvalidRequestError(
                f"checkpoint_dir {self.checkpoint_dir!r} is relative; give an absolute path "
                "(the controller and the workers do not share your working directory) or a "
                "bucket URL"
            )
        if self.max_preemptions is not None and self.max_preemptions < 0:
            raise InvalidRequestError(
                f"max_preemptions must be >= 0 (0: fail at the first), got {self.max_preemptions}"
            )
        if self.max_failures < 0:
            raise InvalidRequestError(
                f"max_failures must be >= 0 (0: fail at the first), got {self.max_failures}"
            )
        if self.keep_checkpoints < 0:
            raise InvalidRequestError(
                f"keep_checkpoints must be >= 0 (0 keeps all), got {self.keep_checkpoints}"
            )
        for step in self.keep_steps:
            check_keep_step(step, self.steps)
        if self.steps < 1:
            raise InvalidRequestError(f"steps must be at least 1, got {self.steps}")
        if self.num_slices < 1:
            raise InvalidRequestError(f"a job needs at least 1 slice, asked for {self.num_slices}")
        if self.elastic_min_slices:
            self._check_elastic()
        if self.peer_recovery is None:
            object.__setattr__(self, "peer_recovery", self.peer_recovery_by_default())
        elif self.peer_recovery:
            self._check_replicated("peer recovery")
        for name, _, _ in self.mesh:
            if name not in MESH_ROLES:
                roles = ", ".join(f"{n!r} ({role})" for n, role in MESH_ROLES.items())
                raise InvalidRequestError(
                    f"mesh axis {name!r} has no role; name training mesh axes {roles}"
                )

    def _check_elastic(self) -> None:
        if not 1 <= self.elastic_min_slices <= self.num_slices:
            raise InvalidRequestError(
                f"elastic_min_slices must be between 1 and the job's {self.num_slices} "
                f"slice(s), got {self.elastic_min_slices}"
            )
        if self.checkpoint_every == 0 or self.gang_id:
            raise InvalidRequestError(
                "an elastic job needs checkpoints (checkpoint_every > 0), which it continues "
                "from on fewer slices, and a gang of its own (no gang_id)"
            )
        self._check_replicated("an elastic job")

    def peer_recovery_by_default(self) -> bool:
        """Whether a job that does not say recovers a lost slice from a surviving
        replica: when it runs on more than one slice, each holding a whole replica, on a
        gang of its own, and is not elastic (an elastic job continues from its checkpoint
        on fewer slices)."""
        if self.num_slices < 2 or self.elastic_min_slices or self.gang_id:
            return False
        return all(dcn <= 1 or name == DATA_AXIS for name, dcn, _ in self.mesh)

    def _check_replicated(self, what: str) -> None:
        """Every slice must hold a whole replica: only the data axis may span slices."""
        for name, dcn, _ in self.mesh:
            if dcn > 1 and name != DATA_AXIS:
                raise InvalidRequestError(
                    f"{what} needs a whole replica of the state on every slice, so only the "
                    f"{DATA_AXIS!r} axis may span slices; mesh axis {name!r} spans {dcn}"
                )

    def mesh_for(self, gang: GangShape) -> MeshSpec:
        """The job's mesh on a gang; by default data parallel across slices (DCN) and FSDP
        over the chips of each slice (ICI). A mesh that leaves one of the two out gets its
        default: `--dcn expert=2` alone is (expert=2 over slices, fsdp=chips inside them).
        An elastic job's data axis spans however many slices its gang has (the global batch
        stays: each slice takes more of it)."""
        if not self.mesh:
            mesh = MeshSpec.build({DATA_AXIS: gang.num_slices}, {FSDP_AXIS: gang.chips_per_slice})
            mesh.check_fits(gang)
            return mesh
        axes = [MeshAxis(n, d, i) for n, d, i in self.mesh]
        if self.elastic_min_slices:
            axes = [
                MeshAxis(a.name, gang.num_slices if a.name == DATA_AXIS else a.dcn, a.ici)
                for a in axes
            ]
        names = {a.name for a in axes}
        if gang.num_slices > 1 and all(a.dcn == 1 for a in axes) and DATA_AXIS not in names:
            axes.insert(0, MeshAxis(DATA_AXIS, gang.num_slices, 1))
        if gang.chips_per_slice > 1 and all(a.ici == 1 for a in axes) and FSDP_AXIS not in names:
            axes.append(MeshAxis(FSDP_AXIS, 1, gang.chips_per_slice))
        mesh = MeshSpec(tuple(axes))
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
            "checkpoint_every": self.checkpoint_every,
            "checkpoint_dir": self.checkpoint_dir,
            "keep_checkpoints": self.keep_checkpoints,
            "keep_steps": list(self.keep_steps),
            "max_failures": self.max_failures,
            "elastic_min_slices": self.elastic_min_slices,
            "peer_recovery": self.peer_recovery,
            "max_preemptions": self.max_preemptions,
            "tenant": self.tenant,
        }


@dataclass(frozen=True)
class PeerSource:
    """A surviving slice's replica of a job's state, stashed on its hosts when its gang
    failed (worker/stash.py): the input state of `step`, as `handles` on the old gang."""

    step: int
    handles: tuple[str, ...]
    stashes: tuple[str, ...]


@dataclass
class Recovery:
    """One recovery of a job from a failure of its gang (times: time.time(), 0 unknown).

    Attributes:
        cause: the failure as detected, host and cause named.
        failed_at_step: steps completed when it was detected.
        fault_at: when the fault happened, where known (an injected fault; a stall's start).
        detected_at: when the gang failed.
        resumed_from: the step the job continued from, once it did.
        resumed_at: when the first step after the recovery finished (worker's clock).
    """

    cause: str
    failed_at_step: int
    fault_at: float
    detected_at: float
    resumed_from: int | None = None
    resumed_at: float = 0.0
    source: str = "checkpoint"  # or "peer": a surviving slice's replica

    @property
    def steps_lost(self) -> int:
        """Steps completed before the failure that run again."""
        if self.resumed_from is None:
            return 0
        return max(0, self.failed_at_step - self.resumed_from)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    # Shapes of the program's statistics at the end of each step's metrics vector.
    stat_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Bytes and messages a step sends between slices, predicted from the compiled step
    # (controller/dcn.py); None until the first step of a start has compiled it.
    dcn_predicted: DcnTraffic | None = None
    # The measurement of traffic between slices on the simulation, and where its last
    # reading was taken (the job's step count then); None where it is not measured.
    dcn_meter: DcnMeter | None = None
    dcn_read_at: tuple[int, int, int] = (0, 0, 0)  # (step, bytes, segments)
    step_program_id: str = ""  # the step program of the current start
    placements: int = 0  # times its experts were re-placed over the slices (placement.py)
    mesh: MeshSpec | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=200))
    # When the latest step completed, or the latest start began running (time.monotonic).
    progressed_at: float = 0.0
    cancel_requested: bool = False
    # The newest checkpoint step known committed in storage (None: none yet).
    committed_step: int | None = None
    # Checkpoint saves queued, oldest first, whose commit has not been seen yet.
    saving: deque[tuple[int, Any]] = field(default_factory=deque)
    watchers: set[asyncio.Queue[dict[str, Any]]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    # Times its gang was preempted, and the step it last resumed from after one (or
    # after a controller restart).
    preemptions: int = 0
    resumed_from: int | None = None
    # Times a controller restart found it unfinished and started it again.
    restarts: int = 0
    # Times its gang failed under it and it recovered (or tried to).
    failures: int = 0
    # Checkpoint steps kept beyond the newest `spec.keep_checkpoints`: the spec's and
    # those marked since (journalled; every save tells the workers).
    keep_steps: set[int] = field(default_factory=set)
    # Set when the controller stops: the job saves what it reached by `stop_deadline`
    # (time.monotonic()) and stops, unfinished, for the next controller to continue.
    interrupted: bool = False
    stop_deadline: float = 0.0
    # Each recovery from a failure of its gang (journalled), and the faults injected
    # into it that wait for a step (controller/chaos.py).
    recoveries: list[Recovery] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    # The longest of the latest `DEADLINE_STEPS` steps (as the workers measured them; a
    # start's first step aside, which compiles or loads its program): the step and lag
    # deadlines are multiples of it (controller/health.py).
    slowest_step_s: float = 0.0
    deadline_steps: deque[float] = field(default_factory=lambda: deque(maxlen=DEADLINE_STEPS))
    compiled_at: int = -1  # the first step of the latest start: it compiled the program
    gang_slices: int = 0  # the slices of the gang it runs on now (fewer: elastic)
    # Peer recovery: each unfinished step's input state (step -> handles), deleted when
    # the step completes; and the replica a recovery stashed for the next gang.
    live_states: dict[int, list[str]] = field(default_factory=dict)
    peer: PeerSource | None = None

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

    def note_step_time(self, step: int, step_time_s: float) -> None:
        """Takes a completed step's time into `slowest_step_s` (unless it is the first
        of the latest start: that one compiled or loaded its program)."""
        if step != self.compiled_at:
            self.deadline_steps.append(step_time_s)
            self.slowest_step_s = max(self.deadline_steps)


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
        # Jobs journalled before checkpoints existed never saved any.
        data.get("checkpoint_every", 0),
        data.get("checkpoint_dir", ""),
        # Jobs journalled before retention existed kept every checkpoint.
        data.get("keep_checkpoints", 0),
        tuple(data.get("keep_steps", ())),
        data.get("max_failures", DEFAULT_MAX_FAILURES),
        data.get("elastic_min_slices", 0),
        data.get("peer_recovery", False),
        data.get("max_preemptions"),
        # Jobs journalled before tenants existed were the local admin's.
        data.get("tenant", "local"),
    )


def check_keep_step(step: int, steps: int) -> None:
    """Raises InvalidRequestError unless `step` can be a checkpoint of a job of `steps`
    steps (a checkpoint step counts the steps done: 1 to `steps`)."""
    if not 1 <= step <= steps:
        raise InvalidRequestError(
            f"checkpoint step {step} cannot be kept: a job of {steps} steps saves steps 1 "
            f"to {steps}"
        )
