"""The errors a client can meet, and the one gRPC status code each maps to.

The servicer applies this mapping at the edge (`controller/servicer.py`,
`status_code_for`, which reads each class's `status`), and the client library turns the
codes back into these classes. Every message should tell the person reading it what to
do next.

| error class             | gRPC status         | a client meets it when                        |
|-------------------------|---------------------|-----------------------------------------------|
| InvalidRequestError     | INVALID_ARGUMENT    | the request is malformed or inconsistent      |
| ProgramMismatchError    | INVALID_ARGUMENT    | a program does not fit the gang or its inputs |
| NotFoundError           | NOT_FOUND           | a gang, array, program or job id is unknown   |
| FailedPreconditionError | FAILED_PRECONDITION | the gang was released, failed, is being       |
|                         |                     | preempted or stopped, was preempted and is    |
|                         |                     | queued to resume, or is still starting; an    |
|                         |                     | input array failed                            |
| CapacityError           | RESOURCE_EXHAUSTED  | the cluster could never satisfy the request;  |
|                         |                     | an upload's piece on one chip exceeds its HBM |
| DeadlineError           | DEADLINE_EXCEEDED   | not admitted, or not ready, within its timeout|
| WorkerError             | UNAVAILABLE         | a worker died or stopped answering; a gang    |
|                         |                     | could not start (the host is named)           |
| GangBrokenError         | UNAVAILABLE         | work reached a gang as a worker of it died    |
|                         |                     | (the host is named)                           |
| ShuttingDownError       | UNAVAILABLE         | the controller is stopping; retry once it is  |
|                         |                     | back (its jobs continue then)                 |
| anything else           | INTERNAL            | a bug, e.g. InvalidTransitionError; logged    |
|                         |                     | with its traceback, the controller goes on    |
"""

from __future__ import annotations

from typing import ClassVar


class SlicewiseError(Exception):
    """Base class of all errors a client may see."""

    # The name of the grpc.StatusCode this error travels as (see the table above).
    status: ClassVar[str] = "INTERNAL"


class InvalidRequestError(SlicewiseError, ValueError):
    """The request itself is malformed or inconsistent (INVALID_ARGUMENT)."""

    status = "INVALID_ARGUMENT"


class ProgramMismatchError(InvalidRequestError):
    """A program does not fit the gang or its inputs (INVALID_ARGUMENT)."""


class NotFoundError(SlicewiseError, LookupError):
    """A handle, program or gang id that the controller does not know (NOT_FOUND)."""

    status = "NOT_FOUND"

    def __str__(self) -> str:  # LookupError would quote the message like a dict key
        return str(self.args[0]) if self.args else ""


class FailedPreconditionError(SlicewiseError):
    """The request is well formed but the system is not in a state to serve it
    (FAILED_PRECONDITION): a released, failed, preempted or stopping gang, a failed
    input array."""

    status = "FAILED_PRECONDITION"


class CapacityError(SlicewiseError):
    """The request can never be satisfied by this cluster (RESOURCE_EXHAUSTED)."""

    status = "RESOURCE_EXHAUSTED"


class DeadlineError(SlicewiseError, TimeoutError):
    """What the caller waited for did not happen within its timeout (DEADLINE_EXCEEDED)."""

    status = "DEADLINE_EXCEEDED"


class WorkerError(SlicewiseError):
    """A worker process failed or stopped answering (UNAVAILABLE)."""

    status = "UNAVAILABLE"


class GangBrokenError(WorkerError):
    """A worker of the gang failed, so nothing more can run on it (UNAVAILABLE)."""


class ShuttingDownError(SlicewiseError):
    """The controller is stopping and takes no new work (UNAVAILABLE)."""

    status = "UNAVAILABLE"


class InvalidTransitionError(RuntimeError):
    """A state change that a state machine's table does not allow: a bug, not bad input
    (INTERNAL)."""
