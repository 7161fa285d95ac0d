"""Array vocabulary shared by client, controller and workers: dtypes by name and the
shape-and-dtype spec of a remote array."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slicewise.common.errors import InvalidRequestError


def dtype_of(name: str) -> np.dtype:
    """A numpy dtype from its name, including JAX's extra ones (bfloat16, float8_*).

    Raises:
        InvalidRequestError: the name is not a dtype.
    """
    import ml_dtypes

    try:
        dtype = np.dtype(getattr(ml_dtypes, name, name))
    except TypeError:
        raise InvalidRequestError(
            f"unknown dtype {name!r}; use a numpy dtype name such as "
            "'float32', 'bfloat16' or 'int32'"
        ) from None
    if dtype.kind not in "biufc" and dtype.type.__module__ != "ml_dtypes":
        raise InvalidRequestError(f"dtype {name!r} cannot live on an accelerator")
    return dtype


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of an array (the dtype by name, so it travels as text)."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, shape: Sequence[int], dtype: str | np.dtype) -> ArraySpec:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        spec = cls(tuple(int(d) for d in shape), dtype_of(name).name)
        if any(d < 0 for d in spec.shape):
            raise InvalidRequestError(f"shape {spec.shape} has a negative dimension")
        return spec

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"
