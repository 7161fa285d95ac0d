"""The codec of control-channel messages: msgpack that can only ever decode to data.

A message is `(kind, payload)`, packed as a two-element msgpack array. Each direction
has its table of kinds and the type of each kind's payload (`TO_WORKER`,
`TO_CONTROLLER`), and a receiver decodes against the table of what it may be sent:

- an instance of a registered dataclass (`REGISTERED`: the operations, their
  completion, and the mesh and sharding specs inside them) is a msgpack map of its
  fields plus its tag under the key `"@"`: `{"@": "DeleteOp", "seq": 7, "handles":
  ["g/a1"]}`;
- a numpy array is `{"@": "ndarray", "dtype": "bfloat16", "shape": [2, 3], "data":
  <raw bytes>}`;
- str, bytes, int, float, bool, None and tuples are msgpack's own (tuples as arrays).

Decoding is driven by the field annotations of the registered types, read once at
import: every value must have the type its field declares (the tuples that the type
needs come back as tuples), a map must carry a tag that the position allows and exactly
that type's fields, and the only objects made are instances of registered classes (whose
`__post_init__` checks run) and numpy arrays of a dtype that `dtype_of` accepts. Nothing
on the wire names a class, a module or a function to be looked up. A message that does
not fit raises `CodecError`.

Only dataclasses are registered: msgpack would pack a NamedTuple as a plain array and
an enum member as its value, so neither may appear in a message (none does).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np

from slicewise.common.arrays import dtype_of
from slicewise.common.limits import MAX_ARRAY_RANK
from slicewise.common.mesh import MeshAxis, MeshSpec, ShardingSpec
from slicewise.common.ops import (
    BatchOp,
    CloseCheckpointsOp,
    Completions,
    DeleteOp,
    ExecOp,
    HangOp,
    LoadOp,
    Op,
    OpResult,
    PeerRestoreOp,
    PinOp,
    PutOp,
    RestoreOp,
    SaveOp,
)

# The key that holds a map's type tag; not an identifier, so no field can take it.
TAG = "@"
ARRAY_TAG = "ndarray"

# Every type whose instances may travel, tagged by class name.
REGISTERED: tuple[type, ...] = (
    MeshAxis,
    MeshSpec,
    ShardingSpec,
    PutOp,
    LoadOp,
    ExecOp,
    DeleteOp,
    PinOp,
    BatchOp,
    SaveOp,
    RestoreOp,
    CloseCheckpointsOp,
    PeerRestoreOp,
    HangOp,
    OpResult,
    Completions,
)


class CodecError(ValueError):
    """A message that is not msgpack, or does not fit the types it may have."""


# -- encoding ----------------------------------------------------------------------------


def _array_map(array: np.ndarray) -> dict[str, Any]:
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    try:
        dtype_of(array.dtype.name)
    except Exception as exc:  # noqa: BLE001 - InvalidRequestError: not an accelerator dtype
        raise TypeError(f"an array of dtype {array.dtype} cannot travel: {exc}") from None
    return {
        TAG: ARRAY_TAG,
        "dtype": array.dtype.name,
        "shape": array.shape,
        "data": np.ascontiguousarray(array).tobytes(),
    }


def _object_encoder(cls: type) -> Callable[[Any], dict[str, Any]]:
    tag = cls.__name__
    names = tuple(f.name for f in dataclasses.fields(cls))

    def encode(obj: Any) -> dict[str, Any]:
        fields = {TAG: tag}
        for name in names:
            fields[name] = getattr(obj, name)
        return fields

    return encode


_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    cls: _object_encoder(cls) for cls in REGISTERED
}
_ENCODERS[np.ndarray] = _array_map


def _default(obj: object) -> dict[str, Any]:
    encode = _ENCODERS.get(type(obj))
    if encode is None:
        raise TypeError(f"a {type(obj).__qualname__} cannot travel on the control channel")
    return encode(obj)


def encode(kind: str, payload: Any) -> bytes:
    """The msgpack bytes of one message (tuples and lists both become arrays).

    Raises:
        CodecError: something in it is not of a type that may travel.
    """
    try:
        return msgpack.packb((kind, payload), default=_default)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode a {kind!r} message: {exc}") from None


# -- decoding ----------------------------------------------------------------------------
#
# A decoder is made once per annotation, at import. `plain` are the types that it keeps
# as msgpack made them: a field or an item of one of them is checked in place, without a
# call (most fields of an operation are ints, strs and None).


def _describe(value: object) -> str:
    if isinstance(value, dict):
        return f"a map tagged {value.get(TAG)!r}" if TAG in value else "an untagged map"
    return f"{type(value).__name__} {value!r:.40}"


class _Decoder:
    """Decodes one value of the type it was made for, or raises CodecError."""

    plain: tuple[type, ...] = ()

    def __call__(self, value: Any) -> Any:
        raise NotImplementedError


class _Exact(_Decoder):
    """A value whose type is exactly one of `kinds` (a bool is no int)."""

    def __init__(self, kinds: tuple[type, ...]) -> None:
        self.plain = kinds
        self.wanted = " or ".join(k.__name__ for k in kinds)

    def __call__(self, value: Any) -> Any:
        if type(value) not in self.plain:
            raise CodecError(f"expected {self.wanted}, got {_describe(value)}")
        return value


class _Any(_Decoder):
    """A field typed `Any` (a completion's reported values, a restore's expected
    metadata values): a plain value, or a numpy array."""

    plain = (type(None), bool, int, float, str, bytes)

    def __call__(self, value: Any) -> Any:
        if type(value) in self.plain:
            return value
        if type(value) is dict and value.get(TAG) == ARRAY_TAG:
            return _array(value)
        raise CodecError(f"expected a plain value or an ndarray, got {_describe(value)}")


def _array(value: dict[str, Any]) -> np.ndarray:
    if value.keys() != {TAG, "dtype", "shape", "data"}:
        raise CodecError(f"an ndarray has dtype, shape and data; got {sorted(map(str, value))}")
    name, shape, data = value["dtype"], value["shape"], value["data"]
    if type(name) is not str:
        raise CodecError(f"an ndarray's dtype is a name, got {_describe(name)}")
    try:
        dtype = dtype_of(name)
    except Exception as exc:  # noqa: BLE001 - InvalidRequestError, with the reason
        raise CodecError(f"ndarray: {exc}") from None
    if (
        type(shape) is not tuple
        or len(shape) > MAX_ARRAY_RANK
        or any(type(n) is not int or n < 0 for n in shape)
    ):
        raise CodecError(f"an ndarray's shape is up to {MAX_ARRAY_RANK} sizes >= 0, got {shape!r}")
    size = math.prod(shape) * dtype.itemsize
    if type(data) is not bytes or len(data) != size:
        raise CodecError(f"an ndarray {name}{list(shape)} has {size} bytes, got {_describe(data)}")
    try:
        return np.frombuffer(data, dtype).reshape(shape).copy()  # writable, as it was sent
    except ValueError as exc:
        raise CodecError(f"ndarray {name}{list(shape)}: {exc}") from None


class _Sequence(_Decoder):
    """A msgpack array as a tuple (or a list) of `item`s."""

    def __init__(self, item: _Decoder, make: type[tuple[Any, ...]] | type[list[Any]]) -> None:
        self.item = item
        self.make = make

    def __call__(self, value: Any) -> Any:
        if type(value) is not tuple:
            raise CodecError(f"expected an array, got {_describe(value)}")
        item, plain = self.item, self.item.plain
        if isinstance(item, _Exact):  # checked in place: the tuple msgpack made is the value
            for v in value:
                if type(v) not in plain:
                    item(v)  # raises, saying what it expected
            return value if self.make is tuple else list(value)
        decoded = [v if type(v) in plain else item(v) for v in value]
        return decoded if self.make is list else tuple(decoded)


class _Fixed(_Decoder):
    """A msgpack array of a fixed length, as a tuple of one item of each of `items`."""

    def __init__(self, items: tuple[_Decoder, ...]) -> None:
        self.items = items

    def __call__(self, value: Any) -> Any:
        if type(value) is not tuple or len(value) != len(self.items):
            raise CodecError(f"expected an array of {len(self.items)}, got {_describe(value)}")
        return tuple(d(v) for d, v in zip(self.items, value, strict=True))


class _StrMap(_Decoder):
    """An untagged msgpack map with str keys, as a dict of `item`s."""

    def __init__(self, item: _Decoder) -> None:
        self.item = item

    def __call__(self, value: Any) -> Any:
        if type(value) is not dict or TAG in value:
            raise CodecError(f"expected an untagged map, got {_describe(value)}")
        item, plain = self.item, self.item.plain
        for k, v in value.items():
            if type(k) is not str:
                raise CodecError(f"expected str keys, got {_describe(k)}")
            if type(v) not in plain:
                value[k] = item(v)
        return value


class _Object(_Decoder):
    """A tagged map as the registered type its tag names, among `allowed`."""

    def __init__(self, allowed: tuple[type, ...]) -> None:
        self.allowed = {cls.__name__: _SCHEMAS[cls] for cls in allowed}
        self.wanted = " or ".join(self.allowed)

    def __call__(self, value: Any) -> Any:
        if type(value) is not dict:
            raise CodecError(f"expected a {self.wanted}, got {_describe(value)}")
        tag = value.get(TAG)
        schema = self.allowed.get(tag) if type(tag) is str else None
        if schema is None:
            raise CodecError(f"expected a {self.wanted}, got {_describe(value)}")
        if value.keys() != schema.keys:
            sent = sorted(str(k) for k in value if k != TAG)
            raise CodecError(f"a {tag} has the fields {list(schema.names)}, got {sent}")
        for name, plain, decode, items in schema.fields:
            v = value[name]
            if type(v) in plain:
                continue
            if items and type(v) is tuple:
                for x in v:  # `_Sequence`, spelled out: a tuple of handles, per operation
                    if type(x) not in items:
                        break  # the decoder says what it expected
                else:
                    continue
            try:
                value[name] = decode(v)
            except CodecError as exc:
                raise CodecError(f"{tag}.{name}: {exc}") from None
        del value[TAG]
        # Made as pickle makes a dataclass, without the generated __init__ (a frozen one
        # costs an object.__setattr__ per field): every field is here and checked, and
        # the class's own checks still run.
        obj = object.__new__(schema.cls)
        obj.__dict__.update(value)
        if schema.post_init is not None:
            try:
                schema.post_init(obj)
            except Exception as exc:  # noqa: BLE001 - InvalidRequestError, with the reason
                raise CodecError(f"{tag}: {exc}") from None
        return obj


class _Union(_Decoder):
    """A value of one of several types, told apart by its msgpack type (maps by tag)."""

    def __init__(self, alternatives: tuple[Any, ...]) -> None:
        classes = tuple(a for a in alternatives if a in _SCHEMAS)
        self.by_kind: dict[type, _Decoder] = {dict: _Object(classes)} if classes else {}
        for a in alternatives:
            if a in classes:
                continue
            decoder = _decoder(a)
            kinds = decoder.plain or _container_kind(a)
            if int in kinds and float in kinds and int in alternatives:
                kinds = (float,)  # an int is the int alternative's
            if any(k in self.by_kind for k in kinds):
                raise TypeError(f"the codec cannot tell apart the alternatives of {alternatives}")
            self.by_kind.update(dict.fromkeys(kinds, decoder))
            self.plain += tuple(k for k in decoder.plain if k in kinds)
        self.wanted = " or ".join(getattr(a, "__name__", str(a)) for a in alternatives)

    def __call__(self, value: Any) -> Any:
        decoder = self.by_kind.get(type(value))
        if decoder is None:
            raise CodecError(f"expected {self.wanted}, got {_describe(value)}")
        return decoder(value)


def _container_kind(tp: Any) -> tuple[type, ...]:
    """What msgpack decodes a container annotated `tp` to."""
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        return (tuple,)
    if origin is dict:
        return (dict,)
    raise TypeError(f"the codec cannot carry {tp!r} in a union")


def _decoder(tp: Any) -> _Decoder:
    """The decoder of a value annotated `tp`.

    Raises:
        TypeError: the codec has no way to carry `tp` (at import: register the type, or
            change the annotation).
    """
    if tp is None or tp is type(None):
        return _Exact((type(None),))
    if tp is Any:
        return _Any()
    if tp is float:
        return _Exact((float, int))  # an int where a float goes stays an int, as in Python
    if tp in (int, str, bytes, bool):
        return _Exact((tp,))
    if tp in _SCHEMAS:
        return _Object((tp,))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _Sequence(_decoder(args[0]), tuple)
    if origin is tuple:
        return _Fixed(tuple(_decoder(a) for a in args))
    if origin is list:
        return _Sequence(_decoder(args[0]), list)
    if origin is dict and args[0] is str:
        return _StrMap(_decoder(args[1]))
    if origin in (types.UnionType, typing.Union):
        return _Object(args) if all(a in _SCHEMAS for a in args) else _Union(args)
    raise TypeError(f"the control channel cannot carry a {tp!r}")


class _Schema:
    """A registered type's fields, in order, each with its decoder."""

    def __init__(self, cls: type) -> None:
        if not dataclasses.is_dataclass(cls) or "__slots__" in vars(cls):
            raise TypeError(f"{cls.__name__}: only dataclasses with a __dict__ can travel")
        self.cls = cls
        self.post_init = getattr(cls, "__post_init__", None)
        self.names = tuple(f.name for f in dataclasses.fields(cls))
        self.keys = {TAG, *self.names}
        # (name, the types kept as they are, the decoder, and for a tuple of plain values
        # (a handle list) the types its items may have, checked without a call)
        self.fields: list[tuple[str, tuple[type, ...], _Decoder, tuple[type, ...]]] = []

    def compile(self) -> None:
        """Makes the decoders (once every registered type has a schema to refer to)."""
        hints = typing.get_type_hints(self.cls)
        for name in self.names:
            decoder = _decoder(hints[name])
            items: tuple[type, ...] = ()
            if isinstance(decoder, _Sequence) and isinstance(decoder.item, _Exact):
                items = decoder.item.plain if decoder.make is tuple else ()
            self.fields.append((name, decoder.plain, decoder, items))


