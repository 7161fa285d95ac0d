"""The bounds every request is held to before the controller acts on it, each with the
reason it is where it is, and the check shared by every timeout field.

A request outside them is a client mistake (INVALID_ARGUMENT), refused with a message
that names the field, the value and what to send instead, before anything is allocated.
"""

from __future__ import annotations

import math

from slicewise.common.errors import InvalidRequestError

# numpy (which holds every array on the controller and the workers) supports at most 64
# dimensions (NPY_MAXDIMS in numpy 2).
MAX_ARRAY_RANK = 64

# A mesh's device grid is laid out with two numpy dimensions per axis (its DCN and its
# ICI part, slicewise/common/mesh.py), so 64 numpy dimensions allow 32 axes. Real meshes
# have a handful (MaxText's logical mesh, among the largest, has 12).
MAX_MESH_AXES = 32

# numpy describes an array's extent in bytes by a signed 64-bit integer.
MAX_ARRAY_EXTENT_BYTES = 2**63 - 1

# Longer than any dtype name numpy or ml_dtypes knows ("float8_e4m3b11fnuz" is 18), and
# short enough that a refusal can quote it.
MAX_DTYPE_NAME = 64

# jax.export serializes with flatbuffers, which cannot build a buffer of 2 GiB or more.
MAX_PROGRAM_BYTES = 2**31 - 1


def check_seconds(field: str, value: float, zero: str) -> float:
    """`value` if it is a finite number of seconds >= 0.

    Args:
        field: the request field, as the refusal names it ("FetchArrayRequest.timeout_s").
        value: the seconds the client sent.
        zero: what 0 means for this field, for the refusal ("0 means the default").

    Raises:
        InvalidRequestError: NaN, infinite or negative.
    """
    if not (math.isfinite(value) and value >= 0):
        raise InvalidRequestError(
            f"{field} must be a finite number of seconds >= 0, got {value!r}; {zero}"
        )
    return value
