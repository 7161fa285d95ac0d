"""The controller's array records and program registry, with real jax.export artifacts."""

import asyncio

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from controller.arrays import ArrayRecord, ArrayState, ArrayTable
from controller.programs import ProgramRegistry, load_program, program_id_of
from slicewise.common.arrays import ArraySpec, dtype_of
from slicewise.common.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    ProgramMismatchError,
)
from slicewise.common.mesh import GangShape, MeshSpec

MESH = MeshSpec.build({"slice": 2}, {"data": 4})
GANG = GangShape(num_slices=2, hosts_per_slice=1, chips_per_host=4)


# -- dtypes and specs ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["float32", "int8", "int32", "bool", "float16"])
def test_dtype_of_accepts_numeric_dtypes(name):
    assert dtype_of(name) == np.dtype(name)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "int4"])
def test_dtype_of_accepts_jax_extra_dtypes(name):
    assert dtype_of(name).name == name
    assert dtype_of(name).itemsize == np.dtype(getattr(ml_dtypes, name)).itemsize


def test_dtype_of_refuses_a_misspelled_name():
    with pytest.raises(InvalidRequestError, match="unknown dtype 'floot32'"):
        dtype_of("floot32")


@pytest.mark.parametrize("name", ["object", "U8", "datetime64"])
def test_dtype_of_refuses_dtypes_that_cannot_live_on_a_device(name):
    with pytest.raises(InvalidRequestError, match="cannot live on an accelerator"):
        dtype_of(name)


def test_array_spec_normalises_shape_and_dtype():
    spec = ArraySpec.of([2, np.int64(3)], np.float32)
    assert spec == ArraySpec((2, 3), "float32")
    assert spec.nbytes == 24
    assert str(spec) == "float32[2,3]"
    assert ArraySpec.of((), "int8").nbytes == 1
    assert str(ArraySpec.of((), "int8")) == "int8[]"


def test_array_spec_refuses_a_negative_dimension_and_a_bad_dtype():
    with pytest.raises(InvalidRequestError, match="negative dimension"):
        ArraySpec.of((2, -1), "float32")
    with pytest.raises(InvalidRequestError, match="unknown dtype"):
        ArraySpec.of((2,), "floot32")


# -- array records ---------------------------------------------------------------------

SPEC = ArraySpec((4,), "float32")


def test_new_records_get_distinct_handles_under_their_gang():
    table = ArrayTable()
    a, b = table.new("g1", SPEC), table.new("g2", SPEC)
    assert a.handle.startswith("g1/") and b.handle.startswith("g2/")
    assert a.handle != b.handle
    assert table.get(a.handle) is a
    assert a.state is ArrayState.PENDING
    assert len(table) == 2


def test_a_deleted_handle_is_reported_as_deleted():
    table = ArrayTable()
    record = table.new("g1", SPEC)
    assert table.delete(record.handle) is record
    with pytest.raises(NotFoundError, match=f"array {record.handle} was deleted"):
        table.get(record.handle)
    with pytest.raises(NotFoundError, match="was deleted"):
        table.delete(record.handle)
    assert len(table) == 0


def test_an_input_is_looked_up_on_the_gang_of_its_call():
    table = ArrayTable()
    mine, theirs = table.new("g1", SPEC), table.new("g2", SPEC)
    assert table.on_gang(mine.handle, "g1") is mine
    with pytest.raises(FailedPreconditionError, match=f"array {theirs.handle} lives on gang g2"):
        table.on_gang(theirs.handle, "g1")
    table.delete(mine.handle)
    with pytest.raises(NotFoundError, match="was deleted"):
        table.on_gang(mine.handle, "g1")
    with pytest.raises(NotFoundError, match="'g1/a9' is unknown"):
        table.on_gang("g1/a9", "g1")


def test_an_unknown_handle_is_reported_as_unknown():
    with pytest.raises(NotFoundError, match="'g9/a1' is unknown"):
        ArrayTable().get("g9/a1")


