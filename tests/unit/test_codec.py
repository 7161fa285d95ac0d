"""The control channel's codec: every message type round-trips as the code builds it,
and what is not a message (unknown tags, wrong fields or types, bad arrays, truncated or
pickled frames) is refused with a ChannelError, without running anything."""

import contextlib
import dataclasses
import json
import os
import pickle
import typing
import uuid

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slicewise.common import codec
from slicewise.common.arrays import ArraySpec
from slicewise.common.codec import REGISTERED, TO_CONTROLLER, TO_WORKER
from slicewise.common.framing import LENGTH, ChannelError, frame, unframe
from slicewise.common.mesh import MeshSpec, ShardingSpec
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

GANG = "gang-3f2a"
MESH = MeshSpec.build(dcn={"data": 2}, ici={"data": 2, "model": 2})
SHARDING = ShardingSpec.from_partition_spec(MESH, ("data", None))
REPLICATED = ShardingSpec(MESH, ())
PROGRAM_ID = "5e" * 32  # a sha256 hex digest, as controller/programs.py makes it
NS = 1_754_000_000_123_456_789


def handles(*ids):
    return tuple(f"{GANG}/a{i}" for i in ids)


def specs():
    return [ArraySpec.of((8, 16), "float32"), ArraySpec.of((), "bfloat16")]


# Operations as controller/core.py builds them.
OPS = [
    PutOp(
        1,
        handles(1)[0],
        ArraySpec.of([8, 16], "bfloat16").shape,
        "bfloat16",
        SHARDING,
        uuid.uuid4().hex,
    ),
    LoadOp(2, PROGRAM_ID, bytes(range(256)) * 40 + b"\x00\xff", MESH, "train_step"),
    ExecOp(3, PROGRAM_ID, handles(1, 2, 3), handles(4, 5), (1,)),
    ExecOp(4, PROGRAM_ID, (), handles(6)),
    DeleteOp(5, handles(1, 2)),
    DeleteOp(6, ()),
    PinOp(7, handles(4)[0], uuid.uuid4().hex),
    BatchOp(
        8,
        "lm",
        tuple(sorted({"seq_len": "64", "d_model": "32"}.items())),
        12,
        SHARDING,
        handles(7, 8),
    ),
    SaveOp(
        9,
        "/tmp/ckpt/job-1",
        12,
        handles(4, 5),
        json.dumps({"program": "lm", "seed": 0, "global_batch_size": 8, "step": 12}),
        "job-1.0",
        3,
        (10, 20),
    ),
    RestoreOp(
        10,
        "/tmp/ckpt/job-1",
        12,
        handles(9, 10),
        tuple(s.shape for s in specs()),
        tuple(s.dtype for s in specs()),
        (SHARDING, REPLICATED),
        (("program", "lm"),),
        "job-1.1",
    ),
    RestoreOp(
        11,
        "/tmp/ckpt/job-1",
        12,
        handles(9),
        ((8, 16),),
        ("float32",),
        (SHARDING,),
        (("program", "lm"), ("seed", 0), ("global_batch_size", 8), ("step", 12), ("lr", 0.5)),
    ),
    CloseCheckpointsOp(12, "/tmp/ckpt/job-1", "job-1.1"),
    CloseCheckpointsOp(13, "/tmp/ckpt/job-1", timeout_s=30),
    PeerRestoreOp(
        14,
        handles(11, 12),
        ("gang-0/a4", "gang-0/a5"),
        tuple(s.shape for s in specs()),
        tuple(s.dtype for s in specs()),
        (SHARDING, REPLICATED),
        ("slicewise-stash-node1", "slicewise-stash-node2"),
    ),
    HangOp(15, 2.5),
]

# Completions as worker/executor.py makes them; reported values as worker/runtime.py
# takes them off the device (np.asarray of replicated outputs).
VALUES = (
    np.asarray(2.5, np.float32),
    np.asarray(np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)),
    np.arange(6, dtype=np.int32).reshape(2, 3),
    np.asarray([True, False]),
    np.zeros((0, 4), np.float16),
    np.asarray(3 + 4j, np.complex64),
)
RESULTS = [
    OpResult(3, None, None, NS, NS + 1_500_000),
    OpResult(4, "ValueError: bad op"),
    OpResult(5, None, VALUES, NS, NS + 7),
]


def round_trip(kind, payload):
    data = frame(kind, payload)
    (length,) = LENGTH.unpack(data[: LENGTH.size])
    assert length == len(data) - LENGTH.size
    return unframe(data[LENGTH.size :], TO_WORKER if kind == "submit" else TO_CONTROLLER)


def assert_same(decoded, sent):
    """Equal, of the same types all the way down (tuples stay tuples, arrays keep dtype)."""
    assert type(decoded) is type(sent)
    if isinstance(sent, np.ndarray):
        assert decoded.dtype == sent.dtype and decoded.shape == sent.shape
        assert decoded.tobytes() == sent.tobytes()
        assert decoded.flags.writeable
    elif dataclasses.is_dataclass(sent):
        for f in dataclasses.fields(sent):
            assert_same(getattr(decoded, f.name), getattr(sent, f.name))
    elif isinstance(sent, tuple | list):
        assert len(decoded) == len(sent)
        for d, s in zip(decoded, sent, strict=True):
            assert_same(d, s)
    elif isinstance(sent, dict):
        assert decoded.keys() == sent.keys()
        for k in sent:
            assert_same(decoded[k], sent[k])
    else:
        assert decoded == sent


