"""Traffic between slices (over the data-centre network, DCN) per program run, two ways:
predicted from a compiled program's collectives, and measured on the local simulation from
the kernel's TCP counters between worker processes.

Prediction. `collectives(hlo_text)` reads every collective of a compiled, SPMD-partitioned
HLO module (`jax.jit(f).lower(*args).compile().as_text()`): its kind, its bytes per device
and its replica groups. `predict(collectives, slice_of)` counts the bytes and the
device-to-device messages whose sender and receiver are on different slices, per run of the
program, under these models (n: the size of a replica group):

- all-to-all: each device cuts its operand into n equal pieces and sends piece j to the
  j-th member: operand_bytes / n to each other member, one message each. This is also
  what XLA:CPU's gloo communicator does (direct sends), and what `programs.moe.sharded`'s
  `predict_dcn_traffic` assumes; the two agree exactly on the MoE layer.
- collective-permute: each (source, target) pair sends operand_bytes in one message.
- all-gather, reduce-scatter, all-reduce: a ring over the group in its listed order, each
  device sending only to its successor (the member listed after it, the last one to the
  first). All-gather: n - 1 steps, each forwarding one device's piece (operand_bytes).
  Reduce-scatter: n - 1 steps of one reduced piece (result_bytes). All-reduce: a
  reduce-scatter then an all-gather of pieces of operand_bytes / n, 2 (n - 1) steps; its
  bytes per link, 2 (n - 1) operand_bytes / n, are rounded down. A step's message crosses
  DCN when the successor is on another slice, so the count is (crossing links) x (steps).
  The ring is chosen over a direct exchange because it is what all-reduce is built from
  (a ring all-reduce is a ring reduce-scatter plus a ring all-gather: one model for all
  three) and because it is the bandwidth-optimal schedule that collective libraries use.

These are models, payload only. The real algorithms may differ: XLA:CPU's gloo
reduce-scatter halves and doubles rather than rings, its rings follow communicator ranks
rather than the listed order, transports add their own headers, and libtpu/megascale route
DCN traffic their own way. That is why there is a measurement too. Sizes are those of the
compiled program, so compile for the platform in question: XLA:CPU widens bfloat16
collectives to float32, and predicts twice the bytes a TPU build of the program would send.

Replica group ids. In the SPMD-partitioned HLO that `jit` compiles (`use_global_device_ids
=true`, and in `source_target_pairs`) an id is a position in the executable's device
assignment, which is the mesh's flattened device array `mesh.devices.flat`; it is not a
`jax.Device.id`. Compiling the same program on `Mesh(devices[perm].reshape(2, 4), ...)` for
any permutation `perm` prints the same replica groups: a psum over the minor axis is
`{{0,1,2,3},{4,5,6,7}}` (mesh rows by position) whatever device ids those rows hold.
`slices_of_mesh(spec)` gives `slice_of` in exactly that indexing.

Three spellings of replica groups are read: explicit lists `{{0,1},{2,3}}` (`{}`: one
group of every device), iota lists `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)`, and the mesh-axes
form XLA:CPU prints for auto-sharded programs, `mesh['axis_0'=2,'axis_1'=4] {'axis_0'}`
(groups over the named axes of a device mesh; sub-axes `'a':(1)2`, and meshes over
devices in another order, `device_ids=([4,2]T(1,0))` or `device_ids=(0,2,4,6,...)`).

Limitations: an op inside a while loop runs once per iteration but is counted once (its
`in_loop` is set; the trip count is not in the text). Async collectives are counted at
their `-start` (the `-done` carries no data) or, when wrapped in `async-start`, inside the
wrapped computation. ragged-all-to-all and collective-broadcast are not modelled and raise;
send/recv pairs (pipelined point-to-point transfers, which XLA:CPU does not emit) are not
counted.

Measurement. On the simulation every host is a process on 127.0.0.1, and gloo carries the
collectives between processes over TCP. `read_sockets()` lists the TCP sockets with their owner pid and
counters (`ss -tinpH`); `cross_slice_bytes(sockets, slice_of_pid)` sums what worker
processes of one slice sent to those of another, each direction counted once, by its
sender's bytes_acked and data_segs_out. `DcnMeter` turns successive reads into a cumulative
count that survives connections closing. The bytes are TCP payload: gloo's own headers
included, so they exceed the prediction; bytes_acked also counts one for each SYN and FIN.
On real TPU slices DCN traffic does not go through host TCP sockets this way.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from slicewise.common.mesh import MeshSpec

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Collectives whose traffic depends on runtime values or that no model here covers: refuse
# them rather than undercount a program that uses them.
_UNMODELLED = ("ragged-all-to-all", "collective-broadcast")


class HloParseError(ValueError):
    """The HLO text has a collective this module cannot read or does not model."""


class SsUnavailableError(RuntimeError):
    """`ss` (iproute2) is missing, failed, or did not answer in time."""


@dataclass(frozen=True)
class Collective:
    """One collective op of a compiled HLO module, with per-device sizes.

    Attributes:
        kind: one of `KINDS` (an async `-start` op is recorded under its synchronous kind).
        operand_bytes: bytes each device puts in (all operands of a combined op summed).
        result_bytes: bytes each device gets out.
        groups: the replica groups, as positions in the executable's device assignment;
            for "collective-permute", the (source, target) pairs.
        in_loop: the op is inside a while loop's body or condition, so it runs once per
            iteration although it is listed (and predicted) once.
        name: the HLO instruction name, for messages.
    """

    kind: str
    operand_bytes: int
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]
    in_loop: bool = False
    name: str = ""


@dataclass(frozen=True)
class DcnTraffic:
    """What one run of a program sends between slices, predicted by `predict`.

    Attributes:
        bytes: payload bytes whose sender and receiver are on different slices.
        messages: device-to-device messages between slices (one per sender, receiver and
            algorithm step).
        by_kind: (kind, bytes, messages) for every kind of collective the program has, in
            `KINDS` order, zeros included.
    """

    bytes: int
    messages: int
    by_kind: tuple[tuple[str, int, int], ...] = ()


# -- reading HLO text ------------------------------------------------------------------------

_COMMENT = re.compile(r"/\*.*?\*/")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>\S.*)$")
_OPCODE = re.compile(r"(?P<op>[a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_REFERENCE = re.compile(r"%(?P<name>[\w.\-]+)")
_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}


@dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: str
    attrs: str


def _closing(text: str, start: int) -> int:
    """The index of the bracket that closes the one at `text[start]`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, opening = 0, text[start]
    for i in range(start, len(text)):
        if text[i] == opening:
            depth += 1
        elif text[i] == pairs[opening]:
            depth -= 1
            if depth == 0:
                return i
    raise HloParseError(f"unbalanced {opening!r} in: {text[:200]}")


