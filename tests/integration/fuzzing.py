"""Tools for fuzzing a gRPC API: hypothesis strategies for protobuf messages built field
by field from their descriptors, real messages with a field or two changed, request
streams, unknown fields and mutated bytes; and a watchdog that notices when the server
freezes. The campaign that uses them is tests/integration/test_fuzz.py."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

# Singular string and bytes fields are one of these now and then (never the elements of
# a repeated field): up to past gRPC's 4 MiB limit on a message.
HUGE_TEXT = ["x" * 100_000, "\u00e9" * 1_000_000, "\U0001f4a5" * 200_000, "y" * 5_000_000]
HUGE_BYTES = [b"\x00" * 100_000, b"\xff" * 3_000_000]

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
ODD_FLOATS = [0.0, -0.0, -1.0, 1e-9, 1e-300, 5e-324, 1e300, 1.8e308, math.nan, math.inf, -math.inf]
# Seconds as a client might send them: common ones, odd ones, any double.
seconds = st.one_of(
    st.sampled_from([0.0, 0.001, 1.0, 5.0]), st.sampled_from(ODD_FLOATS), st.floats()
)

garbage_text = st.one_of(
    st.text(max_size=24),
    st.text(st.characters(codec="ascii"), max_size=12),
    st.sampled_from(["", " ", "\x00", "@", "@0:0", "g1", "j1", "..", "../../etc/passwd", "%s%n"]),
)


def rarely(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> Any:
    """`common`, and one time in about 25 `rare`."""
    return st.integers(0, 24).flatmap(lambda i: rare if i == 24 else common)


def near(real: Callable[[], list[str]], *, exact: bool = True) -> st.SearchStrategy[str]:
    """Real ids (read when drawn, so that ids made during the campaign take part) and
    near misses of them: cut short, extended, cased, with an attachment; with `exact`
    False, never one that names a real id (an empty attachment names its gang)."""

    def pick(i: int) -> str:
        ids = real()
        return ids[i % len(ids)] if ids else ""

    def miss(text: str) -> str:
        base, _, attachment = text.partition("@")
        return text + "~" if base in real() and not attachment else text

    base = st.integers(0, 1000).map(pick)
    misses = st.one_of(
        st.tuples(base, st.text(max_size=8)).map("".join),
        st.tuples(base, st.integers(0, 40)).map(lambda p: p[0][: p[1]]),
        base.map(str.upper),
        st.tuples(base, st.text(max_size=6)).map(lambda p: f"{p[0]}@{p[1]}"),
    )
    return st.one_of(base, misses) if exact else misses.map(miss)


def batch_refs() -> st.SearchStrategy[str]:
    """Inputs of ExecuteBatch that name an output of an earlier call: "@K:I", or not quite."""
    number = st.one_of(st.integers(-3, 3), st.integers(-(2**70), 2**70))
    return st.one_of(
        st.tuples(number, number).map(lambda p: f"@{p[0]}:{p[1]}"),
        st.text(max_size=8).map(lambda s: "@" + s),
    )


def element(f: FieldDescriptor, where: str, hinted: dict[str, Any], depth: int = 0) -> Any:
    """One value of field `f` of message `where` (one element, for a repeated field):
    `hinted["where.field"]` or `hinted["field"]` when there is one, else any value of
    its type (strings empty, unicode or odd; integers small, at the limits or anywhere;
    NaN, infinite, negative and tiny floats; unknown enum numbers)."""
    hint = hinted.get(f"{where}.{f.name}", hinted.get(f.name))
    if hint is not None:
        return hint
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        if depth >= 3:
            return st.just(message_factory.GetMessageClass(f.message_type)())
        return message_of(f.message_type, hinted, depth + 1)
    if f.type == FieldDescriptor.TYPE_STRING:
        return garbage_text
    if f.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if f.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        floats = st.floats() if f.type == FieldDescriptor.TYPE_DOUBLE else st.floats(width=32)
        return st.one_of(floats, st.sampled_from(ODD_FLOATS))
    if f.type == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    low, high = _INT_RANGES[f.type]
    return st.one_of(st.integers(max(low, -3), 8), st.integers(low, high))


def is_map(f: FieldDescriptor) -> bool:
    return f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def value_of(f: FieldDescriptor, where: str, hinted: dict[str, Any], depth: int = 0) -> Any:
    """A whole value of field `f`: a list for a repeated field, a dict for a map."""
    hint = hinted.get(f"{where}.{f.name}")
    if is_map(f):
        if hint is not None:
            return hint
        key, value = (f.message_type.fields_by_name[n] for n in ("key", "value"))
        return st.dictionaries(element(key, where, {}), element(value, where, {}), max_size=3)
    one = element(f, where, hinted, depth)
    if f.is_repeated:
        return rarely(st.lists(one, max_size=4), st.lists(one, min_size=60, max_size=70))
    if f.type == FieldDescriptor.TYPE_STRING:
        return rarely(one, st.sampled_from(HUGE_TEXT))
    if f.type == FieldDescriptor.TYPE_BYTES:
        return rarely(one, st.sampled_from(HUGE_BYTES))
    return one


def assign(message: Message, f: FieldDescriptor, value: Any) -> None:
    """Sets field `f` of `message` to `value`; None clears it."""
    message.ClearField(f.name)
    if value is None:
        return
    target = getattr(message, f.name)
    if is_map(f):
        target.update(value)
    elif f.is_repeated and f.type == FieldDescriptor.TYPE_MESSAGE:
        for item in value:
            target.add().CopyFrom(item)
    elif f.is_repeated:
        target.extend(value)
    elif f.type == FieldDescriptor.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, f.name, value)


def message_of(desc: Descriptor, hinted: dict[str, Any], depth: int = 0) -> Any:
    """Messages of type `desc` built field by field, each field set or not."""
    cls = message_factory.GetMessageClass(desc)

    def set_or_not(f: FieldDescriptor) -> Any:
        return st.one_of(st.none(), value_of(f, desc.name, hinted, depth)).map(lambda v: (f, v))

    parts = [set_or_not(f) for f in desc.fields]

    def build(fields: Iterable[tuple[FieldDescriptor, Any]]) -> Message:
        message = cls()
        for f, value in fields:
            assign(message, f, value)
        return message

    return st.tuples(*parts).map(build)


def field_paths(message: Message) -> list[tuple[tuple[str, int | None], ...]]:
    """Every field of a message, of the messages it holds and of each element of its
    repeated fields, as a path of (field, index) steps."""
    paths: list[tuple[tuple[str, int | None], ...]] = []
    for f in message.DESCRIPTOR.fields:
        paths.append(((f.name, None),))
        value = getattr(message, f.name)
        if is_map(f):
            continue
        if f.is_repeated:
            for i, item in enumerate(value):
                paths.append(((f.name, i),))
                if f.type == FieldDescriptor.TYPE_MESSAGE:
                    paths += [((f.name, i), *p) for p in field_paths(item)]
        elif f.type == FieldDescriptor.TYPE_MESSAGE and message.HasField(f.name):
            paths += [((f.name, None), *p) for p in field_paths(value)]
    return paths


@st.composite
def near_valid(draw: Any, template: Message, hinted: dict[str, Any]) -> Message:
    """`template`, a real request, with none, one or two of its fields (at any depth)
    changed to a fuzzed value or cleared."""
    message = type(template)()
    message.CopyFrom(template)
    paths = field_paths(template)
    for path in draw(st.lists(st.sampled_from(paths), max_size=2, unique=True)) if paths else []:
        parent = message
        try:
            for name, index in path[:-1]:
                parent = getattr(parent, name) if index is None else getattr(parent, name)[index]
            name, index = path[-1]
            if index is not None:
                getattr(parent, name)[index]  # noqa: B018 - still there after the other change?
        except IndexError:
            continue
        f = parent.DESCRIPTOR.fields_by_name[name]
        where = parent.DESCRIPTOR.name
        if index is None:
            assign(parent, f, draw(st.one_of(st.none(), value_of(f, where, hinted))))
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(parent, name)[index].CopyFrom(draw(element(f, where, hinted)))
        else:
            getattr(parent, name)[index] = draw(element(f, where, hinted))
    return message


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= 2**64 - 1
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _unknown_field(number: int, wire_type: int, value: int, data: bytes) -> bytes:
    body = {
        0: _varint(value),
        1: value.to_bytes(8, "little"),
        2: _varint(len(data)) + data,
        5: (value & 0xFFFFFFFF).to_bytes(4, "little"),
    }.get(wire_type, data)
    return _varint((number << 3) | wire_type) + body


# Fields no version of the proto has (or known numbers with the wrong wire type).
unknown_fields = st.lists(
    st.builds(
        _unknown_field,
        st.one_of(st.integers(1, 40), st.integers(0, 2**30)),
        st.sampled_from([0, 1, 2, 5, 3, 7]),
        st.integers(0, 2**64 - 1),
        st.binary(max_size=16),
    ),
    max_size=3,
).map(b"".join)


def mutations(original: bytes) -> st.SearchStrategy[bytes]:
    """`original` with bytes flipped, cut short, extended, spliced, zeroed or doubled."""
    at = st.integers(0, len(original) - 1)

    def flip(changes: list[tuple[int, int]]) -> bytes:
        data = bytearray(original)
        for i, x in changes:
            data[i] ^= x
        return bytes(data)

    return st.one_of(
        st.lists(st.tuples(at, st.integers(1, 255)), min_size=1, max_size=8).map(flip),
        at.map(lambda i: original[:i]),
        st.binary(min_size=1, max_size=64).map(lambda b: original + b),
        st.tuples(at, st.binary(min_size=1, max_size=32)).map(
            lambda p: original[: p[0]] + p[1] + original[p[0] :]
        ),
        st.tuples(at, st.integers(1, 64), st.sampled_from([b"\x00", b"\xff"])).map(
            lambda p: original[: p[0]] + p[2] * p[1] + original[p[0] + p[1] :]
        ),
        at.map(lambda i: original[i:]),
        st.just(original + original),
    )


def split(data: bytes, sizes: list[int]) -> list[bytes]:
    """`data` in pieces of these sizes, and the rest."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(data[start : start + size])
        start += size
    return [*pieces, data[start:]] if start < len(data) else pieces


