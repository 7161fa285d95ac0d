"""slicewise: a single-controller runtime for JAX on TPU v5e multislice clusters.

The client API lives in `controller.client`; this module is its short name:

    import slicewise
    client = slicewise.connect("127.0.0.1:50051")
"""

from controller.client import Client, Gang, Mesh, Output, Program, RemoteArray, connect, delete
from controller.errors import (
    CapacityError,
    DeadlineError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    ProgramMismatchError,
    SlicewiseError,
    WorkerError,
)

__all__ = [
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