def _split(name: str, rest: str) -> _Instruction | None:
    """`shape opcode(operands), attrs` of one instruction line, or None if it is not one."""
    if rest.startswith("("):
        end = _closing(rest, 0) + 1
        shape, tail = rest[:end], rest[end:].lstrip()
    else:
        shape, _, tail = rest.partition(" ")
    match = _OPCODE.match(tail)
    if match is None:
        return None
    close = _closing(tail, match.end() - 1)
    return _Instruction(name, shape, match["op"], tail[match.end() : close], tail[close + 1 :])


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    # The many small float formats: f8e4m3fn, f8e5m2, f4e2m1fn, ...
    if dtype[:1] == "f" and dtype[1:2].isdigit():
        return int(dtype[1])
    raise HloParseError(f"unknown element type {dtype!r}")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as `f32[4,2]{1,0}` or `(f32[8,16], bf16[4])`, tuples
    summed; a dynamic dimension `<=8` counts at its bound."""
    total = 0
    for match in _ARRAY.finditer(shape):
        dims = [d.strip().removeprefix("<=") for d in match["dims"].split(",") if d.strip()]
        elements = math.prod(int(d) for d in dims)
        total += (elements * _bits(match["dtype"]) + 7) // 8
    return total


def _parse_module(text: str) -> tuple[dict[str, list[_Instruction]], int]:
    """The instructions of every computation, and the module's device count."""
    computations: dict[str, list[_Instruction]] = {}
    devices = 1
    current: list[_Instruction] | None = None
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw).rstrip()
        if line.startswith("HloModule"):
            for key in ("num_partitions", "replica_count"):
                found = re.search(rf"\b{key}=(\d+)", line)
                devices *= int(found[1]) if found else 1
        elif current is None:
            header = _COMPUTATION.match(line)
            if header:
                current = computations.setdefault(header["name"], [])
        elif line == "}":
            current = None
        else:
            match = _INSTRUCTION.match(line)
            instruction = match and _split(match["name"], match["rest"])
            if instruction:
                current.append(instruction)
    return computations, devices


