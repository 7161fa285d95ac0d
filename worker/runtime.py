"""The JAX side of a host worker: joins the gang's jax.distributed cluster, builds
meshes, and applies the controller's operations to the buffer table."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from slicewise.common import heap
from slicewise.common.arrays import dtype_of
from slicewise.common.mesh import (
    GangShape,
    Index,
    MeshSpec,
    ShardingSpec,
    index_key,
    normalize_index,
)
from slicewise.common.ops import (
    BatchOp,
    CloseCheckpointsOp,
    DeleteOp,
    ExecOp,
    HangOp,
    LoadOp,
    Op,
    PeerRestoreOp,
    PinOp,
    PutOp,
    RestoreOp,
    SaveOp,
    op_kind,
)
from worker import executables
from worker.buffers import BufferTable
from worker.stash import PieceKey

if TYPE_CHECKING:
    from collections.abc import Iterator

    from worker.checkpoint import QueuedCheckpointer

log = logging.getLogger(__name__)
_NO_SETUP = contextlib.nullcontext()


@dataclass
class _Program:
    name: str
    exported: Any
    mesh: Any
    call: Any
    in_shardings: tuple[Any, ...]
    num_outputs: int
    program_id: str = ""  # the controller's id (content and mesh): the key of a kept one
    called: bool = False  # the first call waits for the compile started at load
    # Its executable, compiled in the background from the moment it is loaded (so that
    # compiling overlaps restoring a checkpoint and building the first batch); `compiled`
    # is set by the first call, from `compiling_ahead`.
    compiled: Any = None
    compiling_ahead: Future[Any] | None = None
    # Whether it takes its arrays as plain positional arguments (no pytree to rebuild),
    # and how its result becomes the list of its output arrays.
    flat_in: bool = False
    leaves: Callable[[Any], list[Any]] = list
    # Once compiled ahead and when it takes its arrays as plain positional arguments:
    # the executable, called with the argument list as it is (the usual case), and
    # whether its result is one array (made the output list here, with no call).
    direct: Any = None
    single: bool = False


def _one(output: Any) -> list[Any]:
    """The output list of a program whose result is a single array."""
    return [output]


class _Outputs:
    """Pending device work: the outputs of one launched program, and the ones whose
    values go back with the completion."""

    __slots__ = ("_arrays", "_report")

    def __init__(self, arrays: list[Any], report: list[Any]) -> None:
        self._arrays = arrays
        self._report = report

    def ready(self) -> bool:
        for a in self._arrays:  # noqa: SIM110 - asked before every launch: no generator
            if not a.is_ready():
                return False
        return True

    def wait(self) -> tuple[np.ndarray, ...] | None:
        for a in self._arrays:
            a.block_until_ready()
        if not self._report:
            return None
        # Replicated outputs: this process's first shard is the whole value.
        return tuple(np.asarray(a.addressable_shards[0].data) for a in self._report)


class JaxRuntime:
    """One process's view of a gang: its devices, meshes, programs and arrays."""

    def __init__(self, gang: GangShape, process_id: int, *, window: int = 3) -> None:
        self.gang = gang
        self.process_id = process_id
        # The most programs launched and not finished at once (the executor's window):
        # the runs of a repeated call keep to it among themselves, the executor having
        # let the programs before the call finish first.
        self.window = window
        self.buffers = BufferTable()
        self._meshes: dict[MeshSpec, Any] = {}
        self._programs: dict[str, _Program] = {}
        self._pins: dict[str, Any] = {}
        # Pieces that arrived over the data port, by key, with the deadline of the
        # capability a client's direct put showed (0: the controller sent them).
        self._staged: dict[str, tuple[list[tuple[Index, np.ndarray]], int]] = {}
        # Keys of direct puts taken (by their PutOp) or dropped (abandoned), until their
        # capability expires: the capability may not stage anything under them again.
        self._closed: OrderedDict[str, int] = OrderedDict()
        self._staged_lock = threading.Lock()
        self._configs: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        # A program's data being loaded ahead of its first batch (prepare_data).
        self._loading: dict[tuple[str, tuple[tuple[str, str], ...]], Future[Any]] = {}
        self._loading_lock = threading.Lock()
        self._devices: list[Any] = []
        # Open checkpoint directories, by (directory, barrier prefix); created by the
        # first checkpoint operation on them (jax.distributed is up by then).
        self._checkpointers: dict[tuple[str, str], QueuedCheckpointer] = {}
        # The program being compiled (its first call), for the heartbeat: a host that
        # compiles is busy, not stuck, and the others wait for it in the first collective.
        self.compiling = ""
        # One background thread compiles loaded programs ahead of their first call.
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="compile-ahead")

    # -- formation -----------------------------------------------------------------

    def initialize(
        self, coordinator: str, *, partition_index: int, bind_address: str | None, timeout_s: int
    ) -> dict[str, Any]:
        """Joins the gang's jax.distributed cluster; blocks until every process has joined."""
        import jax

        if jax.config.jax_platforms in (None, "", "cpu"):  # type: ignore[attr-defined]
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            # JAX's persistent cache reads an XLA:CPU executable back as it was stored,
            # and such a one runs a loop's collectives in no fixed order with the ones
            # around it (docs/restarts.md). Workers keep their own, rewritten to keep
            # the order (worker/executables.py).
            jax.config.update("jax_enable_compilation_cache", False)
        started = time.monotonic()
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=self.gang.num_processes,
            process_id=self.process_id,
            partition_index=partition_index,
            coordinator_bind_address=bind_address,
            initialization_timeout=timeout_s,
        )
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if len(devices) != self.gang.num_devices:
            raise RuntimeError(
                f"jax.distributed formed with {len(devices)} devices, expected "
                f"{self.gang.num_devices} ({self.gang})"
            )
        local = [d for d in devices if d.process_index == jax.process_index()]
        if len(local) != self.gang.chips_per_host:
            raise RuntimeError(
                f"this host has {len(local)} local devices, expected {self.gang.chips_per_host}"
            )
        self._devices = devices
        # jax and its distributed runtime are loaded for good (slicewise/common/heap.py).
        heap.settle("the gang formed")
        return {
            "process_index": jax.process_index(),
            "platform": devices[0].platform,
            "num_devices": len(devices),
            "local_devices": [str(d) for d in local],
            "seconds": round(time.monotonic() - started, 3),
        }

    def mesh(self, spec: MeshSpec) -> Any:
        from jax.sharding import Mesh

        mesh = self._meshes.get(spec)
        if mesh is None:
            grid = spec.device_grid(self.gang)
            devices = np.empty(grid.shape, dtype=object)
            for pos in np.ndindex(*grid.shape):
                devices[pos] = self._devices[int(grid[pos])]
            mesh = self._meshes[spec] = Mesh(devices, spec.names)
        return mesh

    def named_sharding(self, spec: ShardingSpec) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh(spec.mesh), PartitionSpec(*spec.partition_spec()))

    # -- operations ----------------------------------------------------------------

    def apply(self, op: Op) -> _Outputs | None:
        """Applies one operation; returns the pending device work, if any."""
        if isinstance(op, ExecOp):
            return self._execute(op)
        if isinstance(op, PutOp):
            self._put(op)
        elif isinstance(op, LoadOp):
            self._load(op)
        elif isinstance(op, DeleteOp):
            self.buffers.delete(op.handles)
        elif isinstance(op, PinOp):
            self._pins[op.pin_id] = self.buffers.get(op.handle)
        elif isinstance(op, BatchOp):
            self._batch(op)
        elif isinstance(op, SaveOp):
            self._save(op)
        elif isinstance(op, RestoreOp):
            self._restore(op)
        elif isinstance(op, CloseCheckpointsOp):
            self._close_checkpointer(op)
        elif isinstance(op, PeerRestoreOp):
            self._peer_restore(op)
        elif isinstance(op, HangOp):
            log.warning("fault injection: this host's executor stops for %g s", op.seconds)
            time.sleep(op.seconds)
        else:
            raise TypeError(f"unknown operation {op!r}")
        return None

    def describe(self, op: Op) -> tuple[str, dict[str, Any]]:
        """A span name and arguments for an operation, for the timeline."""
        if isinstance(op, ExecOp):
            program = self._programs.get(op.program_id)
            return (
                f"execute {program.name if program else op.program_id[:12]}",
                {"program": op.program_id[:12], "outputs": list(op.outputs)},
            )
        if isinstance(op, PutOp):
            return "put", {"handle": op.handle}
        if isinstance(op, LoadOp):
            return f"load {op.name}", {"program": op.program_id[:12]}
        if isinstance(op, PinOp):
            return "pin", {"handle": op.handle}
        if isinstance(op, BatchOp):
            return f"batch {op.program} step {op.step}", {"step": op.step}
        if isinstance(op, SaveOp):
            return f"save step {op.step}", {"step": op.step, "directory": op.directory}
        if isinstance(op, RestoreOp):
            return f"restore step {op.step}", {"step": op.step, "directory": op.directory}
        if isinstance(op, CloseCheckpointsOp):
            return "close checkpoints", {"directory": op.directory}
        return op_kind(op), {}

    def on_failure(self, op: Op, error: str) -> None:
        """Marks what a failed operation should have produced as failed, too."""
        if isinstance(op, ExecOp):
            self.buffers.fail(op.outputs, f"program {op.program_id[:12]} failed: {error}")
        elif isinstance(op, PutOp):
            self.buffers.fail((op.handle,), f"upload failed: {error}")
        elif isinstance(op, BatchOp):
            self.buffers.fail(op.handles, f"building the batch of step {op.step} failed: {error}")
        elif isinstance(op, RestoreOp):
            self.buffers.fail(op.handles, f"restoring checkpoint step {op.step} failed: {error}")

    def _batch(self, op: BatchOp) -> None:
        arrays = self.build_batch(op.program, op.overrides, op.step, op.sharding)
        for handle, array in zip(op.handles, arrays, strict=True):
            self.buffers.put(handle, array)

    def prepare_data(self, program_name: str, overrides: tuple[tuple[str, str], ...]) -> None:
        """Begins loading a program's config and data in the background, so that its
        first batch on this host does not wait for the whole of it."""
        self._data_loading((program_name, overrides))

    def _data_loading(self, key: tuple[str, tuple[tuple[str, str], ...]]) -> Future[Any]:
        """The loading of a program's config and data, begun now unless it was already."""
        with self._loading_lock:
            loading = self._loading.get(key)
            if loading is None:
                loading = self._loading[key] = Future()
                threading.Thread(
                    target=_load_data, args=(key, loading), name="data-load", daemon=True
                ).start()
            return loading

    def build_batch(
        self,
        program_name: str,
        overrides: tuple[tuple[str, str], ...],
        step: int,
        sharding_spec: ShardingSpec,
    ) -> list[Any]:
        """This host's rows of a program's global batch for `step`, as global arrays (one
        per batch field, in sorted field order); other hosts build the other rows."""
        import jax

        from programs.base import get_program

        key = (program_name, overrides)
        if key not in self._configs:
            # The first batch of a program on this host imports its code and reads its
            # data (the LM's corpus, digested), unless prepare_data began that ahead.
            with self._setting_up(f"loading the data of {program_name}"):
                loading = self._data_loading(key)
                try:
                    self._configs[key] = loading.result()
                finally:
                    with self._loading_lock:  # a failed load is tried again next time
                        if self._loading.get(key) is loading:
                            del self._loading[key]
        program, config = get_program(program_name), self._configs[key]
        spec = program.batch_spec(config)
        fields = sorted(spec)
        sharding = self.named_sharding(sharding_spec)
        rows = spec[fields[0]].shape[0]
        blocks: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        per_field: dict[str, list[Any]] = {f: [] for f in fields}
        for device, index in sharding.addressable_devices_indices_map(
            spec[fields[0]].shape
        ).items():
            lo, hi = index[0].indices(rows)[:2]
            if (lo, hi) not in blocks:  # replicas on this host share one read
                blocks[(lo, hi)] = program.host_batch(
                    config, step, lo // (hi - lo), rows // (hi - lo)
                )
            for f in fields:
                per_field[f].append(jax.device_put(blocks[(lo, hi)][f], device))
        return [
            jax.make_array_from_single_device_arrays(spec[f].shape, sharding, per_field[f])
            for f in fields
        ]

    @contextlib.contextmanager
    def _setting_up(self, what: str) -> Iterator[None]:
        """One-time local setup (a compile, opening a checkpoint directory, loading a
        program's data): the heartbeat says so while it lasts, and the controller's step
        watchdog does not take the wait for a stuck collective."""
        self.compiling = what
        try:
            yield
        finally:
            self.compiling = ""

    # -- checkpoints -----------------------------------------------------------------

    def _checkpointer(self, directory: str, barrier_prefix: str) -> QueuedCheckpointer:
        key = (directory, barrier_prefix)
        checkpointer = self._checkpointers.get(key)
        if checkpointer is None:
            # One-time local setup, like a compile: the heartbeat says so, and the
            # controller's step watchdog does not take it for a stuck collective (the
            # first save of a job imports orbax; under load that took over the 8-s
            # step timeout of the recovery tests, and the job "recovered" from it).
            with self._setting_up(f"checkpointing in {directory}"):
                from worker.checkpoint import HostCheckpointer, QueuedCheckpointer

                checkpointer = self._checkpointers[key] = QueuedCheckpointer(
                    HostCheckpointer(directory, barrier_prefix=barrier_prefix or None)
                )
        return checkpointer

    def _save(self, op: SaveOp) -> None:
        import json

        state = [self.buffers.get(h) for h in op.handles]
        checkpointer = self._checkpointer(op.directory, op.barrier_prefix)
        # A directory's first save is one-time setup as well: orbax's first copy to host
        # memory and first write (a job's first save ran past the recovery tests' 8-s
        # step timeout under load, and the job "recovered" from it).
        first = checkpointer.saves == 0
        with self._setting_up(f"the first save in {op.directory}") if first else _NO_SETUP:
            # Queued to the directory's save thread, which copies the arrays to host
            # memory and commits them in the background, in queue order on every host.
            checkpointer.save(
                op.step,
                state,
                json.loads(op.meta),
                max_to_keep=op.max_to_keep or None,
                keep_steps=op.keep_steps,
                # The copy to host memory while this thread launches the next steps hung
                # a 200-step job on the simulation (orbax's D2H on the save thread never
                # returned, 2 processes with gloo collectives in flight): the copy is
                # done before the next operation, as orbax's own async save does it;
                # only the commit goes on behind.
                wait_for_copy=True,
            )

    def _restore(self, op: RestoreOp) -> None:
        import jax

        target = [
            jax.ShapeDtypeStruct(shape, dtype_of(dtype), sharding=self.named_sharding(sharding))
            for shape, dtype, sharding in zip(op.shapes, op.dtypes, op.shardings, strict=True)
        ]
        checkpointer = self._checkpointer(op.directory, op.barrier_prefix)
        state, meta = checkpointer.restore(op.step, target)
        wrong = {k: (meta.get(k), v) for k, v in op.expect if meta.get(k) != v}
        if wrong:
            raise ValueError(
                f"checkpoint step {op.step} in {op.directory} does not fit this job: "
                + ", ".join(
                    f"{k} is {saved!r} there, {want!r} here" for k, (saved, want) in wrong.items()
                )
            )
        if len(state) != len(op.handles):
            raise ValueError(
                f"checkpoint step {op.step} holds {len(state)} arrays, the job {len(op.handles)}"
            )
        for handle, array in zip(op.handles, state, strict=True):
            self.buffers.put(handle, array)

    def pieces_of(self, handles: list[str]) -> list[tuple[PieceKey, np.ndarray]]:
        """Every distinct piece this host holds of each array, in host memory."""
        out: list[tuple[PieceKey, np.ndarray]] = []
        for handle in handles:
            array = self.buffers.get(handle)
            seen = set()
            for shard in array.addressable_shards:
                key = index_key(shard.index, array.shape)
                if key not in seen:
                    seen.add(key)
                    out.append(((handle, key), np.asarray(shard.data)))
        return out

    def _peer_restore(self, op: PeerRestoreOp) -> None:
        import jax
        import ray

        stashes = [ray.get_actor(name) for name in op.stashes]
        held: list[list[PieceKey]] = ray.get([s.keys.remote() for s in stashes])
        where = {key: stash for stash, keys in zip(stashes, held, strict=True) for key in keys}
        for handle, source, shape, dtype, spec in zip(
            op.handles, op.sources, op.shapes, op.dtypes, op.shardings, strict=True
        ):
            sharding = self.named_sharding(spec)
            wanted = {
                device: (source, index_key(index, shape))
                for device, index in sharding.addressable_devices_indices_map(shape).items()
            }
            missing = sorted({k for k in wanted.values() if k not in where}, key=str)
            if missing:
                raise RuntimeError(
                    f"no surviving stash holds piece {missing[0][1]} of the state array "
                    f"{source}; the job continues from its checkpoint instead"
                )
            keys = sorted(set(wanted.values()), key=str)
            by_stash: dict[Any, list[PieceKey]] = {}
            for key in keys:
                by_stash.setdefault(where[key], []).append(key)
            pieces: dict[PieceKey, np.ndarray] = {}
            for stash, asked in by_stash.items():
                pieces.update(zip(asked, ray.get(stash.get.remote(asked)), strict=True))
            arrays = []
            for device, key in wanted.items():
                piece = pieces[key]
                if piece.dtype != dtype_of(dtype):
                    raise RuntimeError(f"piece of {source} is {piece.dtype}, expected {dtype}")
                arrays.append(jax.device_put(piece, device))
            self.buffers.put(
                handle, jax.make_array_from_single_device_arrays(shape, sharding, arrays)
            )

    def _close_checkpointer(self, op: CloseCheckpointsOp) -> None:
        checkpointer = self._checkpointers.pop((op.directory, op.barrier_prefix), None)
        if checkpointer is not None:
            checkpointer.close(timeout=op.timeout_s)

    def stage(self, key: str, pieces: list[tuple[Index, np.ndarray]], expires: int = 0) -> None:
        """Keeps pieces that arrived over the data port until their PutOp comes;
        `expires`: the deadline of the capability of a client's direct put.

        Raises:
            KeyError: that direct put was taken or dropped already.
        """
        with self._staged_lock:
            while self._closed and next(iter(self._closed.values())) <= time.time():
                self._closed.popitem(last=False)
            if expires and key in self._closed:
                raise KeyError(f"the direct put {key} has ended (finished or abandoned)")
            self._staged[key] = (pieces, expires)

    def drop_staged(self, key: str, expires: int) -> None:
        """Drops the pieces of an abandoned direct put, now and when they arrive later
        (until its capability, valid until `expires`, has expired)."""
        with self._staged_lock:
            self._staged.pop(key, None)
            self._closed[key] = expires

    def _put(self, op: PutOp) -> None:
        import jax

        with self._staged_lock:
            staged, expires = self._staged.pop(op.staged_key, (None, 0))
            if expires:
                self._closed[op.staged_key] = expires
        if staged is None:
            raise RuntimeError(f"the pieces of {op.handle} never arrived on this worker")
        sharding = self.named_sharding(op.sharding)
        pieces = {index_key(idx, op.shape): data for idx, data in staged}
        arrays = []
        for device, index in sharding.addressable_devices_indices_map(op.shape).items():
            key = index_key(index, op.shape)
            if key not in pieces:
                raise RuntimeError(
                    f"upload of {op.handle} is missing the piece {key} for {device}; "
                    "controller and worker disagree on the sharding"
                )
            arrays.append(jax.device_put(pieces[key], device))
        self.buffers.put(
            op.handle, jax.make_array_from_single_device_arrays(op.shape, sharding, arrays)
        )

    def _load(self, op: LoadOp) -> None:
        import jax
        from jax import export

        if op.program_id in self._programs:
            return
        exported = export.deserialize(bytearray(op.serialized))
        mesh = self.mesh(op.mesh)
        num_in, num_out = len(exported.in_avals), len(exported.out_avals)
        in_tree: Any = exported.in_tree
        out_tree: Any = exported.out_tree
        if out_tree == jax.tree.structure((0,) * num_out):
            leaves: Callable[[Any], list[Any]] = list  # a tuple of arrays
        elif num_out == 1 and out_tree == jax.tree.structure(0):
            leaves = _one
        else:
            leaves = jax.tree.leaves
        program = self._programs[op.program_id] = _Program(
            program_id=op.program_id,
            name=op.name or exported.fun_name,
            exported=exported,
            mesh=mesh,
            call=jax.jit(exported.call),
            in_shardings=tuple(exported.in_shardings_jax(mesh)),
            num_outputs=num_out,
            flat_in=in_tree == jax.tree.structure(((0,) * num_in, {})),
            leaves=leaves,
        )
        if op.ahead and all(s is not None for s in program.in_shardings):
            program.compiling_ahead = self._compiler.submit(self._compile, program)

    def _compile(self, program: _Program) -> Any:
        """The program's executable for this gang: the one this process index kept when
        an earlier gang compiled it (worker/executables.py), else compiled here from its
        artifact, and kept."""
        import jax

        where = executables.directory()
        path = None
        if where and program.program_id:
            path = executables.executable_path(
                where, program.program_id, self.gang.num_processes, self.process_id
            )
            started = time.monotonic()
            kept = executables.load(path)
            if kept is not None:
                log.info(
                    "loaded %s as an earlier gang compiled it in %.2f s",
                    program.name,
                    time.monotonic() - started,
                )
                return kept
        specs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(program.exported.in_avals, program.in_shardings, strict=True)
        ]
        tree_args, tree_kwargs = jax.tree.unflatten(program.exported.in_tree, specs)
        started = time.monotonic()
        # The mesh context gives the devices to programs that take no array arguments.
        with jax.set_mesh(program.mesh):
            compiled = program.call.trace(*tree_args, **tree_kwargs).lower().compile()
        log.info("compiled %s in %.2f s", program.name, time.monotonic() - started)
        if path is not None:
            executables.store(compiled, path, program.mesh.devices.flat[0].platform)
        return compiled

    def _execute(self, op: ExecOp) -> _Outputs:
        program = self._programs.get(op.program_id)
        if program is None:
            raise RuntimeError(f"program {op.program_id[:12]} was never loaded on this worker")
        args = self._conform(program, self.buffers.get_all(op.inputs))
        direct = program.direct
        if direct is not None:  # the usual case: `_call`, spelled out (per operation)
            outputs = [direct(*args)] if program.single else program.leaves(direct(*args))
        elif program.called:
            outputs = self._call(program, args)
        else:
            try:
                with self._setting_up(program.name):
                    self._take_compiled(program)
                    outputs = self._call(program, args)
                    # Compiling loaded XLA's compiler for good (slicewise/common/heap.py).
                    heap.settle("the first program compiled")
            finally:
                program.called = True
        if op.repeat > 1:
            outputs = self._repeat(program, op.repeat, outputs)
        if len(outputs) != len(op.outputs):
            raise RuntimeError(
                f"program returned {len(outputs)} arrays, controller expected {len(op.outputs)}"
            )
        self.buffers.put_all(op.outputs, outputs)
        report = [outputs[i] for i in op.report] if op.report and self.process_id == 0 else []
        return _Outputs(outputs, report)

    def _take_compiled(self, program: _Program) -> None:
        """The program's executable for its first call: the one compiled ahead, waited
        for; compiled here and now when the background thread has not begun it (it is
        busy with a program loaded before, perhaps one that is never called). One that
        fails to compile is left to the first call through `jax.jit`, which raises the
        error where it belongs."""
        ahead = program.compiling_ahead
        if ahead is None:
            return
        program.compiling_ahead = None
        try:
            program.compiled = self._compile(program) if ahead.cancel() else ahead.result()
        except Exception as exc:  # noqa: BLE001 - the call below reports it
            log.warning(
                "compiling %s ahead failed (%s); its first call compiles it", program.name, exc
            )
            return
        if program.flat_in:
            program.direct = program.compiled
            program.single = program.leaves is _one

    def _repeat(self, program: _Program, runs: int, first: list[Any]) -> list[Any]:
        """Runs 2..`runs` of a repeated call, each on the outputs of the one before,
        launched back to back with at most `window` of them unfinished (as a
        multi-controller loop does); returns the last run's outputs, every run before it
        finished (the executor counts the call as one program in flight from here)."""
        from collections import deque

        unfinished: deque[tuple[int, list[Any]]] = deque([(1, first)])
        outputs = first
        # Laid out as the program takes them (the usual case), they stay so from run to
        # run: checked for the second run, not for every one.
        conform = True

        def finish_oldest() -> None:
            run, arrays = unfinished.popleft()
            try:
                for a in arrays:
                    a.block_until_ready()
            except Exception as exc:
                raise RuntimeError(f"run {run} of {runs} failed: {exc}") from exc

        for run in range(2, runs + 1):
            if len(unfinished) >= self.window:
                finish_oldest()
            try:
                args = self._conform(program, outputs) if conform else outputs
                conform = args is not outputs
                outputs = self._call(program, args)
            except Exception as exc:
                raise RuntimeError(f"run {run} of {runs} failed: {exc}") from exc
            unfinished.append((run, outputs))
        while len(unfinished) > 1:
            finish_oldest()
        return outputs

    @staticmethod
    def _conform(program: _Program, arrays: list[Any]) -> list[Any]:
        """The arrays laid out as the program takes them (moved where they are not);
        `arrays` itself when all of them are already."""
        args = arrays
        for i, (arg, want) in enumerate(zip(arrays, program.in_shardings, strict=True)):
            if want is None:
                continue
            # An equal sharding (a program's outputs fed back to it, the usual case) is
            # told by `==`: `is_equivalent_to` builds both shardings' HLO form, about
            # 10 us per call, a thirtieth of a short program's launch.
            have = arg.sharding
            if have != want and not have.is_equivalent_to(want, arg.ndim):
                import jax

                if args is arrays:
                    args = list(arrays)
                args[i] = jax.device_put(arg, want)
        return args

    @staticmethod
    def _call(program: _Program, args: list[Any]) -> list[Any]:
        direct = program.direct
        if direct is not None:  # the usual case, as is (`_execute` spells this out)
            return [direct(*args)] if program.single else program.leaves(direct(*args))
        import jax

        # The artifact was traced with pytree arguments; rebuild them from the flat list.
        tree_args, tree_kwargs = jax.tree.unflatten(program.exported.in_tree, args)
        if program.compiled is not None:
            return program.leaves(program.compiled(*tree_args, **tree_kwargs))
        # The mesh context gives the devices to programs that take no array arguments.
        with jax.set_mesh(program.mesh):
            return program.leaves(program.call(*tree_args, **tree_kwargs))

    def run_loop(
        self, program_id: str, handles: list[str], n: int, window: int, pace_s: float = 0.0
    ) -> float:
        """Runs a loaded program `n` times, each call fed the previous call's outputs,
        straight from this process with its own bounded window: what a multi-controller
        JAX program does. For benchmarks only; run it on every process of the gang at
        once, and never while the gang's executor has work. Returns the seconds taken.

        With `pace_s`, call i is launched no earlier than i * pace_s after the first: the
        same loop fed at the pace a controller delivers calls, to measure what the pace
        alone costs (XLA's threads go idle and are woken between calls)."""
        from collections import deque

        program = self._programs[program_id]
        args = [self.buffers.get(h) for h in handles]
        in_flight: deque[Any] = deque()
        started = time.perf_counter()
        for i in range(n):
            if pace_s:
                time.sleep(max(0.0, started + i * pace_s - time.perf_counter()))
            args = self._call(program, args)
            in_flight.append(args[0])
            if len(in_flight) > window:
                in_flight.popleft().block_until_ready()
        for a in args:
            a.block_until_ready()
        return time.perf_counter() - started

    def run_train_loop(
        self,
        program_id: str,
        state_handles: list[str],
        program_name: str,
        overrides: tuple[tuple[str, str], ...],
        batch_sharding: ShardingSpec,
        first_step: int,
        n: int,
        window: int,
    ) -> float:
        """A multi-controller training loop on this host (benchmark baseline): builds its
        own batch rows, runs the step, reads each step's metrics as it retires. Run it on
        every process of the gang at once, with the gang's executor idle. Returns seconds."""
        from collections import deque

        program = self._programs[program_id]
        state = [self.buffers.get(h) for h in state_handles]
        in_flight: deque[Any] = deque()
        started = time.perf_counter()
        for step in range(first_step, first_step + n):
            batch = self.build_batch(program_name, overrides, step, batch_sharding)
            if len(in_flight) >= window:  # as the executor: at most `window` launched
                np.asarray(in_flight.popleft().addressable_shards[0].data)
            outputs = self._call(program, [*state, *batch])
            state = outputs[: len(state)]
            in_flight.append(outputs[len(state)])
        while in_flight:
            np.asarray(in_flight.popleft().addressable_shards[0].data)
        return time.perf_counter() - started

    # -- reads ---------------------------------------------------------------------

    def read_pinned(self, pin_id: str) -> list[tuple[Index, np.ndarray]]:
        """This host's distinct pieces of a pinned array (one copy of each replica set)."""
        array = self._pins.pop(pin_id, None)
        if array is None:
            raise KeyError(f"nothing is pinned as {pin_id} on process {self.process_id}")
        array.block_until_ready()
        return [
            (normalize_index(s.index, array.shape), np.asarray(s.data))
            for s in array.addressable_shards
            if s.replica_id == 0
        ]

    def drop_pin(self, pin_id: str) -> None:
        self._pins.pop(pin_id, None)

    def compiled_text(self, program_id: str) -> str:
        """The HLO text of a loaded program as XLA compiled it for this gang (partitioned:
        per-device shapes and every collective with its replica groups), for predicting
        what it sends between slices (controller/dcn.py): the executable compiled for it
        at load (every process compiles the same module)."""
        program = self._programs.get(program_id)
        if program is None:
            raise KeyError(f"program {program_id[:12]} was never loaded on this worker")
        compiled = program.compiled
        if compiled is None:
            ahead = program.compiling_ahead
            try:
                compiled = ahead.result() if ahead is not None else self._compile(program)
            except CancelledError:  # the first call took it over: compile one here
                compiled = self._compile(program)
        return str(compiled.as_text())

    def stats(self) -> dict[str, Any]:
        return {
            "arrays": len(self.buffers),
            "bytes": self.buffers.nbytes(),
            "programs": len(self._programs),
            "pins": len(self._pins),
            "staged": len(self._staged),
            "checkpoint_dirs": len(self._checkpointers),
        }


def _load_data(key: tuple[str, tuple[tuple[str, str], ...]], result: Future[Any]) -> None:
    """A program's config, with its data read (the digest reads it): into `result`."""
    from programs.base import get_program

    try:
        program_name, overrides = key
        program = get_program(program_name)
        config = program.make_config(dict(overrides))
        program.data_fingerprint(config)
        result.set_result(config)
    except BaseException as exc:  # noqa: BLE001 - the first batch raises it
        result.set_exception(exc)
