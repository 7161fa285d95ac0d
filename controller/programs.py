"""Registered programs: serialized `jax.export` artifacts, content-addressed and checked
against the gang they will run on before any worker sees them."""

from __future__ import annotations

import hashlib
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from controller.auth import current_identity, may_see
from controller.stablehlo import check_module
from slicewise.common.arrays import ArraySpec
from slicewise.common.errors import InvalidRequestError, NotFoundError, ProgramMismatchError
from slicewise.common.limits import MAX_PROGRAM_BYTES
from slicewise.common.mesh import GangShape, MeshSpec


@dataclass(frozen=True)
class Program:
    """A deserialized, validated program."""

    program_id: str
    name: str
    serialized: bytes = field(repr=False)
    mesh: MeshSpec
    inputs: tuple[ArraySpec, ...]
    outputs: tuple[ArraySpec, ...]
    num_devices: int
    platforms: tuple[str, ...]
    # A lower bound of the program's peak memory on each device (controller/stablehlo.py).
    device_bytes: int = 0

    def check_fits(self, gang: GangShape, platform: str, gang_id: str) -> None:
        """Raises ProgramMismatchError unless this program can run on the gang."""
        if self.num_devices != gang.num_devices:
            raise ProgramMismatchError(
                f"program {self.name!r} was exported for {self.num_devices} devices, but gang "
                f"{gang_id} has {gang.num_devices} ({gang.num_slices} slice(s) x "
                f"{gang.chips_per_slice} chips); export it against the gang's mesh "
                "(gang.mesh(...).abstract) so the device counts agree"
            )
        if platform not in self.platforms:
            raise ProgramMismatchError(
                f"program {self.name!r} was exported for platforms {list(self.platforms)}, but "
                f"gang {gang_id} runs on {platform!r}; pass platforms=[{platform!r}] to jax.export"
            )
        self.mesh.check_fits(gang)

    def check_inputs(self, given: Sequence[ArraySpec], handles: Sequence[str]) -> None:
        """Raises ProgramMismatchError unless the inputs match the exported signature."""
        if len(given) != len(self.inputs):
            raise ProgramMismatchError(
                f"program {self.name!r} takes {len(self.inputs)} input(s) "
                f"({', '.join(map(str, self.inputs))}) but was called with {len(given)}"
            )
        for i, (want, got, handle) in enumerate(zip(self.inputs, given, handles, strict=True)):
            if want != got:
                raise ProgramMismatchError(
                    f"input {i} of program {self.name!r}: expected {want}, got {got} "
                    f"(array {handle})"
                )


class ProgramUpload:
    """The bytes of one RegisterProgram stream, held to the size its header declared as
    they arrive (a stream that goes on past it is refused at once, not buffered)."""

    def __init__(self, name: str, total_bytes: int) -> None:
        """Raises InvalidRequestError unless `total_bytes` is a size a program can have."""
        if not 0 < total_bytes <= MAX_PROGRAM_BYTES:
            raise InvalidRequestError(
                f"program {name!r} declares total_bytes={total_bytes}; a serialized "
                f"jax.export artifact has between 1 and {MAX_PROGRAM_BYTES} bytes (2 GiB, "
                "the most flatbuffers can hold): set total_bytes to the length of "
                "exported.serialize()"
            )
        self.name = name
        self.total_bytes = total_bytes
        self.received = 0
        self._parts: list[bytes] = []

    def add(self, data: bytes) -> None:
        """Raises InvalidRequestError if `data` takes the stream past `total_bytes`."""
        if self.received + len(data) > self.total_bytes:
            raise InvalidRequestError(
                f"program {self.name!r} sent more than the {self.total_bytes} bytes its "
                f"header declared (total_bytes; {self.received + len(data)} so far); send "
                "exactly total_bytes bytes after the header"
            )
        self._parts.append(data)
        self.received += len(data)

    def serialized(self) -> bytes:
        """All the bytes, once the stream ended.

        Raises:
            InvalidRequestError: fewer bytes came than the header declared.
        """
        if self.received != self.total_bytes:
            raise InvalidRequestError(
                f"program {self.name!r} sent {self.received} bytes, but its header declared "
                f"total_bytes={self.total_bytes}; send exactly total_bytes bytes after the "
                "header"
            )
        return b"".join(self._parts)


def program_id_of(serialized: bytes, mesh: MeshSpec) -> str:
    digest = hashlib.sha256(serialized)
    digest.update(repr(mesh).encode())
    return digest.hexdigest()


# MLIR's bytecode reader is native code, and malformed bytes can corrupt the memory of
# the process that reads them: the fuzz test's mutated programs once aborted the
# controller ("corrupted double-linked list", SIGABRT) while their modules were read. The
# module of every registered program is therefore read in a process of its own, which a
# bad program can take down alone: the program is refused and the next one gets a new
# reader. (The artifact's own header is read here: Python code and protobuf.)
READER_TIMEOUT_S = 300.0
_reader: ProcessPoolExecutor | None = None
_reader_lock = threading.Lock()


