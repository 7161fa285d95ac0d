"""The errors the controller raises; the servicer maps each class to one gRPC status code.

Every message should tell the person reading it what to do next.
"""

from __future__ import annotations


class SlicewiseError(Exception):
    """Base class of all errors a client may see."""


class InvalidRequestError(SlicewiseError, ValueError):
    """The request itself is malformed or inconsistent (INVALID_ARGUMENT)."""


class ProgramMismatchError(InvalidRequestError):
    """A program does not fit the gang or its inputs (INVALID_ARGUMENT)."""


class NotFoundError(SlicewiseError, LookupError):
    """A handle, program or gang id that the controller does not know (NOT_FOUND)."""

    def __str__(self) -> str:  # LookupError would quote the message like a dict key
        return str(self.args[0]) if self.args else ""


class FailedPreconditionError(SlicewiseError):
    """The request is well formed but the system is not in a state to serve it
    (FAILED_PRECONDITION): a released gang, a failed input array."""


class CapacityError(SlicewiseError):
    """The request can never be satisfied by this cluster (RESOURCE_EXHAUSTED)."""


class DeadlineError(SlicewiseError, TimeoutError):
    """What the caller waited for did not happen within its timeout (DEADLINE_EXCEEDED)."""


class WorkerError(SlicewiseError):
    """A worker process failed or stopped answering (UNAVAILABLE)."""