@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{type(op).__name__}-{op.seq}")
def test_every_operation_round_trips(op):
    kind, ops = round_trip("submit", [op])
    assert kind == "submit" and type(ops) is list
    assert_same(ops[0], op)
    assert ops[0] == op and hash(ops[0]) == hash(op)  # frozen, hashable: tuples came back


def test_a_batch_of_every_operation_round_trips_in_order():
    kind, ops = round_trip("submit", OPS)
    assert_same(ops, OPS)


def test_completions_round_trip_with_their_values():
    kind, done = round_trip("done", Completions.of(RESULTS))
    assert kind == "done" and type(done) is Completions
    assert done.seqs == (3, 4, 5) and done.finished_ns == (NS + 1_500_000, 0, NS + 7)
    assert [r.seq for r in done.full] == [4, 5]  # the plain one travels only in columns
    results = done.results()
    assert_same(results, RESULTS)
    assert results[2].seconds == RESULTS[2].seconds


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda m: m["seqs"].pop(), "columns of different lengths: 2 seqs, 3 starts"),
        (lambda m: m["full"][0].update(seq=9), "names an operation the columns do not"),
        (lambda m: m["finished_ns"].__setitem__(0, "1"), "finished_ns: expected int, got str"),
    ],
)
def test_completions_whose_columns_disagree_are_refused(change, reason):
    m = msgpack.unpackb(codec.encode("done", Completions.of(RESULTS)))[1]
    change(m)
    assert reason in refused(body(["done", m]), TO_CONTROLLER)


@pytest.mark.parametrize(
    "kind, payload",
    [
        ("ready", None),
        ("error", "SequenceError: operation 3 was already submitted (next expected 9)"),
        ("beat", {"oldest_seq": 7, "oldest_kind": "exec", "stalled_s": 1.5, "compiling": ""}),
        ("beat", {"oldest_seq": 0, "oldest_kind": "", "stalled_s": 0.0, "compiling": "step"}),
    ],
)
def test_the_workers_other_messages_round_trip(kind, payload):
    assert_same(round_trip(kind, payload), (kind, payload))


def types_in(value):
    if dataclasses.is_dataclass(value):
        return {type(value)}.union(
            *(types_in(getattr(value, f.name)) for f in dataclasses.fields(value))
        )
    if isinstance(value, tuple | list):
        return set().union(*map(types_in, value))
    return set()


def test_every_operation_is_registered_and_every_registered_type_tested():
    assert set(typing.get_args(Op)) <= set(REGISTERED)
    assert types_in(OPS) | types_in(Completions.of(RESULTS)) == set(REGISTERED)


def test_arrays_in_another_byte_order_arrive_in_this_machines():
    big_endian = np.arange(4, dtype=">i4")
    _, done = round_trip("done", Completions.of([OpResult(1, None, (big_endian,))]))
    (result,) = done.results()
    (value,) = result.values
    assert value.dtype == np.dtype("int32") and value.dtype.isnative
    assert value.tolist() == [0, 1, 2, 3]


def test_an_int_where_a_float_goes_travels_as_python_has_it():
    _, (op,) = round_trip("submit", [HangOp(1, 3)])
    assert op.seconds == 3


# -- what may not be sent -------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, reason",
    [
        ([OpResult(1, None, (object(),))], "object cannot travel"),
        ([OpResult(1, None, (np.int64(3),))], "int64 cannot travel"),
        ([OpResult(1, None, (np.array(["a"], dtype=object),))], "dtype object cannot travel"),
        ([OpResult(1, None, (np.array(["ab"]),))], "cannot travel"),
        ([OpResult(1, None, (2**64,))], "cannot encode"),
    ],
)
def test_what_cannot_travel_is_refused_by_the_sender(payload, reason):
    with pytest.raises(ChannelError, match=reason):
        frame("done", Completions.of(payload))


# -- what a receiver refuses ----------------------------------------------------------


def body(message):
    return msgpack.packb(message)


def op_map(op):
    """An operation as the codec puts it on the wire, to be tampered with."""
    return msgpack.unpackb(codec.encode("submit", [op]))[1][0]


def refused(data, messages=TO_WORKER):
    with pytest.raises(ChannelError, match="malformed control frame") as info:
        unframe(data, messages)
    return str(info.value)


def test_an_unknown_tag_is_refused_and_nothing_is_looked_up_by_name():
    evil = {"@": "os.system", "seq": 1, "handles": []}
    assert "expected a PutOp or LoadOp" in refused(body(["submit", [evil]]))
    for tag in ("subprocess.Popen", "builtins.eval", "ndarray", "OpResult", "", 7, None):
        refused(body(["submit", [dict(op_map(DeleteOp(1, ())), **{"@": tag})]]))


