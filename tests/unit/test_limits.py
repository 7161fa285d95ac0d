"""The bounds a request is held to (slicewise/common/limits.py) and the checks that apply
them: dtype names, shapes, meshes, per-chip sizes, timeouts and program streams. Each
refusal is an InvalidRequestError whose message names the value and what to send."""

import math

import numpy as np
import pytest

from controller.programs import ProgramUpload
from slicewise.common.arrays import ArraySpec, dtype_of
from slicewise.common.errors import InvalidRequestError
from slicewise.common.limits import (
    MAX_ARRAY_RANK,
    MAX_MESH_AXES,
    MAX_PROGRAM_BYTES,
    check_seconds,
)
from slicewise.common.mesh import GangShape, MeshAxis, MeshSpec, ShardingSpec

# -- dtypes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "f4,(2",  # SyntaxError from numpy's comma-form parser
        "f4,(",
        "(f4",  # TypeError
        "",
        "(9223372036854775807,)f4",  # ValueError
        "f4," + "(" * 5000,
        "finfo",  # helpers of ml_dtypes, not dtypes
        "__doc__",
        "float32" * 100,
    ],
)
def test_dtype_of_refuses_whatever_numpy_cannot_parse_naming_it_and_what_to_use(name):
    with pytest.raises(InvalidRequestError, match="unknown dtype") as e:
        dtype_of(name)
    assert repr(name[:64]) in str(e.value) and "'float32'" in str(e.value)
    assert len(str(e.value)) < 200  # a long name is cut, not echoed whole


@pytest.mark.parametrize("name", ["f4,f4", "(3,)f4", "float128", "complex256", "V4"])
def test_dtype_of_refuses_records_subarrays_and_wide_floats(name):
    with pytest.raises(InvalidRequestError, match="cannot live on an accelerator.*'float32'"):
        dtype_of(name)


def test_dtype_of_refuses_a_foreign_byte_order_naming_the_native_one():
    with pytest.raises(InvalidRequestError, match="byte order.*as 'float32'"):
        dtype_of(">f4")


@pytest.mark.parametrize("name", ["complex128", "float64", "uint64", "bfloat16", "int4"])
def test_dtype_of_still_accepts_every_width_jax_has(name):
    assert dtype_of(name).name == name


# -- shapes ----------------------------------------------------------------------------


def test_array_spec_allows_as_many_dimensions_as_numpy_and_no_more():
    assert len(ArraySpec.of([1] * MAX_ARRAY_RANK, "float32").shape) == MAX_ARRAY_RANK
    with pytest.raises(InvalidRequestError, match="65 dimensions, more than the 64") as e:
        ArraySpec.of([1] * (MAX_ARRAY_RANK + 1), "float32")
    assert "reshape" in str(e.value)


@pytest.mark.parametrize(
    "shape", [(2**62,), (2**62, 2**62, 2**62), (0, 2**62), (2**40, 2**40, 0, 2**40)]
)
def test_array_spec_refuses_dimensions_numpy_cannot_address_even_when_empty(shape):
    with pytest.raises(InvalidRequestError, match=r"spans .* bytes, more than numpy can address"):
        ArraySpec.of(shape, "float32")


def test_array_spec_accepts_a_large_empty_array_numpy_can_describe():
    spec = ArraySpec.of((0, 2**40), "float32")
    assert spec.nbytes == 0
    np.empty(spec.nbytes, np.uint8).view(np.float32).reshape(spec.shape)


# -- meshes and per-chip sizes ---------------------------------------------------------


def test_a_mesh_may_have_at_most_max_mesh_axes_and_its_device_grid_works_at_the_limit():
    gang = GangShape(num_slices=1, hosts_per_slice=1, chips_per_host=4)
    axes = (MeshAxis("a0", 1, 4), *(MeshAxis(f"a{i}") for i in range(1, MAX_MESH_AXES)))
    assert MeshSpec(axes).device_grid(gang).size == 4
    with pytest.raises(InvalidRequestError, match="33 axes, more than the 32"):
        MeshSpec((*axes, MeshAxis("extra")))


def test_shard_shape_is_each_devices_piece():
    mesh = MeshSpec.build({"slice": 2}, {"data": 2, "model": 2})
    assert ShardingSpec(mesh, (("slice", "data"), ("model",))).shard_shape((8, 6, 5)) == (2, 3, 5)
    assert ShardingSpec(mesh, ()).shard_shape((8, 6)) == (8, 6)
    assert ShardingSpec(mesh, ((), ("data",))).shard_shape((3, 4)) == (3, 2)


# -- seconds ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 1e-9, 30.0, 1e9])
def test_check_seconds_passes_finite_non_negative_values(value):
    assert check_seconds("R.timeout_s", value, "0 means the default") == value


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, -1e-9])
def test_check_seconds_refuses_nan_infinite_and_negative_naming_the_field(value):
    with pytest.raises(InvalidRequestError) as e:
        check_seconds("FetchArrayRequest.timeout_s", value, "0 means the default")
    message = str(e.value)
    assert message.startswith("FetchArrayRequest.timeout_s must be a finite number of seconds")
    assert repr(value) in message and "0 means the default" in message


# -- program streams -------------------------------------------------------------------


def test_program_upload_returns_exactly_the_declared_bytes():
    upload = ProgramUpload("p", 10)
    upload.add(b"0123")
    upload.add(b"")
    upload.add(b"456789")
    assert upload.serialized() == b"0123456789"


def test_program_upload_refuses_a_byte_past_the_declared_size_at_once():
    upload = ProgramUpload("p", 10)
    upload.add(b"x" * 8)
    with pytest.raises(InvalidRequestError, match=r"more than the 10 bytes .*total_bytes"):
        upload.add(b"x" * 3)
    assert upload.received == 8  # the chunk that overflowed is not kept


def test_program_upload_refuses_a_stream_that_ends_short():
    upload = ProgramUpload("p", 10)
    upload.add(b"x" * 9)
    with pytest.raises(InvalidRequestError, match="sent 9 bytes, but its header declared"):
        upload.serialized()


@pytest.mark.parametrize("total", [0, -1, MAX_PROGRAM_BYTES + 1, 2**62])
def test_program_upload_refuses_a_declared_size_no_program_has(total):
    with pytest.raises(InvalidRequestError, match=f"total_bytes={total}.*2147483647 bytes"):
        ProgramUpload("p", total)
