"""The worker's buffer table: array handle -> this host's part of a global jax.Array."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Failed:
    """Stands in for an array whose producing operation failed."""

    error: str


_MISSING = object()


class UnknownHandleError(KeyError):
    """The controller referred to a handle this worker does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class BufferTable:
    """Handle -> array (or Failed). Thread-safe: the executor writes, readers look up."""

    def __init__(self) -> None:
        self._arrays: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._arrays)

    def put(self, handle: str, array: Any) -> None:
        with self._lock:
            self._arrays[handle] = array

    def fail(self, handles: tuple[str, ...], error: str) -> None:
        with self._lock:
            for h in handles:
                self._arrays[h] = Failed(error)

    def get(self, handle: str) -> Any:
        """The array for `handle`.

        Raises:
            UnknownHandleError: the handle is not here.
            RuntimeError: the array's producing operation failed.
        """
        return self.get_all((handle,))[0]

    def get_all(self, handles: tuple[str, ...]) -> list[Any]:
        """The arrays for `handles`, in order (one look-up for an operation's inputs);
        raises as `get` does."""
        values = []
        with self._lock:
            for h in handles:
                value = self._arrays.get(h, _MISSING)
                if value is _MISSING:
                    raise UnknownHandleError(f"array {h} is not on this worker")
                if isinstance(value, Failed):
                    raise RuntimeError(f"array {h} is unavailable: {value.error}")
                values.append(value)
        return values

    def put_all(self, handles: tuple[str, ...], arrays: list[Any]) -> None:
        """Stores each array under its handle; all or, if their numbers differ, none."""
        if len(handles) != len(arrays):
            raise ValueError(f"{len(handles)} handles for {len(arrays)} arrays")
        with self._lock:
            self._arrays.update(zip(handles, arrays, strict=True))

    def delete(self, handles: tuple[str, ...]) -> int:
        with self._lock:
            return sum(self._arrays.pop(h, None) is not None for h in handles)

    def nbytes(self) -> int:
        """Bytes held on this host's devices."""
        with self._lock:
            arrays = [a for a in self._arrays.values() if not isinstance(a, Failed)]
        return sum(sum(s.data.nbytes for s in a.addressable_shards) for a in arrays)