def _loop_computations(computations: Mapping[str, list[_Instruction]]) -> set[str]:
    """The computations that run inside a while loop: the loops' bodies and conditions
    and everything they call, transitively."""

    def callees(ins: _Instruction) -> list[str]:
        return [r["name"] for r in _REFERENCE.finditer(ins.attrs) if r["name"] in computations]

    pending = [
        name
        for body in computations.values()
        for ins in body
        if ins.opcode == "while"
        for name in callees(ins)
    ]
    inside: set[str] = set()
    while pending:
        name = pending.pop()
        if name not in inside:
            inside.add(name)
            pending.extend(callee for ins in computations[name] for callee in callees(ins))
    return inside


_EXPLICIT = re.compile(r"replica_groups=\{(?P<body>(?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
_IOTA_GROUPS = re.compile(r"replica_groups=" + _IOTA)
_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]")
_MESH_AXIS = re.compile(r"^'?(?P<name>[^'=]+)'?=(?P<size>\d+)$")
_AXIS_REF = re.compile(r"^'?(?P<name>[^':]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?$")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<body>(?:\{\d+,\d+\},?\s*)*)\}")


def _ints(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def _iota(shape: str, dims: str, perm: str | None) -> np.ndarray:
    """`[shape]<=[dims]T(perm)`: iota over dims, transposed by perm, reshaped to shape."""
    ids = np.arange(math.prod(_ints(dims))).reshape(_ints(dims))
    if perm:
        ids = ids.transpose(_ints(perm))
    return ids.reshape(_ints(shape))


def _as_groups(ids: np.ndarray | list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in group) for group in ids)


def _replica_groups(ins: _Instruction, devices: int) -> tuple[tuple[int, ...], ...]:
    """The replica groups of a collective, whatever their spelling; no attribute, or
    `{}`, is one group of all `devices`."""
    explicit = _EXPLICIT.search(ins.attrs)
    if explicit:
        groups = re.findall(r"\{([\d,\s]*)\}", explicit["body"])
        return _as_groups([_ints(g) for g in groups]) or (tuple(range(devices)),)
    iota = _IOTA_GROUPS.search(ins.attrs)
    if iota:
        return _as_groups(_iota(iota["shape"], iota["dims"], iota["perm"]))
    mesh = _MESH.search(ins.attrs)
    if mesh:
        return _mesh_groups(ins, mesh)
    if "replica_groups=" in ins.attrs:
        raise HloParseError(f"{ins.name}: cannot read the replica groups in {ins.attrs[:300]}")
    return (tuple(range(devices)),)


