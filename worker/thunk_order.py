"""Keeps an XLA:CPU executable's order of collectives when it is stored and read back.

XLA:CPU runs a program as a graph of thunks: a thunk runs once every earlier thunk whose
buffers overlap its own (one of them writing) has run, and once every earlier thunk that
uses the same resource has. When XLA compiles a program, all its collectives, those
inside loops included, use one communicator resource, so they run in the program's
order on every device of every host. That order is what lets hosts meet in the same
collective: gloo tags every collective alike.

An executable read back (`deserialize_executable`, jaxlib 0.10.2) keeps that shared
resource within each thunk sequence, but not across them: the collectives inside a
`while` body (a `lax.scan` over layers, say) share one resource, those of the enclosing
sequence another. The loop then runs alongside the collectives around it, in whichever
order they become ready, which may differ from host to host: hosts meet in different
collectives and hang, or abort ("op.preamble.length <= op.nbytes"). docs/restarts.md
has the experiments.

`order_collectives` rewrites the stored executable so that buffer edges alone keep the
order: in every thunk sequence, between each two consecutive thunks that run
collectives (a collective, or a loop, call or conditional holding one), it puts a call
of two one-element copies, each of an element onto itself: one of an element the first
thunk uses, one of an element the second uses. Such a copy changes nothing, but it
reads and writes both elements, so it runs after the first thunk and before the second.

The protobuf schema of the executable is read from the descriptors jaxlib carries in its
own library, so that it is the installed version's exactly. Anything this module does
not know (a sequence it cannot find, a thunk holding collectives it cannot touch)
raises `Unorderable`: the caller then does not store the executable.
"""

from __future__ import annotations

import functools
import mmap
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The executable's proto, and the file of jaxlib's library whose descriptors hold it.
_ROOT_PROTO = "xla/service/cpu/executable.proto"
_LIBRARY = "libjax_common.so"
_CALL_NAME = "slicewise-order"


class Unorderable(Exception):
    """The executable cannot be rewritten to keep its order (the reason is the message)."""


# -- the schema, from jaxlib's library ---------------------------------------------------