def _module_text(serialized: bytes) -> str:
    from jax import export

    return str(export.deserialize(bytearray(serialized)).mlir_module())


def _warm() -> None:
    from jax import export  # noqa: F401


def warm_reader() -> None:
    """Starts the reader process now, in the background, so that a controller's first
    program (a resumed job's, after a restart) does not wait for it to start and import
    jax (about 2 s here)."""
    _pool().submit(_warm)


def _pool() -> ProcessPoolExecutor:
    global _reader
    with _reader_lock:
        if _reader is None:
            _reader = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return _reader


def read_module(serialized: bytes) -> str:
    """The StableHLO text of a jax.export artifact, read in the reader process.

    Raises:
        RuntimeError: the reader died on it (the bytes crash MLIR's reader).
        Exception: whatever reading it raised there.
    """
    return str(in_reader(_module_text, bytes(serialized)))


def in_reader(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in the reader process (started on first use)."""
    global _reader
    reader = _pool()
    try:
        return reader.submit(fn, *args).result(timeout=READER_TIMEOUT_S)
    except BrokenProcessPool:
        with _reader_lock:
            if _reader is reader:
                _reader = None
        reader.shutdown(wait=False, cancel_futures=True)
        raise RuntimeError("reading its module crashed the reader process") from None


def stop_reader() -> None:
    """Stops the reader process, if one runs (the controller's shutdown)."""
    global _reader
    with _reader_lock:
        reader, _reader = _reader, None
    if reader is not None:
        reader.shutdown(wait=True, cancel_futures=True)


def load_program(serialized: bytes, name: str, mesh: MeshSpec) -> Program:
    """Deserializes and describes a program.

    Raises:
        InvalidRequestError: the bytes are not a jax.export artifact, it uses symbolic
            shapes, or its module fails the checks of controller/stablehlo.py.
        CapacityError: it cannot fit in the HBM of the chips it was exported for.
    """
    from jax import export

    try:
        exported = export.deserialize(bytearray(serialized))
    except Exception as exc:  # noqa: BLE001 - any failure here means bad bytes
        raise InvalidRequestError(
            f"program {name!r} could not be deserialized as a jax.export artifact "
            f"({type(exc).__name__}: {str(exc)[:200]}); send the bytes of "
            "jax.export.export(...)(...).serialize()"
        ) from None
    try:
        text = read_module(serialized)
    except Exception as exc:  # noqa: BLE001 - the module inside is not StableHLO
        raise InvalidRequestError(
            f"program {name!r} holds no readable StableHLO module ({type(exc).__name__}: "
            f"{str(exc)[:200]}); send the bytes of jax.export.export(...)(...).serialize()"
        ) from None
    facts = check_module(text, exported.nr_devices, name or exported.fun_name)

    def specs(avals: Sequence[object], what: str) -> tuple[ArraySpec, ...]:
        out = []
        for aval in avals:
            shape = getattr(aval, "shape", ())
            if not all(isinstance(d, int) for d in shape):
                raise InvalidRequestError(
                    f"program {name!r} has symbolic {what} shape {shape}; export it with "
                    "concrete shapes"
                )
            out.append(ArraySpec.of(shape, aval.dtype))  # type: ignore[attr-defined]
        return tuple(out)

    return Program(
        program_id=program_id_of(serialized, mesh),
        name=name or exported.fun_name,
        serialized=serialized,
        mesh=mesh,
        inputs=specs(exported.in_avals, "input"),
        outputs=specs(exported.out_avals, "output"),
        num_devices=exported.nr_devices,
        platforms=tuple(exported.platforms),
        device_bytes=facts.device_bytes,
    )


class ProgramRegistry:
    """program id -> Program; registering the same bytes twice is free."""

    def __init__(self) -> None:
        self._programs: dict[str, Program] = {}
        # The tenants that registered each program: a program is theirs (and admins'),
        # and another tenant's id answers as an unknown one does (controller/auth.py).
        self._tenants: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._programs)

    def add(self, program: Program) -> Program:
        self._tenants.setdefault(program.program_id, set()).add(current_identity().tenant)
        return self._programs.setdefault(program.program_id, program)

    def get(self, program_id: str) -> Program:
        try:
            if not any(may_see(t) for t in self._tenants.get(program_id, ())):
                raise KeyError(program_id)
            return self._programs[program_id]
        except KeyError:
            raise NotFoundError(
                f"program {program_id!r} is not registered with this controller; "
                "register it first (gang.compile or gang.load)"
            ) from None
