"""The operations a controller sends to a gang's workers, each stamped with its place in
the gang's sequence, and what comes back. Plain data: they travel on the control channel
in the codec of slicewise/common/codec.py, which carries only the types it registers, so
a new operation goes into `Op` and into `codec.REGISTERED`, with fields of the types the
codec knows (ints, floats, strs, bytes, tuples of them, mesh and sharding specs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slicewise.common.mesh import MeshSpec, ShardingSpec


@dataclass(frozen=True)
class PutOp:
    """Store an array from the pieces staged under `staged_key` (sent over the data port)."""

    seq: int
    handle: str
    shape: tuple[int, ...]
    dtype: str
    sharding: ShardingSpec
    staged_key: str


@dataclass(frozen=True)
class LoadOp:
    """Deserialize a jax.export artifact and keep it ready to call on `mesh`; with
    `ahead`, begin compiling it at once, in the background (else its first call does)."""

    seq: int
    program_id: str
    serialized: bytes = field(repr=False)
    mesh: MeshSpec
    name: str = ""
    ahead: bool = True


@dataclass(frozen=True)
class ExecOp:
    """Call a loaded program on stored arrays and store its outputs. The values of the
    outputs listed in `report` (small, replicated ones, e.g. a training step's metrics)
    come back with the completion, from process 0: no fetch needed. With `repeat` > 1
    the program runs that many times, each run on the previous run's outputs, and only
    the last run's outputs are stored (a chain of calls as one operation)."""

    seq: int
    program_id: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    report: tuple[int, ...] = ()
    repeat: int = 1


@dataclass(frozen=True)
class DeleteOp:
    """Drop arrays from the buffer table."""

    seq: int
    handles: tuple[str, ...]


@dataclass(frozen=True)
class PinOp:
    """Hold a reference to an array at this point of the sequence so that a later
    out-of-band read sees exactly it, even if the handle is deleted meanwhile."""

    seq: int
    handle: str
    pin_id: str


@dataclass(frozen=True)
class BatchOp:
    """Build this host's rows of a training program's global batch for `step`, from
    installed data code (programs/), and store each batch field as an array. No host, and
    not the controller, ever holds the whole batch."""

    seq: int
    program: str
    overrides: tuple[tuple[str, str], ...]
    step: int
    sharding: ShardingSpec
    handles: tuple[str, ...]  # one per batch field, in sorted field order


@dataclass(frozen=True)
class SaveOp:
    """Start an asynchronous checkpoint of stored arrays (a job's state leaves, in order)
    at `step` into `directory`, with `meta` (a JSON object as text: the data position and
    whatever else a resume needs). Completes once the save is queued on the worker's
    save thread for that directory (which copies the arrays to host memory and commits
    in the background, in queue order; a failure surfaces at the next save, restore or
    close of the directory); the commit is a marker in storage (see
    worker/checkpoint.py). Every worker of the gang applies it in sequence order: it
    holds barriers. `barrier_prefix` keeps one job's barriers apart from another's."""

    seq: int
    directory: str
    step: int
    handles: tuple[str, ...]
    meta: str
    barrier_prefix: str = ""
    # Retention: keep the newest `max_to_keep` committed steps (0: all) and the steps in
    # `keep_steps`; older ones are deleted as new ones commit.
    max_to_keep: int = 0
    keep_steps: tuple[int, ...] = ()


@dataclass(frozen=True)
class RestoreOp:
    """Read the committed checkpoint `step` of `directory` into new arrays: one per
    handle, with that shape, dtype and sharding on the gang's mesh. Fails unless the
    step is committed and its metadata has the values in `expect` (e.g. the seed and
    global batch size: the data position of a resumed run must be the saved one)."""

    seq: int
    directory: str
    step: int
    handles: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    shardings: tuple[ShardingSpec, ...]
    expect: tuple[tuple[str, Any], ...] = ()
    barrier_prefix: str = ""


@dataclass(frozen=True)
class CloseCheckpointsOp:
    """Wait for the checkpoint save in flight into `directory` to commit (or fail: then
    this fails), and let go of the directory. A job's last checkpoint operation."""

    seq: int
    directory: str
    barrier_prefix: str = ""
    timeout_s: float = 1200.0


@dataclass(frozen=True)
class PeerRestoreOp:
    """Build new arrays from pieces of a failed gang's surviving workers, held in their
    hosts' stashes (worker/stash.py): array i of `handles` from the pieces of
    `sources[i]` (its handle on the old gang), with that shape, dtype and sharding. Each
    worker reads only the pieces its own devices need, from whichever stash has them."""

    seq: int
    handles: tuple[str, ...]
    sources: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    shardings: tuple[ShardingSpec, ...]
    stashes: tuple[str, ...]  # Ray actor names


@dataclass(frozen=True)
class HangOp:
    """Fault injection (`slicewise chaos hang-collective`): the worker's executor stops
    here for `seconds`, as a host stuck in a collective would. Sent to one worker, with
    an empty DeleteOp in its place for the others: they go on to the next program and
    wait in its collectives for the host that never comes."""

    seq: int
    seconds: float


Op = (
    PutOp
    | LoadOp
    | ExecOp
    | DeleteOp
    | PinOp
    | BatchOp
    | SaveOp
    | RestoreOp
    | CloseCheckpointsOp
    | PeerRestoreOp
    | HangOp
)


@dataclass(frozen=True)
class OpResult:
    """What became of one op on one worker: `error` is None when it succeeded; `values`
    are the reported outputs' values (see ExecOp.report), if any.

    `started_ns` and `finished_ns` are when the worker's execution of the op began and
    ended, in the worker's wall clock (0 when it never ran). For a program that is the
    time it had the host's devices to itself: from its launch, or from when the program
    before it finished if that was later, to when its outputs were ready (see
    worker/executor.py). Completions travel in batches, so when one reaches the
    controller says nothing about when the op ran: these say it."""

    seq: int
    error: str | None = None
    values: tuple[Any, ...] | None = None
    started_ns: int = 0
    finished_ns: int = 0

    @property
    def seconds(self) -> float:
        """How long the op ran on the worker (0.0 when it never ran)."""
        return (self.finished_ns - self.started_ns) / 1e9


@dataclass(frozen=True)
class Completions:
    """One frame of a worker's completions, in the order they completed, as columns:
    operation `seqs[i]` ran from `started_ns[i]` to `finished_ns[i]` (see OpResult). The
    few that failed or report values are also in `full`, whole.

    Columns, not a list of OpResult: every call of every client is a completion from
    every host of its gang, so this is the controller's cost per host per call. As tagged
    maps each completion was encoded through a Python callback on the worker and decoded
    into an object on the controller; as columns msgpack packs and unpacks the ints
    itself and the controller reads them where they lie (controller/dispatch.py)."""

    seqs: tuple[int, ...]
    started_ns: tuple[int, ...]
    finished_ns: tuple[int, ...]
    full: tuple[OpResult, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.seqs) == len(self.started_ns) == len(self.finished_ns):
            raise ValueError(
                f"columns of different lengths: {len(self.seqs)} seqs, "
                f"{len(self.started_ns)} starts, {len(self.finished_ns)} ends"
            )
        if self.full and not {r.seq for r in self.full} <= set(self.seqs):
            raise ValueError("a full completion names an operation the columns do not")

    @classmethod
    def of(cls, results: Sequence[OpResult]) -> Completions:
        return cls(
            tuple([r.seq for r in results]),
            tuple([r.started_ns for r in results]),
            tuple([r.finished_ns for r in results]),
            tuple([r for r in results if r.error is not None or r.values is not None]),
        )

    def results(self) -> list[OpResult]:
        """The completions as OpResults, in order."""
        full = {r.seq: r for r in self.full}
        return [
            full[seq] if seq in full else OpResult(seq, None, None, started, finished)
            for seq, started, finished in zip(
                self.seqs, self.started_ns, self.finished_ns, strict=True
            )
        ]


def op_kind(op: Op) -> str:
    """`exec`, `save`, `hang`...: an operation's type in a word (as metrics, spans and
    heartbeats name it)."""
    kind = _KINDS.get(type(op))
    if kind is None:  # once per type: it is asked for every operation the controller settles
        kind = _KINDS[type(op)] = type(op).__name__.removesuffix("Op").lower()
    return kind


_KINDS: dict[type, str] = {}
