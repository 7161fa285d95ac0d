"""Who is calling: bearer tokens per tenant, checked on every RPC.

A controller that owns a cluster is reachable over the network, so it authenticates by
default. Each tenant has one or more bearer tokens; the controller keeps only their
SHA-256 digests, in a tokens file of one JSON object per line:

    {"tenant": "alice", "role": "user", "sha256": "9f86d0...",
     "caps": {"max_chips": 64, "max_priority": 5, "max_queued": 4, "max_bytes": 1e12}}

`slicewise token add --tokens-file F --tenant alice` makes a token (32 random bytes,
URL-safe base64), appends its digest and prints the token once. A token has that much
entropy, so a plain digest is as good as a slow password hash here, and a stolen tokens
file gives no usable token. Roles: "user", or "admin" (sees and acts on everything).

`caps` (optional; a tenant's caps are those of its first line that gives them) bound what
a tenant may hold at once: chips over its gangs, the priority it may ask for, allocation
requests waiting, and bytes of arrays on its gangs. Past one, a request gets
RESOURCE_EXHAUSTED saying what is in use (controller/admission.py, controller/core.py).

Clients send `authorization: Bearer <token>` metadata (`slicewise.connect(token=...)` or
$SLICEWISE_TOKEN). `AuthInterceptor` checks it before any handler runs and answers
UNAUTHENTICATED when it is missing or unknown; for calls it lets through, the handler
finds the caller in `current_identity()`.

Without a tokens file a controller runs only with `--insecure-local`, and only on a
loopback address: nobody else can reach it (the embedded simulation, `make demo`, tests).
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import hmac
import ipaddress
import json
import math
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from slicewise.common.auth import METADATA_KEY, TOKEN_ENV

ROLES = ("user", "admin")


class AuthConfigError(ValueError):
    """A tokens file or authentication setting that cannot be used; the message says why."""


CAPS = ("max_chips", "max_priority", "max_queued", "max_bytes")


@dataclass(frozen=True)
class Caps:
    """What a tenant may hold at once; None: no cap."""

    max_chips: int | None = None
    max_priority: int | None = None
    max_queued: int | None = None
    max_bytes: int | None = None


@dataclass(frozen=True)
class Identity:
    """Who made a call: a tenant and its role. The local identity (no authentication,
    loopback only) is the admin tenant "local"."""

    tenant: str
    role: str = "user"

    @property
    def admin(self) -> bool:
        return self.role == "admin"


LOCAL = Identity("local", "admin")
_current: contextvars.ContextVar[Identity] = contextvars.ContextVar("identity", default=LOCAL)


def run_as(identity: Identity) -> None:
    """Makes `identity` the caller for the rest of this task (e.g. a job's own task)."""
    _current.set(identity)


def current_identity() -> Identity:
    """The caller of the RPC being handled (LOCAL when the controller does not
    authenticate)."""
    return _current.get()


def may_see(tenant: str) -> bool:
    """Whether the caller may see (and act on) what `tenant` made: its own, or anything
    for an admin. What it may not see answers NOT_FOUND, exactly as what does not exist."""
    caller = current_identity()
    return caller.admin or caller.tenant == tenant


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")


class TokenTable:
    """The tokens a controller accepts, by digest."""

    def __init__(self, entries: dict[str, Identity], caps: dict[str, Caps] | None = None) -> None:
        self._by_digest = dict(entries)
        self.caps: dict[str, Caps] = dict(caps or {})

    def __len__(self) -> int:
        return len(self._by_digest)

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Reads a tokens file (see the module docstring).

        Raises:
            AuthConfigError: the file is missing, unreadable, empty, or has a bad line
                (the line number and what is wrong are in the message).
        """
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise AuthConfigError(f"cannot read tokens file {path}: {exc.strerror}") from None
        entries: dict[str, Identity] = {}
        caps: dict[str, Caps] = {}
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            where = f"tokens file {path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AuthConfigError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise AuthConfigError(f"{where}: expected an object with tenant, role, sha256")
            tenant, role, sha = row.get("tenant"), row.get("role", "user"), row.get("sha256")
            if not isinstance(tenant, str) or not tenant or len(tenant) > 64:
                raise AuthConfigError(f"{where}: 'tenant' must be a name of 1-64 characters")
            if role not in ROLES:
                raise AuthConfigError(f"{where}: 'role' must be one of {list(ROLES)}")
            if not isinstance(sha, str) or len(sha) != 64 or not _is_hex(sha):
                raise AuthConfigError(f"{where}: 'sha256' must be 64 hex digits")
            entries[sha.lower()] = Identity(tenant, role)
            if "caps" in row and tenant not in caps:
                caps[tenant] = _caps(row["caps"], where)
        if not entries:
            raise AuthConfigError(
                f"tokens file {path} holds no tokens; add one with `slicewise token add "
                f"--tokens-file {path} --tenant NAME`"
            )
        return cls(entries, caps)

    def identify(self, token: str) -> Identity | None:
        """The identity of `token`, or None. Compares digests in constant time."""
        wanted = digest(token)
        found = None
        for known, identity in self._by_digest.items():
            if hmac.compare_digest(known, wanted):
                found = identity
        return found


def _caps(value: Any, where: str) -> Caps:
    if not isinstance(value, dict) or set(value) - set(CAPS):
        raise AuthConfigError(f"{where}: 'caps' must be an object with some of {list(CAPS)}")
    for name, cap in value.items():
        number = isinstance(cap, int | float) and not isinstance(cap, bool)
        if not number or not math.isfinite(cap) or cap < 0:
            raise AuthConfigError(f"{where}: caps.{name} must be a number >= 0, got {cap!r}")
    return Caps(**{name: int(cap) for name, cap in value.items()})


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True


def add_token(
    path: str | Path, tenant: str, role: str = "user", caps: dict[str, int] | None = None
) -> str:
    """Makes a token for `tenant`, appends its digest (and `caps`, see `Caps`) to the
    tokens file (created with mode 0600 if missing) and returns the token, which is
    stored nowhere else.

    Raises:
        AuthConfigError: a bad tenant name, role or cap.
    """
    if not tenant or len(tenant) > 64 or not tenant.isprintable():
        raise AuthConfigError("a tenant is a printable name of 1-64 characters")
    if role not in ROLES:
        raise AuthConfigError(f"role {role!r} must be one of {list(ROLES)}")
    row: dict[str, Any] = {"tenant": tenant, "role": role}
    if caps:
        _caps(caps, "caps")  # checked before anything is written
        row["caps"] = caps
    token = new_token()
    line = json.dumps({**row, "sha256": digest(token)})
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as out:
        out.write(line + "\n")
    return token


def bearer(metadata: Any) -> str | None:
    """The token of an `authorization: Bearer <token>` entry of invocation metadata."""
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return None


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches this machine only ("localhost", 127.0.0.0/8, ::1).
    Names other than "localhost" count as not loopback: they may resolve to anything."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with a known bearer token, and runs its handler with the
    caller as `current_identity()`."""

    def __init__(self, table: TokenTable) -> None:
        self.table = table

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        token = bearer(details.invocation_metadata)
        identity = self.table.identify(token) if token else None
        if identity is None:
            why = "no bearer token" if not token else "an unknown bearer token"
            return _refuse(handler, f"the call has {why}; pass token= or set ${TOKEN_ENV}")
        return _as(handler, identity)


def _as(handler: grpc.RpcMethodHandler, identity: Identity) -> grpc.RpcMethodHandler:
    """`handler` with `identity` set as the caller while its behaviour runs."""

    def wrap(behaviour: Callable[..., Any], streaming_out: bool) -> Callable[..., Any]:
        if streaming_out:

            async def stream(request: Any, context: Any) -> Any:
                _current.set(identity)
                async for item in behaviour(request, context):
                    yield item

            return stream

        async def unary(request: Any, context: Any) -> Any:
            _current.set(identity)
            return await behaviour(request, context)

        return unary

    return _rebuild(handler, wrap)


def _refuse(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def wrap(_behaviour: Callable[..., Any], streaming_out: bool) -> Callable[..., Any]:
        if streaming_out:

            async def stream(request: Any, context: Any) -> Any:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
                yield  # pragma: no cover - abort raises

            return stream

        async def unary(request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return unary

    return _rebuild(handler, wrap)


def _rebuild(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable[..., Any], bool], Callable[..., Any]]
) -> grpc.RpcMethodHandler:
    """The same kind of method handler with its behaviour replaced by `wrap(behaviour,
    streams_responses)`."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True), **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False), **codec)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **codec)