def test_a_wait_made_before_or_after_an_array_settles_sees_it_settled():
    """`ArrayRecord.settled` is made on first use: a waiter made before `settle` is
    woken by it, and one made after finds it set."""

    async def scenario():
        table = ArrayTable()
        early, late = table.new("g1", SPEC), table.new("g1", SPEC)
        waiting = asyncio.ensure_future(early.settled.wait())
        await asyncio.sleep(0)
        early.settle(None)
        late.settle("failed")
        await asyncio.wait_for(waiting, 5)
        return late.settled.is_set(), early.state, late.state

    late_set, early_state, late_state = asyncio.run(scenario())
    assert late_set is True
    assert (early_state, late_state) == (ArrayState.READY, ArrayState.FAILED)


def test_drop_gang_fails_pending_arrays_keeps_ready_ones_and_remembers_why():
    table = ArrayTable()
    pending, ready = table.new("g1", SPEC), table.new("g1", SPEC)
    ready.settle(None)
    other = table.new("g2", SPEC)
    assert table.drop_gang("g1", "was released") == 2
    assert pending.state is ArrayState.FAILED
    assert pending.error == "gang g1 was released"
    assert ready.state is ArrayState.READY
    assert pending.settled.is_set() and ready.settled.is_set()
    with pytest.raises(NotFoundError, match="belonged to gang g1, which was released"):
        table.get(pending.handle)
    assert table.get(other.handle) is other
    assert (table.count("g1"), table.count("g2")) == (0, 1)


def test_a_released_gang_is_remembered_once_not_handle_by_handle(monkeypatch):
    monkeypatch.setattr("controller.arrays._FORGOTTEN_LIMIT", 3)
    table = ArrayTable()
    records = [table.new("g1", SPEC) for _ in range(5)]
    kept = table.new("g2", SPEC)
    for r in records[:4]:
        table.delete(r.handle)
    assert table.remembered == 3  # the oldest deleted handle is forgotten
    with pytest.raises(NotFoundError, match="is unknown"):
        table.get(records[0].handle)
    with pytest.raises(NotFoundError, match="was deleted"):
        table.get(records[3].handle)
    table.delete(kept.handle)
    assert table.remembered == 3
    with pytest.raises(NotFoundError, match="is unknown"):
        table.get(records[1].handle)

    table.drop_gang("g1", "was released")
    assert table.remembered == 2  # g2's deleted handle, and g1
    for r in records:
        with pytest.raises(NotFoundError, match="belonged to gang g1, which was released"):
            table.get(r.handle)
    with pytest.raises(NotFoundError, match=f"array {kept.handle} was deleted"):
        table.get(kept.handle)


def test_a_record_settles_once():
    record = ArrayRecord("g1/a1", "g1", SPEC)
    record.settle(None)
    record.settle("too late")
    assert record.state is ArrayState.READY
    assert record.error == ""


def test_require_usable_refuses_only_failed_arrays_and_says_why():
    record = ArrayRecord("g1/a1", "g1", SPEC)
    record.require_usable()
    record.settle("worker 1: out of memory")
    assert record.state is ArrayState.FAILED
    with pytest.raises(FailedPreconditionError, match="g1/a1 is unavailable: worker 1: out of"):
        record.require_usable()


# -- programs --------------------------------------------------------------------------


def scale_and_cast(x, y):
    return x * 2.0 + y.sum(), y.astype(jnp.int8)


def export(mesh, x_dtype=jnp.float32):
    abstract = mesh.abstract()
    fn = jax.jit(
        scale_and_cast,
        in_shardings=(NamedSharding(abstract, P(("slice", "data"))), NamedSharding(abstract, P())),
    )
    exported = jax.export.export(fn, platforms=["cpu"])(
        jax.ShapeDtypeStruct((16,), x_dtype), jax.ShapeDtypeStruct((3, 2), jnp.float32)
    )
    return bytes(exported.serialize())


@pytest.fixture(scope="module")
def serialized():
    return export(MESH)


@pytest.fixture
def program(serialized):
    return load_program(serialized, "scale", MESH)


