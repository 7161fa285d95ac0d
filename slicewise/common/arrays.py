"""Array vocabulary shared by client, controller and workers: dtypes by name and the
shape-and-dtype spec of a remote array."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slicewise.common.errors import InvalidRequestError
from slicewise.common.limits import MAX_ARRAY_EXTENT_BYTES, MAX_ARRAY_RANK, MAX_DTYPE_NAME


@functools.lru_cache(maxsize=64)  # a name that raises is not kept
def dtype_of(name: str) -> np.dtype:
    """A numpy dtype from its name, including JAX's extra ones (bfloat16, float8_*).

    Raises:
        InvalidRequestError: the name is not a dtype, or not one an accelerator holds.
    """
    import ml_dtypes

    extra = getattr(ml_dtypes, name, None)
    if isinstance(extra, type) and issubclass(extra, np.generic):
        return np.dtype(extra)
    shown = repr(name) if len(name) <= MAX_DTYPE_NAME else f"{name[:MAX_DTYPE_NAME]!r}..."
    try:
        dtype = np.dtype(name) if len(name) <= MAX_DTYPE_NAME else None
    except Exception:  # noqa: BLE001 - numpy's parser raises TypeError, ValueError, SyntaxError...
        dtype = None
    if dtype is None:
        raise InvalidRequestError(
            f"unknown dtype {shown}; use a numpy dtype name such as "
            "'float32', 'bfloat16' or 'int32'"
        )
    if dtype.kind not in "biufc" or dtype.itemsize > (16 if dtype.kind == "c" else 8):
        raise InvalidRequestError(
            f"dtype {shown} ({dtype}) cannot live on an accelerator; use a numeric dtype "
            "such as 'float32', 'bfloat16', 'int32' or 'bool'"
        )
    if not dtype.isnative:
        raise InvalidRequestError(
            f"dtype {shown} is not in this machine's byte order; send the data in native "
            f"order as {dtype.name!r}"
        )
    return dtype


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of an array (the dtype by name, so it travels as text)."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, shape: Sequence[int], dtype: str | np.dtype) -> ArraySpec:
        """A spec in normal form (plain ints, the dtype's canonical name).

        Raises:
            InvalidRequestError: a bad dtype, a negative dimension, more dimensions than
                numpy supports, or dimensions too large for numpy to address.
        """
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        dims = tuple(int(d) for d in shape)
        if len(dims) > MAX_ARRAY_RANK:
            raise InvalidRequestError(
                f"shape has {len(dims)} dimensions, more than the {MAX_ARRAY_RANK} numpy "
                f"supports; reshape the array to at most {MAX_ARRAY_RANK} dimensions"
            )
        spec = cls(dims, dtype_of(name).name)
        if any(d < 0 for d in spec.shape):
            raise InvalidRequestError(f"shape {spec.shape} has a negative dimension")
        # Zero-size arrays too: numpy refuses any shape whose other dimensions overflow.
        extent = math.prod(d for d in dims if d) * dtype_of(spec.dtype).itemsize
        if extent > MAX_ARRAY_EXTENT_BYTES:
            raise InvalidRequestError(
                f"a {spec} array spans {extent:.3e} bytes, more than numpy can address "
                "(2**63 - 1); check its shape for a mistake"
            )
        return spec

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"