def test_a_registered_type_out_of_its_place_is_refused():
    # A completion where an operation goes, a mesh where a sharding goes.
    assert "expected a PutOp" in refused(
        body(["submit", [msgpack.unpackb(codec.encode("done", [OpResult(1)]))[1][0]]])
    )
    put = op_map(OPS[0])
    put["sharding"] = put["sharding"]["mesh"]
    assert "PutOp.sharding: expected a ShardingSpec" in refused(body(["submit", [put]]))


def test_a_message_the_receiver_may_not_be_sent_is_refused():
    assert "unknown message 'done'" in refused(codec.encode("done", RESULTS), TO_WORKER)
    assert "unknown message 'submit'" in refused(codec.encode("submit", OPS), TO_CONTROLLER)
    assert "unknown message 'exec'" in refused(body(["exec", "print(1)"]))


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (
            lambda m: m.pop("handles"),
            "a DeleteOp has the fields ['seq', 'handles'], got ['seq']",
        ),
        (lambda m: m.update(extra=1), "got ['extra', 'handles', 'seq']"),
        (lambda m: m.update(seq="1"), "DeleteOp.seq: expected int, got str"),
        (lambda m: m.update(seq=True), "DeleteOp.seq: expected int, got bool"),
        (lambda m: m.update(seq=1.0), "DeleteOp.seq: expected int, got float"),
        (lambda m: m.update(handles="g/a1"), "DeleteOp.handles: expected an array, got str"),
        (lambda m: m.update(handles=[1]), "DeleteOp.handles: expected str, got int"),
        (lambda m: m.update(handles={"@": "ndarray"}), "DeleteOp.handles: expected an array"),
        (lambda m: m.update({7: 1}), "map key"),
    ],
)
def test_wrong_fields_are_refused(tamper, reason):
    m = op_map(DeleteOp(1, ("g/a1",)))
    tamper(m)
    assert reason in refused(body(["submit", [m]]))


def test_the_checks_of_a_registered_type_run_on_what_arrives():
    load = op_map(OPS[1])
    load["mesh"]["axes"][0]["name"] = "__import__('os')"
    assert "is not an identifier" in refused(body(["submit", [load]]))
    load["mesh"]["axes"] = []
    assert "a mesh needs at least one axis" in refused(body(["submit", [load]]))


def array_map(**changes):
    m = {"@": "ndarray", "dtype": "float32", "shape": [2], "data": b"\x00" * 8}
    m.update(changes)
    return m


@pytest.mark.parametrize(
    "array, reason",
    [
        (array_map(dtype="object"), "dtype 'object'"),
        (array_map(dtype="<U2"), "cannot live on an accelerator"),
        (array_map(dtype="V8"), "cannot live on an accelerator"),
        (array_map(dtype=">f4"), "byte order"),
        (array_map(dtype="numpy.core.multiarray._reconstruct"), "unknown dtype"),
        (array_map(dtype=7), "dtype is a name"),
        (array_map(shape=[3]), "has 12 bytes"),
        (array_map(shape=[-2]), "sizes >= 0"),
        (array_map(shape=[2.0]), "sizes >= 0"),
        (array_map(shape=[1] * 65, data=b"\x00" * 4), "up to 64"),
        (array_map(data="\x00" * 8), "has 8 bytes, got str"),
        (dict(array_map(), strides=[4]), "dtype, shape and data"),
        ({"@": "ndarray"}, "dtype, shape and data"),
        ({"dtype": "float32"}, "expected a plain value or an ndarray"),
    ],
)
def test_bad_arrays_are_refused(array, reason):
    done = msgpack.unpackb(codec.encode("done", Completions.of([OpResult(1, None, (1,))])))[1]
    done["full"][0]["values"] = [array]
    assert reason in refused(body(["done", done]), TO_CONTROLLER)


def test_every_truncation_of_a_frame_is_refused():
    data = codec.encode("submit", OPS[:4])
    for n in range(len(data)):
        refused(data[:n])


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x92",
        b"{}",
        b"\x91" * 5000 + b"\xc0",
        b"\x92\xa6submit\xc0\xc0",
        b"\x92\xa6submit\xc0",
    ],
)
def test_what_is_not_one_msgpack_message_is_refused(data):
    refused(data)


class Exploit:
    """What a pickle can make its loader do: call any function."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_exploit_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(("submit", [Exploit(marker)]), protocol=protocol)
        refused(data)
        refused(data, TO_CONTROLLER)
    assert not marker.exists()
    pickle.loads(data)  # what the channel did before: it runs the command
    assert marker.exists()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_to_a_message_or_are_refused(data):
    for messages in (TO_WORKER, TO_CONTROLLER):
        with contextlib.suppress(ChannelError):
            unframe(data, messages)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_corrupted_frame_decodes_to_registered_types_or_is_refused(data):
    good = bytearray(codec.encode("submit", OPS))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    try:
        _, ops = unframe(bytes(good), TO_WORKER)
    except ChannelError:
        return
    assert all(type(op) in REGISTERED for op in ops)