_SCHEMAS: dict[type, _Schema] = {cls: _Schema(cls) for cls in REGISTERED}
for _schema in _SCHEMAS.values():
    _schema.compile()


# -- the messages ------------------------------------------------------------------------


class Messages:
    """The messages one end of the channel may be sent: kind -> the type of its payload."""

    def __init__(self, kinds: Mapping[str, Any]) -> None:
        self.kinds = dict(kinds)
        self.decoders = {kind: _decoder(tp) for kind, tp in kinds.items()}


TO_WORKER = Messages(
    {
        "submit": list[Op],
        "hurry": int,  # the controller waits for this operation's completion
    }
)
TO_CONTROLLER = Messages(
    {
        "ready": None,
        "done": Completions,
        "error": str,  # why a batch was refused
        "beat": dict[str, int | float | str],  # the worker's progress (worker/channel.py)
    }
)


def decode(body: bytes | bytearray, messages: Messages) -> tuple[str, Any]:
    """The `(kind, payload)` of a message that `messages` (TO_WORKER or TO_CONTROLLER)
    allows.

    Raises:
        CodecError: the bytes are not one msgpack value, or the message is not of a kind
            in `messages`, or its payload does not fit that kind.
    """
    try:
        message = msgpack.unpackb(body, use_list=False, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - ValueError, FormatError, StackError...
        raise CodecError(f"not a msgpack value ({type(exc).__name__}: {exc})") from None
    if type(message) is not tuple or len(message) != 2 or type(message[0]) is not str:
        raise CodecError(f"a message is [kind, payload], got {_describe(message)}")
    kind, payload = message
    decoder = messages.decoders.get(kind)
    if decoder is None:
        raise CodecError(f"unknown message {kind!r} (expected one of {sorted(messages.kinds)})")
    try:
        return kind, decoder(payload)
    except CodecError as exc:
        raise CodecError(f"{kind!r} message: {exc}") from None