def fill(message: Message, old: str, new: str) -> Message:
    """`message` with every string field (at any depth) that is `old` set to `new`: the
    id of what a chain created goes where its template says `old`."""
    for f, value in message.ListFields():
        if f.type == FieldDescriptor.TYPE_STRING and f.is_repeated:
            value[:] = [new if v == old else v for v in value]
        elif f.type == FieldDescriptor.TYPE_STRING and value == old:
            setattr(message, f.name, new)
        elif f.type == FieldDescriptor.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry:
            for item in value if f.is_repeated else [value]:
                fill(item, old, new)
    return message


def near_valid_stream(template: list[Message], hinted: dict[str, Any], data: Any) -> Any:
    """A request stream with a near-valid header, then `data(header)`."""
    chunk = type(template[0])
    return near_valid(template[0].header, hinted).flatmap(
        lambda h: data(h).map(lambda d: [chunk(header=h), *(chunk(data=p) for p in d)])
    )


def stream_of(chunk: Any, header: Any, data: Any) -> Any:
    """Request streams from scratch: a header, then data split anywhere; or any messages."""
    anything = message_of(chunk.DESCRIPTOR, {})
    ordered = st.tuples(header, data, st.lists(st.integers(0, 4096), max_size=4)).map(
        lambda p: [chunk(header=p[0]), *(chunk(data=d) for d in split(p[1], p[2]))]
    )
    return st.one_of(
        ordered,
        st.lists(anything, max_size=5),
        st.lists(st.one_of(header.map(lambda h: chunk(header=h)), anything), max_size=4),
    )


class Watchdog(threading.Thread):
    """Calls a cheap unary method (an empty request) every second on a channel of its
    own: a request that freezes the server for every client, not just for itself, shows
    as a call with no answer within `timeout_s`; `missed` says what `doing()` was then."""

    def __init__(
        self, address: str, method: str, doing: Callable[[], str], timeout_s: float
    ) -> None:
        super().__init__(name="fuzz-watchdog", daemon=True)
        self.address = address
        self.method = method
        self.doing = doing
        self.timeout_s = timeout_s
        self.stopping = threading.Event()
        self.slowest_s = 0.0
        self.missed: list[str] = []

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            call = channel.unary_unary(
                self.method, request_serializer=None, response_deserializer=None
            )
            while not self.stopping.wait(1.0):
                started = time.monotonic()
                try:
                    call(b"", timeout=self.timeout_s)
                except grpc.RpcError as error:
                    self.missed.append(f"{error.code().name} during {self.doing()}")
                self.slowest_s = max(self.slowest_s, time.monotonic() - started)

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.join(timeout=2 * self.timeout_s)
