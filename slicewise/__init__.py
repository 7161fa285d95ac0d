"""slicewise: a single-controller runtime for JAX on TPU v5e multislice clusters.

    import slicewise
    client = slicewise.connect("127.0.0.1:50051")

The client (`slicewise.client`) is loaded on first use of one of its names, so that
processes that only need the shared vocabulary (`slicewise.common`), the workers among
them, never load gRPC stubs they do not use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from slicewise.common.errors import (
    CapacityError,
    DeadlineError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    ProgramMismatchError,
    SlicewiseError,
    WorkerError,
)

if TYPE_CHECKING:
    from slicewise.client import (
        AddressError,
        Client,
        Gang,
        Mesh,
        Output,
        Program,
        RemoteArray,
        connect,
        delete,
    )

_CLIENT_NAMES = {
    "AddressError",
    "Client",
    "Gang",
    "Mesh",
    "Output",
    "Program",
    "RemoteArray",
    "connect",
    "delete",
}

__all__ = [
    "AddressError",
    "CapacityError",
    "Client",
    "DeadlineError",
    "FailedPreconditionError",
    "Gang",
    "InvalidRequestError",
    "Mesh",
    "NotFoundError",
    "Output",
    "Program",
    "ProgramMismatchError",
    "RemoteArray",
    "SlicewiseError",
    "WorkerError",
    "connect",
    "delete",
]


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        value = getattr(importlib.import_module("slicewise.client"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'slicewise' has no attribute {name!r}")
