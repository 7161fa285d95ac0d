"""Capabilities: what a client shows a worker's data port for one direct transfer.

The controller holds each gang's secret token; a worker's data port serves whoever
shows it (worker/transport.py). A client that sends or reads array pieces straight to or
from the workers gets, per transfer, a capability instead: the right to do one operation
("put" or "get") on one key until a deadline, signed with the gang's token, and for a put
also the exact number of bytes the host is to receive (so that it cannot be made to hold
more than the controller admitted):

    "<expires_unix_s>.<nbytes>.<hex HMAC-SHA256(token, "<op>:<key>:<nbytes>:<expires>")>"

The worker checks it with the token it already has; nothing is stored on either side
until the transfer happens, and the token never leaves the controller.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

OPS = ("put", "get")


class CapabilityError(ValueError):
    """A capability that does not allow what it was shown for (and why)."""


@dataclass(frozen=True)
class Grant:
    """What a checked capability allows: its deadline and, for a put, its byte count."""

    expires_unix_s: int
    nbytes: int


def _signature(token: str, op: str, key: str, nbytes: int, expires: int) -> str:
    message = f"{op}:{key}:{nbytes}:{expires}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def issue(token: str, op: str, key: str, expires_unix_s: int, nbytes: int = 0) -> str:
    """The capability to do `op` on `key` at the data ports of the gang whose secret is
    `token`, until `expires_unix_s` (whole seconds since the epoch); a put's carries the
    bytes the host receives."""
    if op not in OPS:
        raise ValueError(f"a capability is for one of {OPS}, not {op!r}")
    if not token:
        raise ValueError("a capability needs the gang's token")
    signature = _signature(token, op, key, nbytes, expires_unix_s)
    return f"{expires_unix_s}.{nbytes}.{signature}"


def check(token: str, capability: str, op: str, key: str, now_unix_s: float) -> Grant:
    """What `capability` allows, if it allows `op` on `key` now.

    Raises:
        CapabilityError: it is malformed, signed for another op or key (or another
            gang), or expired.
    """
    parts = capability.split(".")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() and len(p) < 20 for p in parts[:2]):
        raise CapabilityError("a malformed capability")
    expires, nbytes = int(parts[0]), int(parts[1])
    expected = _signature(token, op, key, nbytes, expires)
    if not hmac.compare_digest(parts[2].encode(), expected.encode()):
        raise CapabilityError(f"a capability that does not allow {op} of {key!r}")
    if now_unix_s >= expires:
        raise CapabilityError(f"a capability for {op} of {key!r} that expired")
    return Grant(expires, nbytes)