def test_load_program_reads_the_signature_and_device_count(serialized):
    program = load_program(serialized, "", MESH)
    assert program.name == "scale_and_cast"
    assert program.inputs == (ArraySpec((16,), "float32"), ArraySpec((3, 2), "float32"))
    assert program.outputs == (ArraySpec((16,), "float32"), ArraySpec((3, 2), "int8"))
    assert program.num_devices == 8
    assert program.platforms == ("cpu",)
    assert program.mesh == MESH


@pytest.mark.parametrize("corrupt", [b"not a program", b""], ids=["garbage", "empty"])
def test_bytes_that_are_not_an_export_are_refused(corrupt):
    with pytest.raises(InvalidRequestError, match="'p' could not be deserialized"):
        load_program(corrupt, "p", MESH)


def test_truncated_export_is_refused(serialized):
    with pytest.raises(InvalidRequestError, match="could not be deserialized"):
        load_program(serialized[: len(serialized) // 2], "p", MESH)


def test_load_program_reads_bfloat16_signatures():
    program = load_program(export(MESH, jnp.bfloat16), "bf16", MESH)
    assert program.inputs[0] == ArraySpec((16,), "bfloat16")
    assert program.inputs[0].nbytes == 32


def test_check_fits_accepts_the_gang_it_was_exported_for(program):
    program.check_fits(GANG, "cpu", "g1")


def test_check_fits_refuses_another_device_count_naming_both(program):
    with pytest.raises(ProgramMismatchError, match="exported for 8 devices, but gang g1 has 4"):
        program.check_fits(GangShape(1, 1, 4), "cpu", "g1")


def test_check_fits_refuses_another_platform(program):
    with pytest.raises(ProgramMismatchError, match=r"platforms \['cpu'\].*runs on 'tpu'"):
        program.check_fits(GANG, "tpu", "g1")


def test_check_fits_refuses_a_mesh_laid_out_differently_over_as_many_devices(serialized):
    one_slice_mesh = MeshSpec.build({"slice": 1}, {"data": 8})
    program = load_program(serialized, "p", one_slice_mesh)
    with pytest.raises(ProgramMismatchError, match="DCN parts must multiply to 2"):
        program.check_fits(GANG, "cpu", "g1")


def test_check_inputs_accepts_the_exported_signature(program):
    program.check_inputs(list(program.inputs), ["g1/a1", "g1/a2"])


def test_check_inputs_refuses_the_wrong_number_of_inputs(program):
    with pytest.raises(
        ProgramMismatchError,
        match=r"takes 2 input\(s\) \(float32\[16\], float32\[3,2\]\) but was "
        "called with 1",
    ):
        program.check_inputs([program.inputs[0]], ["g1/a1"])


@pytest.mark.parametrize(
    ("wrong", "text"),
    [
        (ArraySpec((3, 3), "float32"), r"expected float32\[3,2\], got float32\[3,3\]"),
        (ArraySpec((3, 2), "int32"), r"expected float32\[3,2\], got int32\[3,2\]"),
    ],
    ids=["shape", "dtype"],
)
def test_check_inputs_refuses_a_mismatched_input_naming_expected_and_got(program, wrong, text):
    with pytest.raises(ProgramMismatchError, match=rf"input 1 .*{text} \(array g1/a2\)"):
        program.check_inputs([program.inputs[0], wrong], ["g1/a1", "g1/a2"])


def test_program_id_is_stable_for_the_same_bytes_and_mesh(serialized):
    assert load_program(serialized, "a", MESH).program_id == program_id_of(serialized, MESH)
    assert program_id_of(serialized, MESH) == program_id_of(bytes(serialized), MESH)
    other_mesh = MeshSpec.build({"slice": 2}, {"data": 2, "model": 2})
    assert program_id_of(serialized, other_mesh) != program_id_of(serialized, MESH)
    assert program_id_of(serialized + b"\0", MESH) != program_id_of(serialized, MESH)


def test_registry_keeps_the_first_registration_and_refuses_unknown_ids(serialized):
    registry = ProgramRegistry()
    first = registry.add(load_program(serialized, "first", MESH))
    again = registry.add(load_program(serialized, "again", MESH))
    assert again is first
    assert len(registry) == 1
    assert registry.get(first.program_id) is first
    with pytest.raises(NotFoundError, match="'nope' is not registered"):
        registry.get("nope")