def _mesh_groups(ins: _Instruction, mesh: re.Match[str]) -> tuple[tuple[int, ...], ...]:
    """Groups of the mesh-axes form `mesh[a=2,b=4](, device_ids=(...))? {axis refs}`: the
    devices that share every coordinate but those of the referenced (sub-)axes, as XLA's
    `MeshAxesReplicaGroupList::flattened_replica_groups` computes them."""
    names: list[str] = []
    sizes: list[int] = []
    for entry in mesh["axes"].split(","):
        axis = _MESH_AXIS.match(entry.strip())
        if axis is None:
            raise HloParseError(f"{ins.name}: cannot read mesh axis {entry!r}")
        names.append(axis["name"])
        sizes.append(int(axis["size"]))
    rest = ins.attrs[mesh.end() :]
    ids = np.arange(math.prod(sizes))
    if rest.startswith(", device_ids=("):
        close = _closing(rest, rest.index("("))
        ids = _device_ids(ins, rest[rest.index("(") + 1 : close], ids.size)
        rest = rest[close + 1 :]
    rest = rest.lstrip()
    if not rest.startswith("{"):
        raise HloParseError(f"{ins.name}: no axes after the mesh in {ins.attrs[:300]}")
    refs: dict[int, list[tuple[int, int]]] = {}  # mesh dim -> (pre_size, size) in listed order
    for entry in rest[1 : _closing(rest, 0)].split(","):
        ref = _AXIS_REF.match(entry.strip())
        if ref is None or ref["name"] not in names:
            raise HloParseError(f"{ins.name}: cannot read mesh axis reference {entry!r}")
        dim = names.index(ref["name"])
        whole = (1, sizes[dim])
        refs.setdefault(dim, []).append(
            (int(ref["pre"]), int(ref["size"])) if ref["pre"] else whole
        )
    # Split each referenced mesh dim into its sub-axes (with filler dims between them),
    # then move the referenced ones last: each run of them along the end is one group.
    reshape: list[int] = []
    grouped: list[int] = []
    for dim, size in enumerate(sizes):
        subs = refs.get(dim, [])
        order = sorted(range(len(subs)), key=lambda i: subs[i][0])
        where = [0] * len(subs)
        prefix = 1
        for i in order:
            pre, sub = subs[i]
            if pre != prefix:
                reshape.append(pre // prefix)
                prefix = pre
            where[i] = len(reshape)
            reshape.append(sub)
            prefix *= sub
        if prefix != size:
            reshape.append(size // prefix)
        grouped += where
    rest_dims = [d for d in range(len(reshape)) if d not in grouped]
    group_size = math.prod(reshape[d] for d in grouped)
    arranged = ids.reshape(reshape).transpose(rest_dims + grouped)
    return _as_groups(arranged.reshape(-1, group_size))


def _device_ids(ins: _Instruction, text: str, count: int) -> np.ndarray:
    """A mesh's `device_ids=(...)`, the ids in mesh order: an iota `[4,2]T(1,0)` (iota
    over those dims, transposed) or the ids themselves `0,2,4,6,1,3,5,7`."""
    iota = re.fullmatch(r"\[(?P<dims>[\d,]+)\]T\((?P<perm>[\d,]+)\)", text.strip())
    if iota and math.prod(_ints(iota["dims"])) == count:
        ids = np.arange(count).reshape(_ints(iota["dims"])).transpose(_ints(iota["perm"]))
    elif re.fullmatch(r"[\d,\s]+", text):
        ids = np.array(_ints(text))
    else:
        ids = np.array([])
    if ids.size != count:
        raise HloParseError(f"{ins.name}: cannot read the mesh's device_ids=({text[:200]})")
    return ids.reshape(-1)


def _pairs(ins: _Instruction) -> tuple[tuple[int, ...], ...]:
    found = _PAIRS.search(ins.attrs)
    if found is None:
        raise HloParseError(f"{ins.name}: no source_target_pairs in {ins.attrs[:300]}")
    return _as_groups([_ints(p) for p in re.findall(r"\{(\d+,\d+)\}", found["body"])])


def _kind(ins: _Instruction) -> tuple[str | None, bool]:
    """(kind, is an async start) of an instruction; kind None if it is no collective."""
    base = ins.opcode.removesuffix("-start")
    if base in _UNMODELLED:
        raise HloParseError(f"{ins.name}: {ins.opcode} is not modelled")
    if base in KINDS:
        return base, base != ins.opcode
    return None, False


def _operand_bytes(ins: _Instruction, shapes: Mapping[str, str]) -> int:
    if "[" in ins.operands:  # the printer wrote each operand's shape before its name
        return shape_bytes(ins.operands)
    total = 0
    for operand in ins.operands.split(","):
        name = operand.strip().removeprefix("%")
        if name not in shapes:
            raise HloParseError(f"{ins.name}: operand {name!r} is not defined before it")
        total += shape_bytes(shapes[name])
    return total


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op of a compiled HLO module, in text order, those in called
    computations (while bodies, async wrappers) included.

    Sizes are per device. An async `-start` op's result is a tuple of buffers, so its
    result_bytes is derived from its operands (x n for all-gather, / n for reduce-scatter).

    Raises:
        HloParseError: a collective's shapes or groups cannot be read, or it is one that is
            not modelled (ragged-all-to-all, collective-broadcast).
    """
    computations, devices = _parse_module(hlo_text)
    loops = _loop_computations(computations)
    found = []
    for computation, body in computations.items():
        shapes = {ins.name: ins.shape for ins in body}
        for ins in body:
            kind, is_start = _kind(ins)
            if kind is None:
                continue
            groups = _pairs(ins) if kind == "collective-permute" else _replica_groups(ins, devices)
            operand = _operand_bytes(ins, shapes)
            if not is_start:
                result = shape_bytes(ins.shape)
            elif kind == "all-gather":
                result = operand * len(groups[0])
            elif kind == "reduce-scatter":
                result = operand // len(groups[0])
            else:
                result = operand
            found.append(Collective(kind, operand, result, groups, computation in loops, ins.name))
    return found


# -- predicting DCN traffic -----------------------------------------------------------------


def _crossing(c: Collective, slice_of: Sequence[int]) -> tuple[int, int]:
    """(bytes, messages) of one collective between slices, under the module's models."""

    def slice_(device: int) -> int:
        if not 0 <= device < len(slice_of):
            raise ValueError(
                f"{c.name or c.kind} names device {device}, but slice_of covers "
                f"{len(slice_of)} devices"
            )
        return slice_of[device]

    if c.kind == "collective-permute":
        remote = sum(1 for src, dst in c.groups if slice_(src) != slice_(dst))
        return remote * c.operand_bytes, remote
    total = messages = 0
    for group in c.groups:
        n = len(group)
        if c.kind == "all-to-all":
            remote = sum(1 for src in group for dst in group if slice_(src) != slice_(dst))
            total += remote * (c.operand_bytes // n)
            messages += remote
            continue
        links = sum(1 for i, d in enumerate(group) if slice_(d) != slice_(group[(i + 1) % n]))
        if c.kind == "all-gather":
            steps, per_link = n - 1, (n - 1) * c.operand_bytes
        elif c.kind == "reduce-scatter":
            steps, per_link = n - 1, (n - 1) * c.result_bytes
        else:  # all-reduce: ring reduce-scatter, then ring all-gather
            steps, per_link = 2 * (n - 1), 2 * (n - 1) * c.operand_bytes // n
        total += links * per_link
        messages += links * steps
    return total, messages


def predict(collectives: Iterable[Collective], slice_of: Sequence[int]) -> DcnTraffic:
    """Bytes and device-to-device messages sent between slices by one run of a program.

    Args:
        collectives: the program's collectives (`collectives(hlo_text)`), or a selection.
        slice_of: the slice of every device, indexed by position in the executable's
            device assignment, that is the position in `mesh.devices.flat` of the mesh the
            program was compiled for (not by `jax.Device.id`); `slices_of_mesh` builds it.

    Raises:
        ValueError: a collective names a device beyond `slice_of`.
    """
    totals: dict[str, tuple[int, int]] = {}
    for c in collectives:
        sent, messages = _crossing(c, slice_of)
        before = totals.get(c.kind, (0, 0))
        totals[c.kind] = (before[0] + sent, before[1] + messages)
    by_kind = tuple((kind, *totals[kind]) for kind in KINDS if kind in totals)
    return DcnTraffic(
        bytes=sum(t[1] for t in by_kind), messages=sum(t[2] for t in by_kind), by_kind=by_kind
    )


def slices_of_mesh(mesh_spec: MeshSpec) -> list[int]:
    """The slice of each position of the mesh's flattened device array: the DCN part of
    its coordinates (coordinate // ici along every axis), flattened row-major. This is the
    `slice_of` for programs compiled on that mesh laid out by `MeshSpec.device_grid`."""
    dcn_shape = [axis.dcn for axis in mesh_spec.axes]
    return [
        int(
            np.ravel_multi_index(
                [c // axis.ici for c, axis in zip(coords, mesh_spec.axes, strict=True)],
                dcn_shape,
            )
        )
        for coords in np.ndindex(*mesh_spec.shape)
    ]


# -- measuring on the simulation ------------------------------------------------------------


@dataclass(frozen=True)
class Socket:
    """One TCP socket as `ss -tinpH` lists it.

    Attributes:
        local, peer: "host:port", IPv6 hosts in brackets ("[::1]:5000"); an IPv4-mapped
            IPv6 address is written as the IPv4 one so that both ends of a loopback
            connection name each other the same way.
        pids: the processes holding it (several after a fork), empty when ss shows no
            owner (another user's socket, or one not yet accepted).
        bytes_acked: bytes sent and acknowledged by the peer (one more for a SYN, and for
            a FIN, once acknowledged).
        bytes_received: bytes received.
        data_segs_out: segments sent that carried data.
    """

    local: str
    peer: str
    pids: tuple[int, ...] = ()
    bytes_acked: int = 0
    bytes_received: int = 0
    data_segs_out: int = 0

    @property
    def pid(self) -> int | None:
        """The first process holding the socket, or None."""
        return self.pids[0] if self.pids else None


_PID = re.compile(r"\bpid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_acked|bytes_received|data_segs_out):(\d+)")
_MAPPED = re.compile(r"^\[::ffff:(\d+\.\d+\.\d+\.\d+)\]")
_SCOPE = re.compile(r"%[^:\]\s]+(?=:[^:]*$)")


def _address(text: str) -> str:
    return _MAPPED.sub(r"\1", _SCOPE.sub("", text))


def parse_ss(text: str) -> list[Socket]:
    """The sockets of `ss -tinpH` output: for each, an address line
    (`State Recv-Q Send-Q Local Peer [users:((...))]`, State absent when ss was given a
    state filter) and, indented below it, a line of counters; absent counters are 0.

    Raises:
        ValueError: an address line has too few fields.
    """
    sockets: list[Socket] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            if sockets:
                counters = {k: int(v) for k, v in _COUNTER.findall(line)}
                sockets[-1] = replace(
                    sockets[-1],
                    bytes_acked=counters.get("bytes_acked", 0),
                    bytes_received=counters.get("bytes_received", 0),
                    data_segs_out=counters.get("data_segs_out", 0),
                )
            continue
        fields = line.split()
        # With a state filter (`ss ... state established`) ss leaves the State column out.
        first = 0 if fields[0].isdigit() else 1
        if len(fields) < first + 4:
            raise ValueError(f"not an ss socket line: {line!r}")
        local, peer = fields[first + 2], fields[first + 3]
        pids = tuple(int(p) for p in _PID.findall(" ".join(fields[first + 4 :])))
        sockets.append(Socket(_address(local), _address(peer), pids))
    return sockets


def read_sockets(timeout_s: float = 5.0) -> list[Socket]:
    """The machine's TCP sockets now, from `ss -tinpH`.

    Raises:
        SsUnavailableError: ss is not installed, fails, or takes longer than `timeout_s`.
    """
    ss = shutil.which("ss")
    if ss is None:
        raise SsUnavailableError("`ss` is not on PATH: install iproute2 to measure DCN bytes")
    try:
        done = subprocess.run(
            [ss, "-tinpH"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise SsUnavailableError(f"`ss -tinpH` did not answer within {timeout_s:g} s") from e
    if done.returncode != 0:
        raise SsUnavailableError(
            f"`ss -tinpH` exited with {done.returncode}: {done.stderr.strip()[:500]}"
        )
    return parse_ss(done.stdout)


def _worker(socket: Socket, slice_of_pid: Mapping[int, int]) -> int | None:
    return next((pid for pid in socket.pids if pid in slice_of_pid), None)


def cross_slice_sockets(sockets: Iterable[Socket], slice_of_pid: Mapping[int, int]) -> list[Socket]:
    """The sockets through which a worker sends to a worker of another slice: both ends
    listed (the other end is the socket whose local and peer are this one's peer and
    local), both held by processes in `slice_of_pid`, on different slices."""
    sockets = list(sockets)
    by_ends = {(s.local, s.peer): s for s in sockets}
    found = []
    for s in sockets:
        here = _worker(s, slice_of_pid)
        other = by_ends.get((s.peer, s.local))
        there = None if other is None else _worker(other, slice_of_pid)
        if here is not None and there is not None and slice_of_pid[here] != slice_of_pid[there]:
            found.append(s)
    return found


def cross_slice_bytes(
    sockets: Iterable[Socket], slice_of_pid: Mapping[int, int]
) -> tuple[int, int]:
    """(bytes, data segments) that worker processes sent to workers of other slices over
    the connections open now, over their lifetimes: each direction of a connection counted
    once, by its sender's bytes_acked and data_segs_out.

    Args:
        sockets: from `read_sockets()` or `parse_ss`.
        slice_of_pid: the slice of each worker process; other processes are ignored.
    """
    found = cross_slice_sockets(sockets, slice_of_pid)
    return sum(s.bytes_acked for s in found), sum(s.data_segs_out for s in found)


class DcnMeter:
    """A running total of the bytes and data segments workers sent across slices, for a
    caller that reads before and after N steps and takes the difference.

    `cross_slice_bytes` alone would drop when a connection closes; the meter instead keeps
    each connection's counters (keyed by (local, peer)) from its previous read and adds
    what grew since. So: a connection first seen counts from its start (its bytes before
    the meter's first read included: diff two reads); what a connection sent after the
    last read before it closed is lost (read before tearing workers down); a new connection
    on the same two addresses, whose counters restart lower, counts from zero.
    """

    def __init__(
        self,
        slice_of_pid: Mapping[int, int],
        sockets: Callable[[], list[Socket]] = read_sockets,
    ) -> None:
        """`sockets` lists the sockets now; tests pass a fake."""
        self._slice_of_pid = dict(slice_of_pid)
        self._sockets = sockets
        self._last: dict[tuple[str, str], tuple[int, int]] = {}
        self._bytes = 0
        self._segments = 0

    def read(self) -> tuple[int, int]:
        """Cumulative (bytes, data segments) sent across slices as of now."""
        now = {
            (s.local, s.peer): (s.bytes_acked, s.data_segs_out)
            for s in cross_slice_sockets(self._sockets(), self._slice_of_pid)
        }
        for key, (sent, segments) in now.items():
            before_sent, before_segments = self._last.get(key, (0, 0))
            if sent < before_sent or segments < before_segments:
                before_sent = before_segments = 0
            self._bytes += sent - before_sent
            self._segments += segments - before_segments
        self._last = now
        return self._bytes, self._segments