def _varint(data: Any, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _file_descriptor(image: Any, name: str) -> Any:
    """The FileDescriptorProto of `name` embedded in a library `image` (a serialized
    descriptor starts with its name, field 1, and ends where its fields do)."""
    from google.protobuf import descriptor_pb2

    start_tag = b"\n" + bytes([len(name)]) + name.encode()
    for match in re.finditer(re.escape(start_tag), image):
        end = match.start()
        while end < len(image):
            key, i = _varint(image, end)
            number, wire = key >> 3, key & 7
            if not 1 <= number <= 14 or wire not in (0, 2):
                break
            if wire == 0:
                _, i = _varint(image, i)
            else:
                size, i = _varint(image, i)
                i += size
            end = i
        try:
            return descriptor_pb2.FileDescriptorProto.FromString(bytes(image[match.start() : end]))
        except Exception:  # noqa: BLE001 - a string that only looks like one: go on
            continue
    raise Unorderable(f"jaxlib's library holds no descriptor of {name}")


@functools.cache
def _schema() -> Any:
    """The pool of XLA:CPU's executable protos as the installed jaxlib has them."""
    import jaxlib
    from google.protobuf import descriptor_pool

    path = Path(jaxlib.__file__).parent / _LIBRARY
    if not path.exists():
        raise Unorderable(f"no {_LIBRARY} in {path.parent}")
    pool = descriptor_pool.DescriptorPool()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as image:
        added: set[str] = set()

        def add(name: str) -> None:
            if name in added:
                return
            descriptor = _file_descriptor(image, name)
            for dependency in descriptor.dependency:
                add(dependency)
            pool.Add(descriptor)
            added.add(name)

        add(_ROOT_PROTO)
    return pool


def message_class(full_name: str) -> Any:
    """The generated class of an XLA message (e.g. "xla.cpu.ThunkProto")."""
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(_schema().FindMessageTypeByName(full_name))


# -- the rewrite ---------------------------------------------------------------------------


def _nested(thunk: Any) -> list[Any]:
    """The thunk sequences a thunk runs (a loop's condition and body, a call's, a
    conditional's branches)."""
    kind = thunk.WhichOneof("impl")
    if kind == "while_thunk":
        return [thunk.while_thunk.cond_sequence, thunk.while_thunk.body_sequence]
    if kind == "call_thunk":
        return [thunk.call_thunk.called_sequence]
    if kind == "conditional_thunk":
        return list(thunk.conditional_thunk.branch_sequences)
    return []


def runs_collectives(thunk: Any) -> bool:
    """Whether a thunk runs a collective, itself or in a sequence it runs."""
    if thunk.WhichOneof("impl") == "collective_thunk":
        return True
    return any(runs_collectives(t) for s in _nested(thunk) for t in s.thunks)


def _element(thunk: Any) -> tuple[int, int, int]:
    """(allocation, offset, element type) of one element of a buffer the thunk uses."""
    kind = thunk.WhichOneof("impl")
    if kind == "collective_thunk":
        buffers = thunk.collective_thunk.op_buffers.destination_shapes_buffer_slices
        if buffers:
            s = buffers[0]
            return s.slice.buffer_allocation_index, s.slice.offset, s.shape.element_type
    elif kind == "while_thunk":  # the predicate the loop reads after every condition
        s = thunk.while_thunk.cond_buffer
        return s.buffer_allocation_index, s.offset, s.element_type
    elif kind == "conditional_thunk":  # the branch index it reads
        s = thunk.conditional_thunk.branch_index_buffer
        return s.buffer_allocation_index, s.offset, s.element_type
    elif kind == "call_thunk":  # a call uses what the thunks it runs use
        for t in thunk.call_thunk.called_sequence.thunks:
            if runs_collectives(t):
                return _element(t)
    raise Unorderable(f"no buffer of the {thunk.kind} thunk {thunk.info.op_name!r} to order by")


_BYTES = {"PRED": 1, "S8": 1, "U8": 1, "S16": 2, "U16": 2, "F16": 2, "BF16": 2, "S32": 4}
_BYTES |= {"U32": 4, "F32": 4, "S64": 8, "U64": 8, "F64": 8, "C64": 8, "C128": 16}


def _self_copy(element: tuple[int, int, int], name: str, module: str) -> Any:
    """A copy of one element onto itself: it changes nothing, but orders the thunks
    around it as any thunk that reads and writes that element."""
    allocation, offset, element_type = element
    type_name = _schema().FindEnumTypeByName("xla.PrimitiveType").values_by_number[element_type]
    size = _BYTES.get(type_name.name)
    if size is None:
        raise Unorderable(f"an element of type {type_name.name} to order by")
    thunk = message_class("xla.cpu.ThunkProto")(kind="copy")
    thunk.info.op_name, thunk.info.module_name = name, module
    for part in (thunk.copy_thunk.src_buffer_shape, thunk.copy_thunk.dst_buffer_shape):
        part.shape.element_type = element_type
        part.shape.layout.tail_padding_alignment_in_elements = 1
        part.slice.buffer_allocation_index = allocation
        part.slice.offset = offset
        part.slice.size = size
        part.slice.element_type = element_type
    return thunk


def order_sequence(sequence: Any, module: str, counter: Iterator[int]) -> int:
    """Chains the collective-running thunks of `sequence` (and of every sequence it runs)
    in their order; returns how many order calls it put in."""
    added = sum(order_sequence(s, module, counter) for t in sequence.thunks for s in _nested(t))
    runners = [i for i, t in enumerate(sequence.thunks) if runs_collectives(t)]
    if len(runners) < 2:
        return added
    thunks = list(sequence.thunks)
    before: dict[int, Any] = {}
    for a, b in zip(runners, runners[1:], strict=False):
        n = next(counter)
        call = message_class("xla.cpu.ThunkProto")(kind="call")
        call.info.op_name, call.info.module_name = f"{_CALL_NAME}.{n}", module
        for which, thunk in (("a", thunks[a]), ("b", thunks[b])):
            copy = _self_copy(_element(thunk), f"{_CALL_NAME}-copy.{n}{which}", module)
            call.call_thunk.called_sequence.thunks.append(copy)
        before[b] = call
    index = {}
    del sequence.thunks[:]
    for i, thunk in enumerate(thunks):
        if i in before:
            sequence.thunks.append(before[i])
        index[i] = len(sequence.thunks)
        sequence.thunks.append(thunk)
    # Resource groups name their thunks by index in the sequence.
    for group in sequence.thunk_resources:
        moved = [index[i] for i in group.thunk_indices]
        del group.thunk_indices[:]
        group.thunk_indices.extend(moved)
    return added + len(before)


def order_collectives(serialized: bytes) -> tuple[bytes, int]:
    """An XLA:CPU executable serialized by jaxlib (`Executable.serialize()`) rewritten to
    keep its order of collectives when read back (see the module docstring), and how
    many order calls it took (0: nothing to order; the bytes are then the same).

    The bytes are a length-prefixed header, then the `CompilationResultProto` as field 1,
    then the rest, which is kept as it is.

    Raises:
        Unorderable: not such an executable, or one this module cannot order.
    """
    try:
        size, start = _varint(serialized, 0)
        body = start + size
        tag, i = _varint(serialized, body)
        length, i = _varint(serialized, i)
    except IndexError as exc:
        raise Unorderable("not an executable serialized by jaxlib") from exc
    if tag != (1 << 3 | 2) or i + length > len(serialized):
        raise Unorderable("not an XLA:CPU executable serialized by jaxlib 0.10")
    result = message_class("xla.cpu.CompilationResultProto").FromString(serialized[i : i + length])
    sequence = result.thunk_sequence
    if not sequence.thunks:
        raise Unorderable("the executable has no thunk sequence")
    module = sequence.thunks[0].info.module_name
    counter = iter(range(1, 1 << 62))
    added = order_sequence(sequence, module, counter)
    if not added:
        return serialized, 0
    rewritten = result.SerializeToString()
    return (
        serialized[:body]
        + b"\x0a"
        + _encode_varint(len(rewritten))
        + rewritten
        + serialized[i + length :],
        added,
    )
