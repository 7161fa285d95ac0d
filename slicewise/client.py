"""The Python client: connect to a controller, allocate a gang, compile once, run remotely.

    client = slicewise.connect("127.0.0.1:50051")
    with client.allocate(slices=2, slice_type="v5litepod-4") as gang:
        mesh = gang.mesh(dcn={"slice": 2}, ici={"data": 2, "model": 2})
        x = gang.put(np.ones((8, 16), np.float32), mesh.sharding(("slice", "data"), None))
        step = gang.compile(jax.jit(f), x)      # jax.export on the client, no devices needed
        y = step(x)                             # returns at once
        print(y.fetch())

Array bytes go straight between the client and the gang's hosts by default (a direct
put or fetch, authorized by the controller per transfer: slicewise/common/direct.py);
`connect(..., direct_data=False)` or SLICEWISE_DIRECT_DATA=0 sends them through the
controller instead, as does a client that cannot reach a host's data port.

Errors from the controller arrive as the exception classes of `slicewise.common.errors`
(InvalidRequestError, NotFoundError, ...), each with the gRPC status as `.code`.

A RemoteArray the program drops (the last wrapper of its handle garbage-collected) is
deleted on the workers without `delete()`: its handle is queued on the gang and sent in
batched DeleteArrays calls from the caller's thread (see `Gang.flush_deletes`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np

from protos import controller_pb2 as pb
from protos import controller_pb2_grpc as pb_grpc
from slicewise import wire
from slicewise.common import auth, direct
from slicewise.common.arrays import ArraySpec, dtype_of
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
from slicewise.common.framing import TransportError
from slicewise.common.mesh import MeshSpec, ShardingSpec

log = logging.getLogger(__name__)

_ERRORS: dict[grpc.StatusCode, type[SlicewiseError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineError,
    grpc.StatusCode.UNAVAILABLE: WorkerError,
}


_RECONNECT_BACKOFF_MS = 2000

# A gang sends the deletes of dropped arrays at its next put or call once this many are
# queued, or this many bytes (and always on `flush_deletes`).
DELETE_BATCH = 256
DELETE_BATCH_BYTES = 256 << 20

# Arrays of at least this many bytes go straight between the client and the hosts.
# Measured on 2 x v5litepod-4 here (medians of 15): a direct put takes 3 round trips to
# the proxied one's 2 and breaks even at 256 KiB (9.8 vs 9.4 ms; 1 MiB: 10 vs 15 ms); a
# direct fetch is quicker at any size (4 KiB: 4.7 vs 5.6 ms) but leaves the controller an
# unpin per host for later, not worth it below that either.
DIRECT_MIN_BYTES = 256 << 10
DIRECT_ENV = "SLICEWISE_DIRECT_DATA"


def _tls_credentials(
    ca: str | None, cert: str | None, key: str | None
) -> grpc.ChannelCredentials | None:
    """Channel credentials from PEM files (arguments, else the environment); None for a
    plain channel."""
    ca = ca or os.environ.get(auth.TLS_CA_ENV)
    cert = cert or os.environ.get(auth.TLS_CERT_ENV)
    key = key or os.environ.get(auth.TLS_KEY_ENV)
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("mutual TLS needs both a client certificate and its key")

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert)
    )


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str) -> None:
        self.header = auth.bearer_header(token)

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self.header]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


class _CallDetails(
    NamedTuple(
        "_CallDetails",
        [
            ("method", str),
            ("timeout", Any),
            ("metadata", Any),
            ("credentials", Any),
            ("wait_for_ready", Any),
            ("compression", Any),
        ],
    ),
    grpc.ClientCallDetails,
):
    """grpc.ClientCallDetails as a value (gRPC gives no constructor for it)."""


def _raise_from(err: grpc.RpcError) -> None:
    code = err.code()
    exc = _ERRORS.get(code, SlicewiseError)(err.details() or str(code))
    exc.code = code  # type: ignore[attr-defined]
    raise exc from None


def _local(exc: SlicewiseError) -> SlicewiseError:
    """An error found here, before any request: with the status the controller would
    have answered (`.code`), like the errors that come back from it."""
    exc.code = grpc.StatusCode[exc.status]  # type: ignore[attr-defined]
    return exc


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except grpc.RpcError as err:
        _raise_from(err)


class AddressError(ConnectionError, ValueError):
    """A controller address that is not `host:port` (refused before any connection)."""


_ADDRESS_FORM = "give it as host:port, e.g. 127.0.0.1:50051"
# How long the client tries a TCP connection to the controller's port before its gRPC
# channel does: a refused connection is reported at once, not after the whole timeout.
_PROBE_S = 2.0


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of a controller address `host:port` (`[v6 address]:port`).

    Raises:
        AddressError: it is not of that form, saying what is wrong with it.
    """
    scheme, sep, rest = address.partition("://")
    if sep:
        raise AddressError(
            f"controller address {address!r} has a scheme ({scheme}://), which slicewise "
            f"does not take; {_ADDRESS_FORM} (here {rest.rstrip('/')!r})"
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise AddressError(f"controller address {address!r} has no port; {_ADDRESS_FORM}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise AddressError(
            f"controller address {address!r}: {port!r} is not a port (1-65535); {_ADDRESS_FORM}"
        )
    return host.removeprefix("[").removesuffix("]"), int(port)


def _refused(host: str, port: int, timeout_s: float) -> bool:
    """Whether the host refuses a connection to the port (nothing listens there). Other
    failures (no answer yet, no route) are left to the gRPC channel's wait.

    Raises:
        ConnectionError: the host name does not resolve.
    """
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except socket.gaierror as exc:
        raise ConnectionError(f"cannot resolve the controller's host {host!r}: {exc}") from None
    except OSError:
        return False


def connect(address: str, **options: Any) -> Client:
    """Connects to a controller at `host:port` and checks that it answers; `options` are
    `Client`'s (name, timeout, token, TLS files, direct_data)."""
    return Client(address, **options)


class Client:
    """A connection to one controller.

    `token` is the tenant's bearer token (default: $SLICEWISE_TOKEN; none for a controller
    started with --insecure-local). For a controller serving TLS, `tls_ca` is the CA bundle
    that signed its certificate, and for mutual TLS `tls_cert`/`tls_key` this client's own
    (PEM files; defaults: $SLICEWISE_TLS_CA, $SLICEWISE_TLS_CERT, $SLICEWISE_TLS_KEY).
    `direct_data`: put and fetch large arrays straight to and from the hosts (default:
    unless $SLICEWISE_DIRECT_DATA is 0); False sends every byte through the controller.
    """

    def __init__(
        self,
        address: str,
        *,
        name: str = "",
        timeout: float = 30.0,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        direct_data: bool | None = None,
    ) -> None:
        host, port = parse_address(address)
        self.address = address
        self.name = name
        if direct_data is None:
            direct_data = os.environ.get(DIRECT_ENV, "1").strip() != "0"
        self.direct_data = direct_data
        # Retry a lost connection every few seconds at most (gRPC's default backoff grows
        # to two minutes), so that a client notices a restarted controller soon.
        options = [("grpc.max_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS)]
        credentials = _tls_credentials(tls_ca, tls_cert, tls_key)
        if credentials is None:
            raw = grpc.insecure_channel(address, options=options)
        else:
            raw = grpc.secure_channel(address, credentials, options=options)
        self.closed = False
        start_one = (
            "start one with `slicewise controller --sim 2xv5litepod-4 --insecure-local "
            f"--port {port}`"
        )
        ready = grpc.channel_ready_future(raw)
        try:
            if _refused(host, port, min(_PROBE_S, timeout)):
                raise ConnectionError(
                    f"connection refused at {address}: no slicewise controller listens "
                    f"there; {start_one}"
                )
            try:
                ready.result(timeout=min(_PROBE_S, timeout))
            except grpc.FutureTimeoutError:
                if timeout <= _PROBE_S:
                    raise
                log.warning(
                    "waiting for the slicewise controller at %s to answer (up to %.0f s)",
                    address,
                    timeout,
                )
                ready.result(timeout=timeout - _PROBE_S)
        except grpc.FutureTimeoutError:
            raw.close()
            raise ConnectionError(
                f"no slicewise controller answers at {address} after {timeout:.0f} s; "
                + start_one
                + ("" if credentials is None else " (or the TLS handshake failed)")
            ) from None
        except BaseException:
            ready.cancel()
            raw.close()
            raise
        self._channel = raw
        token = token or os.environ.get(auth.TOKEN_ENV) or None
        channel = grpc.intercept_channel(raw, _Bearer(token)) if token else raw
        self.stub = pb_grpc.ControllerStub(channel)
        self._streams: weakref.WeakSet[CallStream] = weakref.WeakSet()

    def health(self) -> pb.HealthResponse:
        return _call(self.stub.Health, pb.HealthRequest(), timeout=30)

    def cluster_info(self) -> pb.ClusterInfo:
        return _call(self.stub.GetClusterInfo, pb.ClusterInfoRequest(), timeout=30)

    def trace(self, id: str) -> dict[str, Any]:
        """The Chrome / Perfetto trace JSON of a gang or job (see `slicewise trace`)."""
        import json

        try:
            data = b"".join(
                c.data for c in self.stub.GetTrace(pb.GetTraceRequest(id=id), timeout=120)
            )
        except grpc.RpcError as err:
            _raise_from(err)
        return json.loads(data)

    # -- training jobs ------------------------------------------------------------------

    def submit_job(
        self,
        program: str,
        *,
        steps: int,
        slices: int = 0,
        slice_type: str = "",
        overrides: Mapping[str, str] | None = None,
        dcn: Mapping[str, int] | None = None,
        ici: Mapping[str, int] | None = None,
        gang: Gang | None = None,
        checkpoint_every: int | None = None,
        checkpoint_dir: str = "",
        keep_checkpoints: int | None = None,
        keep_steps: Sequence[int] = (),
        max_failures: int | None = None,
        elastic_min_slices: int | None = None,
        peer_recovery: bool | None = None,
        max_preemptions: int | None = None,
    ) -> pb.JobInfo:
        """Submits a training job of an installed program; returns at once (it queues).
        It runs on `slices` slices of `slice_type` allocated for it, or on `gang`, one
        this client holds (which stays held when the job ends).

        It saves a checkpoint after every `checkpoint_every` steps (None: the
        controller's default, 50; 0: never) and after the last, into `checkpoint_dir`
        ("": a directory of its own under the controller's state directory). A job
        whose directory already holds committed steps resumes after the newest. It keeps
        the newest `keep_checkpoints` committed steps (None: the controller's default,
        3; 0: all) and the steps in `keep_steps` (more: `keep_checkpoint`). When a
        worker or host of its gang is lost it recovers by itself (a new gang, the newest
        committed step restored), up to `max_failures` times (None: 3); preempted, it
        yields and resumes, up to `max_preemptions` times (None: no limit). An elastic job
        (`elastic_min_slices`) that loses a slice with no spare free continues on as few
        as that many slices, with the same global batch, and grows back to `slices` at a
        checkpoint once slices are free again. A lost slice is recovered from a
        surviving slice's replica, from the very step reached, whenever every slice
        holds a whole replica (data parallelism over slices) and the job is not elastic,
        at the cost of device memory for the in-flight steps' input states;
        `peer_recovery` True asks for it (an error where it cannot be), False turns it
        off (None: the default)."""
        request = pb.SubmitJobRequest(
            program=program,
            num_slices=slices,
            slice_type=slice_type,
            steps=steps,
            overrides={k: str(v) for k, v in (overrides or {}).items()},
            client=self.name,
            gang_id=gang.id if gang is not None else "",
            checkpoint_every=checkpoint_every,
            checkpoint_dir=(
                checkpoint_dir
                if not checkpoint_dir or "://" in checkpoint_dir
                else os.path.abspath(checkpoint_dir)
            ),
            keep_checkpoints=keep_checkpoints,
            keep_steps=list(keep_steps),
            max_failures=max_failures,
            elastic_min_slices=elastic_min_slices,
            peer_recovery=peer_recovery,
            max_preemptions=max_preemptions,
        )
        if dcn or ici:
            request.mesh.CopyFrom(wire.mesh_to_pb(MeshSpec.build(dcn, ici)))
        if gang is not None:
            gang.flush_deletes()  # the job gets the memory of arrays the client dropped
        return _call(self.stub.SubmitJob, request, timeout=60)

    def keep_checkpoint(self, job_id: str, step: int) -> pb.JobInfo:
        """Keeps checkpoint `step` of the job (a committed step it still holds, or one it
        will save) beyond its newest `keep_checkpoints`."""
        request = pb.KeepCheckpointRequest(job_id=job_id, step=step)
        return _call(self.stub.KeepCheckpoint, request, timeout=60)

    def inject_fault(
        self, job_id: str, kind: str, *, at_step: int | None = None, process: int | None = None
    ) -> str:
        """Fault injection into a running job (`slicewise chaos`): `kind` is kill-worker,
        remove-host, hang-collective or kill-controller; on host `process` (None: one at
        random), once the job has completed `at_step` steps (None: now). Needs a controller
        started with --allow-chaos. Returns what will happen, in words."""
        request = pb.InjectFaultRequest(job_id=job_id, kind=kind)
        if at_step is not None:
            request.at_step = at_step
        if process is not None:
            request.process = process
        return _call(self.stub.InjectFault, request, timeout=60).message

    def job(self, job_id: str) -> pb.JobInfo:
        return _call(self.stub.GetJob, pb.GetJobRequest(job_id=job_id), timeout=30)

    def jobs(self) -> list[pb.JobInfo]:
        return list(_call(self.stub.ListJobs, pb.ListJobsRequest(), timeout=30).jobs)

    def cancel_job(self, job_id: str) -> pb.JobInfo:
        return _call(self.stub.CancelJob, pb.CancelJobRequest(job_id=job_id), timeout=30)

    def job_metrics(self, job_id: str) -> pb.JobMetrics:
        return _call(self.stub.GetJobMetrics, pb.GetJobRequest(job_id=job_id), timeout=60)

    def job_logs(self, job_id: str, *, follow: bool = False, tail: int = 0) -> Iterator[pb.LogLine]:
        """The job's log (`slicewise logs`): the controller's newest `tail` lines about
        it (0: 200), then the newest `tail` lines of the stderr of each worker of the gang
        it runs on now; with `follow`, then the controller's lines as they come, until
        the job ends. Each line names its `source`: "controller" or a host."""
        request = pb.JobLogsRequest(job_id=job_id, follow=follow, tail=tail)
        try:
            yield from self.stub.JobLogs(request)
        except grpc.RpcError as err:
            _raise_from(err)

    def watch_job(self, job_id: str, *, reconnect_timeout: float = 0.0) -> Iterator[pb.JobEvent]:
        """The job's snapshot, then its steps and state changes until it ends.

        With `reconnect_timeout` > 0, a stream lost with the controller (it stopped or
        died, and is restarted on the same state directory and address) is re-opened
        for up to that many seconds: an event whose message says so marks the gap, and
        steps already delivered are not delivered again (a job that resumes from an
        earlier checkpoint runs some again; their metrics come once they pass the last
        step delivered).

        Raises:
            WorkerError: the controller did not come back within `reconnect_timeout`.
        """
        request = pb.WatchJobRequest(job_id=job_id)
        delivered = -1  # the newest step delivered
        job: pb.JobInfo | None = None
        while True:
            try:
                for event in self.stub.WatchJob(request):
                    fresh = [s for s in event.steps if s.step > delivered]
                    if len(fresh) != len(event.steps):
                        del event.steps[:]
                        event.steps.extend(fresh)
                    if fresh:
                        delivered = fresh[-1].step
                    job = event.job
                    yield event
                return
            except grpc.RpcError as err:
                code = err.code()
                if self.closed and code is grpc.StatusCode.CANCELLED:
                    return
                lost = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                if reconnect_timeout <= 0 or not lost:
                    _raise_from(err)
                yield pb.JobEvent(
                    job=job or pb.JobInfo(job_id=job_id),
                    message=f"lost the controller ({err.details() or code.name}); "
                    f"re-attaching for up to {reconnect_timeout:.0f} s",
                )
                self._wait_for_controller(reconnect_timeout)

    def _wait_for_controller(self, timeout_s: float) -> None:
        """Returns once the controller answers again.

        Raises:
            WorkerError: it did not within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(
                    f"the controller at {self.address} did not come back within "
                    f"{timeout_s:.0f} s; start it again with the same --state-dir, then "
                    "`slicewise watch JOB`"
                )
            try:
                self.stub.Health(pb.HealthRequest(), timeout=min(left, 5.0), wait_for_ready=True)
                return
            except grpc.RpcError as err:
                if err.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    _raise_from(err)

    def allocate(
        self,
        slices: int,
        slice_type: str,
        *,
        timeout: float = 600.0,
        priority: int = 0,
        max_wait: float | None = None,
        alternatives: Sequence[str] = (),
        mixed_types: bool = False,
        shared: str = "",
        weight: float = 1.0,
    ) -> Gang:
        """Blocks until a gang of `slices` whole slices is admitted and its workers are up.

        `priority`: higher goes first and may preempt lower-priority gangs. `max_wait`:
        give up (DeadlineError, with the reason) after queueing this long. `alternatives`:
        other acceptable slice types, in order. `shared`: attach to (or create) the gang
        of that name, sharing it with other clients in proportion to `weight`.
        """
        request = pb.AllocateGangRequest(
            num_slices=slices,
            slice_type=slice_type,
            timeout_s=timeout,
            client=self.name,
            priority=priority,
            max_wait_s=max_wait or 0.0,
            alternatives=list(alternatives),
            mixed_types=mixed_types,
            shared=shared,
            weight=weight,
        )
        # The controller applies `timeout` to admission; starting the workers comes on top.
        info = _call(self.stub.AllocateGang, request, timeout=timeout + 300)
        return Gang(self, info)

    def close(self) -> None:
        for stream in list(self._streams):  # what they queued goes out first
            stream.close()
        self.closed = True
        self._channel.close()

    def _stream(self, responses: Iterator[Any]) -> Iterator[Any]:
        """A server stream's messages; it ends quietly when this client is closed (a
        watcher thread may outlive the `with` block)."""
        try:
            yield from responses
        except grpc.RpcError as err:
            if self.closed and err.code() is grpc.StatusCode.CANCELLED:
                return
            _raise_from(err)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Mesh:
    """A mesh over a gang's devices: DCN axes span slices, ICI axes stay inside one."""

    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec
        self.abstract = spec.abstract()

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.spec.names, self.spec.shape, strict=True))

    def sharding(self, *partition: Any) -> Any:
        """A `NamedSharding` on this mesh; arguments as for `PartitionSpec`."""
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.abstract, PartitionSpec(*partition))

    def __repr__(self) -> str:
        return f"Mesh{self.spec.describe()}"


class Gang:
    """Slices held by this client; released by `release()` or on leaving a `with` block."""

    def __init__(self, client: Client, info: pb.GangInfo) -> None:
        self.client = client
        self.id = info.gang_id
        self.slice_type = info.slice_type
        self.num_slices = info.num_slices
        self.hosts_per_slice = info.hosts_per_slice
        self.chips_per_host = info.chips_per_host
        self.platform = info.platform
        self.slices = list(info.slices)
        self.released = False
        self._meshes: list[Mesh] = []
        self._drops = DropQueue()
        self._stream: CallStream | None = None
        # Whether transfers go straight to the hosts: until one is found unreachable.
        self.direct_data = client.direct_data

    @property
    def chips_per_slice(self) -> int:
        return self.hosts_per_slice * self.chips_per_host

    @property
    def num_devices(self) -> int:
        return self.num_slices * self.chips_per_slice

    def __repr__(self) -> str:
        return (
            f"Gang({self.id}: {self.num_slices} x {self.slice_type}, "
            f"{self.num_devices} devices on {self.platform})"
        )

    # -- meshes ---------------------------------------------------------------------

    def mesh(
        self, dcn: Mapping[str, int] | None = None, ici: Mapping[str, int] | None = None
    ) -> Mesh:
        """A mesh over this gang. By default one DCN axis `slice` and one ICI axis `chip`.

        An axis named in both `dcn` and `ici` spans slices and chips (DCN-major).
        """
        if dcn is None and ici is None:
            dcn, ici = {"slice": self.num_slices}, {"chip": self.chips_per_slice}
        mesh = Mesh(MeshSpec.build(dcn, ici))
        self._check(mesh.spec)
        self._meshes.append(mesh)
        return mesh

    def _check(self, spec: MeshSpec) -> None:
        from slicewise.common.mesh import GangShape

        spec.check_fits(GangShape(self.num_slices, self.hosts_per_slice, self.chips_per_host))

    def _mesh_of(self, abstract: Any) -> Mesh:
        for mesh in reversed(self._meshes):
            if mesh.abstract.axis_names == abstract.axis_names and tuple(
                mesh.abstract.axis_sizes
            ) == tuple(abstract.axis_sizes):
                return mesh
        raise InvalidRequestError(
            f"{abstract} is not a mesh of gang {self.id}; build meshes with gang.mesh(...)"
        )

    def _sharding_spec(self, sharding: Any, ndim: int) -> ShardingSpec:
        if sharding is None:
            mesh = self._meshes[-1] if self._meshes else self.mesh()
            return ShardingSpec(mesh.spec, ())
        if isinstance(sharding, ShardingSpec):
            self._check(sharding.mesh)
            return sharding
        mesh = self._mesh_of(sharding.mesh)
        return ShardingSpec.from_partition_spec(mesh.spec, tuple(sharding.spec))

    # -- the call stream ----------------------------------------------------------

    def calls(self) -> CallStream:
        """This gang's call stream, opened on first use. A stream that broke (the
        controller went away, say) raises why once; the next call opens a new one."""
        stream = self._stream
        if stream is not None and stream.broken:
            self._stream = None
            raise stream.error  # type: ignore[misc]
        if stream is None:
            if self.released or self.client.closed:
                raise _local(
                    FailedPreconditionError(
                        f"gang {self.id} was released; allocate a new gang to run more work"
                        if self.released
                        else "the client is closed"
                    )
                )
            stream = self._stream = CallStream(self)
            self.client._streams.add(stream)
        return stream

    def _confirmed(self, arrays: Sequence[RemoteArray], timeout: float = 600.0) -> None:
        """Returns once the calls that make these arrays have reached the controller
        (a round trip, however short `timeout`: a wait's timeout is for the computation);
        raises the error of any of those calls that was refused."""
        stream = self._stream
        mine = [a for a in arrays if a._stream is stream]
        batch = max((a._batch for a in mine), default=0)
        if stream is None or batch == 0:
            return
        stream.check([a.handle for a in arrays])
        stream.sync(batch, max(timeout, CONFIRM_TIMEOUT_S))
        stream.check([a.handle for a in arrays])

    def _after(self, arrays: Sequence[RemoteArray]) -> int:
        """The call-stream batch a wait or fetch of these arrays comes after (the
        controller waits for it; 0: none to wait for); raises the error of a call making
        one of them that is known to have been refused."""
        for a in arrays:  # a refusal known already, on whichever stream it came
            if a._stream is not None:
                a._stream.check([a.handle])
        stream = self._stream
        if stream is None:
            return 0
        batch = max((a._batch for a in arrays if a._stream is stream), default=0)
        return batch if batch > stream.accepted else 0

    def _refusal(self, array: RemoteArray, err: grpc.RpcError | None) -> None:
        """For an array that came back failed, unknown or gone (`err`: the answer, None
        for a failed state): if its call was refused, raises that refusal (with the
        status it was refused with) once it has arrived, rather than what the array's
        absence says."""
        if err is not None and err.code() not in _ABSENT:
            return
        stream = array._stream
        if stream is not None and array._batch:
            with contextlib.suppress(SlicewiseError):
                stream.sync(array._batch, CONFIRM_TIMEOUT_S)
            stream.check([array.handle])

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    # -- arrays ---------------------------------------------------------------------

    def put(self, array: Any, sharding: Any = None) -> RemoteArray:
        """Uploads `array`, split as `sharding` says (replicated when None)."""
        array = np.require(array, requirements="C")  # keeps 0-d arrays 0-d
        spec = ArraySpec.of(array.shape, array.dtype)
        sharding_spec = self._sharding_spec(sharding, array.ndim)
        self._flush_due()
        if self._goes_direct(spec.nbytes):
            info = self._put_direct(array, spec, sharding_spec)
            if info is not None:
                return RemoteArray.from_pb(self, info, sharding_spec)
        data = memoryview(array.reshape(-1).view(np.uint8))

        def messages() -> Iterator[pb.PutChunk]:
            yield pb.PutChunk(
                header=pb.PutHeader(
                    gang_id=self.id,
                    spec=wire.spec_to_pb(spec),
                    sharding=wire.sharding_to_pb(sharding_spec),
                )
            )
            for piece in wire.chunks(data):
                yield pb.PutChunk(data=bytes(piece))

        info = _call(self.client.stub.PutArray, messages())
        return RemoteArray.from_pb(self, info, sharding_spec)

    def _goes_direct(self, nbytes: int) -> bool:
        return self.direct_data and nbytes >= DIRECT_MIN_BYTES

    def _put_direct(
        self, array: np.ndarray, spec: ArraySpec, sharding: ShardingSpec
    ) -> pb.ArrayInfo | None:
        """Puts the array straight to the hosts; None if they cannot be reached from
        here (the caller then puts it through the controller)."""
        request = pb.BeginDirectPutRequest(
            gang_id=self.id, spec=wire.spec_to_pb(spec), sharding=wire.sharding_to_pb(sharding)
        )
        transfer = _call(self.client.stub.BeginDirectPut, request, timeout=60)
        hosts = [
            direct.HostPart(
                h.data_address,
                h.capability,
                tuple(tuple(slice(r.start, r.stop) for r in p.ranges) for p in h.pieces),
            )
            for h in transfer.hosts
        ]
        if not self._direct_transfer(transfer, direct.put, transfer.transfer_id, array, hosts):
            return None
        finish = pb.FinishDirectPutRequest(transfer_id=transfer.transfer_id)
        return _call(self.client.stub.FinishDirectPut, finish, timeout=60)

    def _direct_transfer(self, transfer: pb.DirectTransfer, move: Any, *args: Any) -> bool:
        """Runs `move(*args)` for a direct transfer; False (abandoning the transfer) when
        a host cannot be reached from here: this gang's transfers go through the
        controller from now on.

        Raises:
            WorkerError: a host refused, or a connection broke mid-way.
        """
        try:
            move(*args)
            return True
        except direct.UnreachableError as exc:
            self._abandon(transfer)
            if self.direct_data:
                self.direct_data = False
                log.warning(
                    "gang %s: %s; its puts and fetches go through the controller instead",
                    self.id,
                    exc,
                )
            return False
        except TransportError as exc:
            self._abandon(transfer)
            raise WorkerError(
                f"direct transfer {transfer.transfer_id} on gang {self.id} failed: {exc}"
            ) from None

    def _abandon(self, transfer: pb.DirectTransfer) -> None:
        """Has the controller drop what a transfer left on the hosts now (it would at
        the transfer's expiry anyway, so a failure here changes nothing)."""
        request = pb.AbandonDirectTransferRequest(transfer_id=transfer.transfer_id)
        with contextlib.suppress(grpc.RpcError):
            self.client.stub.AbandonDirectTransfer(request, timeout=30)

    # -- programs -------------------------------------------------------------------

    def compile(self, fn: Any, *args: Any, name: str = "", mesh: Mesh | None = None) -> Program:
        """Exports `fn` (a `jax.jit` function) for this gang and registers it.

        `args` describe the inputs: RemoteArrays, `jax.ShapeDtypeStruct`s with a sharding
        on one of this gang's meshes, or numpy arrays (replicated). No devices are used:
        the export runs against the mesh's `AbstractMesh`.
        """
        import jax
        from jax import export
        from jax.sharding import NamedSharding, PartitionSpec

        is_remote = lambda x: isinstance(x, RemoteArray)  # noqa: E731
        meshes: list[MeshSpec] = []
        for a in jax.tree.leaves(args, is_leaf=is_remote):
            if isinstance(a, RemoteArray) and a.sharding is not None:
                meshes.append(a.sharding.mesh)
            elif isinstance(a, jax.ShapeDtypeStruct) and a.sharding is not None:
                meshes.append(self._mesh_of(a.sharding.mesh).spec)
        chosen = (
            mesh.spec
            if mesh is not None
            else (meshes[0] if meshes else (self._meshes[-1] if self._meshes else self.mesh()).spec)
        )
        if any(m != chosen for m in meshes):
            raise InvalidRequestError("all inputs of one program must use the same mesh")
        replicated = NamedSharding(chosen.abstract(), PartitionSpec())

        def describe(a: Any) -> Any:
            if isinstance(a, RemoteArray):
                return a.shape_dtype_struct()
            if isinstance(a, jax.ShapeDtypeStruct):
                return a
            arr = np.asarray(a)  # an example value: replicated over the gang
            return jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=replicated)

        specs = jax.tree.map(describe, args, is_leaf=is_remote)
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        exported = export.export(jitted, platforms=[self.platform])(*specs)
        return self.load(exported, Mesh(chosen), name=name or getattr(fn, "__name__", ""))

    def load(self, exported: Any, mesh: Mesh, *, name: str = "") -> Program:
        """Registers an already exported program (a `jax.export.Exported` or its bytes)."""
        serialized = exported if isinstance(exported, bytes | bytearray) else exported.serialize()
        serialized = bytes(serialized)

        def messages() -> Iterator[pb.ProgramChunk]:
            yield pb.ProgramChunk(
                header=pb.ProgramHeader(
                    gang_id=self.id,
                    name=name,
                    mesh=wire.mesh_to_pb(mesh.spec),
                    total_bytes=len(serialized),
                )
            )
            for piece in wire.chunks(memoryview(serialized)):
                yield pb.ProgramChunk(data=bytes(piece))

        info = _call(self.client.stub.RegisterProgram, messages())
        in_shardings = None if isinstance(exported, bytes | bytearray) else exported
        return Program(self, info, mesh, in_shardings)

    def execute_batch(self, calls: Sequence[tuple[Program, Sequence[Any]]]) -> list[Any]:
        """Queues several calls in one request; an argument `Output(k, i)` is output `i` of
        call `k` of the same batch. All calls are queued, or none. Returns each call's
        outputs (a RemoteArray, or a tuple of them)."""
        specs = []
        # Uploaded arguments stay referenced until the calls are queued, so that no delete
        # of theirs can be sent before the calls that read them.
        uploaded = []
        for program, args in calls:
            handles = []
            for i, a in enumerate(args):
                if isinstance(a, Output):
                    handles.append(f"@{a.call}:{a.index}")
                else:
                    uploaded.append(program._as_remote(i, a))
                    handles.append(uploaded[-1].handle)
            specs.append(pb.CallSpec(program_id=program.id, inputs=handles))
        self._confirmed(
            uploaded + [a for _, args in calls for a in args if isinstance(a, RemoteArray)]
        )
        self._flush_due()
        reply = _call(
            self.client.stub.ExecuteBatch,
            pb.ExecuteBatchRequest(gang_id=self.id, calls=specs),
            timeout=120,
        )
        results = []
        for (program, _), result in zip(calls, reply.results, strict=True):
            outs = [
                RemoteArray.from_pb(self, info, sharding)
                for info, sharding in zip(result.outputs, program._out_sharding_specs, strict=True)
            ]
            results.append(outs[0] if len(outs) == 1 else tuple(outs))
        return results

    def flush_deletes(self) -> int:
        """Sends the deletes of the arrays this client dropped (see RemoteArray) and not
        yet deleted, in batches of `DELETE_BATCH`; returns how many it sent. The workers
        free them once the calls queued before that read them have run. Nothing is sent
        for a released gang or by a closed client.

        Raises:
            SlicewiseError: a DeleteArrays call failed (the arrays still queued stay so).
        """
        if self.released or self.client.closed:
            self._drops.forget()
            return 0
        sent = 0
        if self._stream is not None:  # after the calls that read them, in the same stream
            while batch := self._drops.take(self._drops.batch_size):
                self._stream.delete(batch)
                sent += len(batch)
            if sent:
                self._stream.sync()
            return sent
        while batch := self._drops.take(self._drops.batch_size):
            try:
                _call(
                    self.client.stub.DeleteArrays,
                    pb.DeleteArraysRequest(handles=batch),
                    timeout=60,
                )
            except NotFoundError:
                # The controller deletes all of a request or none; one of these is gone
                # already (deleted by its handle, or its gang stopped): one at a time.
                for handle in batch:
                    with contextlib.suppress(NotFoundError):
                        _call(
                            self.client.stub.DeleteArrays,
                            pb.DeleteArraysRequest(handles=[handle]),
                            timeout=60,
                        )
            sent += len(batch)
        return sent

    def _flush_due(self) -> None:
        if not self._drops.due():
            return
        if self._stream is None:
            self.flush_deletes()
            return
        while batch := self._drops.take(self._drops.batch_size):  # no need to wait for them
            self._stream.delete(batch)

    def stats(self) -> pb.GangStats:
        """Dispatch counters and, per worker, arrays held and executor window use. Dropped
        arrays count until their deletes are sent (`flush_deletes`) and have run: stats
        sends none itself, so that two readings differ only by what the caller did."""
        return _call(
            self.client.stub.GetGangStats, pb.GangStatsRequest(gang_id=self.id), timeout=60
        )

    # -- lifetime -------------------------------------------------------------------

    def release(self, *, requeue: bool = False) -> None:
        """Frees the slices (or, for a shared gang, detaches this client), and with them
        every array: dropped arrays need no deletes. With `requeue`, for a gang being
        preempted: give the slices up now but stay queued to resume."""
        if not self.released:
            self._close_stream()
            _call(
                self.client.stub.ReleaseGang,
                pb.ReleaseGangRequest(gang_id=self.id, requeue=requeue),
                timeout=120,
            )
            self.released = not requeue
            self._drops.forget()

    def events(self) -> Iterator[pb.GangEvent]:
        """What happens to the gang: "preempt" (with `grace_s` to save state and release),
        "preempted", "resumed", "failed", "released". Blocks between events."""
        yield from self.client._stream(
            self.client.stub.WatchGang(pb.WatchGangRequest(gang_id=self.id))
        )

    def __enter__(self) -> Gang:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_CODES = {code.value[0]: code for code in grpc.StatusCode}
# What a wait or fetch of an output of a refused call may answer.
_ABSENT = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)

# A client holds at most this many calls queued and not yet sent before a call waits.
MAX_QUEUED_CALLS = 10_000
# The most calls one `Program.chain` may make (the controller's limit on a call's runs).
MAX_CHAIN = 1_000_000
# The longest a wait or fetch waits for the controller to confirm the calls before it.
CONFIRM_TIMEOUT_S = 60.0


class CallStream:
    """This client's call stream on one gang (the `Calls` RPC): calls go out without
    waiting for an answer, those issued while the previous message was on its way
    together in the next one; the client names each call's outputs itself.

    Handles are "<gang>/c<tag>.<n>" with a random tag per stream. What comes back is only
    a failure of a call (kept by output handle, and raised by a later call reading one
    of those outputs, a wait or a fetch) and, when the client asks (`sync`), which batch
    the controller has queued up to: a wait, fetch or delete of an output first makes
    sure the call that makes it has reached the controller.
    """

    def __init__(self, gang: Gang) -> None:
        self.gang = gang
        tag = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz234567") for _ in range(12))
        self._prefix = f"{gang.id.partition('@')[0]}/c{tag}."
        self._names = itertools.count(1)
        self._cond = threading.Condition()
        self._calls: list[pb.StreamCall] = []
        self._deletes: list[str] = []
        self._sync = False
        self._closing = False
        self._ended = False
        self.sent = 0  # batches handed to gRPC
        self.accepted = 0  # the controller queued every batch up to this one
        self.calls = 0  # calls made on the stream
        self.error: SlicewiseError | None = None  # why the stream ended, if not closed
        self.failures: dict[str, SlicewiseError] = {}  # output handle -> its call's error
        self._responses = gang.client.stub.Calls(self._requests())
        self._reader = threading.Thread(target=self._read, name=f"calls-{gang.id}", daemon=True)
        self._reader.start()

    def call(
        self, program_id: str, inputs: Sequence[str], outputs: int, repeat: int = 1
    ) -> tuple[list[str], int]:
        """Queues a call (with `repeat` > 1, a chain: that many runs, each on the
        previous one's outputs, of which only the last one's are kept); returns the
        handles of its outputs and its batch's number."""
        with self._cond:
            self._check_open()
            while len(self._calls) >= MAX_QUEUED_CALLS and not self._ended:
                self._cond.wait(1.0)
            names = [f"{self._prefix}{next(self._names)}" for _ in range(outputs)]
            self._calls.append(
                pb.StreamCall(program_id=program_id, inputs=inputs, outputs=names, repeat=repeat)
            )
            self.calls += 1
            self._cond.notify_all()
            return names, self.sent + 1

    def delete(self, handles: Sequence[str]) -> int:
        """Queues deletes, to go out after the calls queued before them."""
        with self._cond:
            self._check_open()
            self._deletes.extend(handles)
            batch = self.sent + 1
            self._cond.notify_all()
        return batch

    def sync(self, batch: int | None = None, timeout: float = 600.0) -> None:
        """Returns once the controller has queued batch `batch` (default: everything
        queued so far).

        Raises:
            SlicewiseError: the stream ended before (why it ended).
            DeadlineError: not within `timeout`.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            if batch is None:
                batch = self.sent + (1 if self._calls or self._deletes else 0)
            while self.accepted < batch:
                self._check_open()
                self._sync = True
                self._cond.notify_all()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineError(
                        f"the controller did not confirm the calls on gang {self.gang.id} "
                        f"within {timeout:.0f} s"
                    )
                self._cond.wait(left)

    def check(self, handles: Sequence[str]) -> None:
        """Raises the error of the call that made any of these outputs, if it failed."""
        if self.failures:
            for h in handles:
                failure = self.failures.get(h)
                if failure is not None:
                    raise failure

    def close(self, timeout: float = 10.0) -> None:
        """Ends the stream once what is queued has gone out."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._reader.join(timeout)
        if self._reader.is_alive():
            self._responses.cancel()
            self._reader.join(timeout)

    @property
    def broken(self) -> bool:
        """Whether the stream ended other than by `close` (see `error`)."""
        return self._ended and not self._closing and self.error is not None

    def _check_open(self) -> None:
        if self._ended or self._closing:
            raise self.error or FailedPreconditionError(
                f"the call stream on gang {self.gang.id} is closed"
            )

    def _requests(self) -> Iterator[pb.CallBatch]:
        """The request stream, on gRPC's thread: whatever is queued, as one batch."""
        while True:
            with self._cond:
                while not (self._calls or self._deletes or self._sync or self._closing):
                    self._cond.wait()
                if not (self._calls or self._deletes or self._sync):
                    return  # closing, and everything went out
                self.sent += 1
                batch = pb.CallBatch(
                    gang_id=self.gang.id if self.sent == 1 else "",
                    stream=self._prefix[:-1] if self.sent == 1 else "",
                    batch=self.sent,
                    calls=self._calls,
                    deletes=self._deletes,
                    sync=self._sync,
                )
                self._calls, self._deletes, self._sync = [], [], False
                self._cond.notify_all()  # a caller waiting for room
            yield batch

    def _read(self) -> None:
        """The reader thread: failures and confirmations, until the stream ends."""
        try:
            for event in self._responses:
                if event.HasField("failure"):
                    f = event.failure
                    code = _CODES.get(f.code, grpc.StatusCode.UNKNOWN)
                    error = _ERRORS.get(code, SlicewiseError)(
                        f"call {f.call} on gang {self.gang.id} (program {f.program_id}) was "
                        f"refused: {f.message}"
                    )
                    error.code = code  # type: ignore[attr-defined]
                    with self._cond:
                        for h in f.outputs:
                            self.failures[h] = error
                if event.accepted:
                    with self._cond:
                        self.accepted = max(self.accepted, event.accepted)
                        self._cond.notify_all()
        except grpc.RpcError as err:
            if not (self._closing or self.gang.client.closed):
                code = err.code()
                error = _ERRORS.get(code, SlicewiseError)(err.details() or str(code))
                error.code = code  # type: ignore[attr-defined]
                self.error = error
        finally:
            with self._cond:
                self._ended = True
                if self.error is None and not self._closing:
                    self.error = WorkerError(f"the call stream on gang {self.gang.id} ended")
                self._cond.notify_all()


class Output(NamedTuple):
    """In `Gang.execute_batch`: output `index` of call `call` of the same batch."""

    call: int
    # Shadows tuple.index on purpose: `Output(call, index)` is the public spelling.
    index: int = 0  # type: ignore[assignment]


class Program:
    """A registered program; calling it queues a run and returns RemoteArrays at once."""

    def __init__(self, gang: Gang, info: pb.ProgramInfo, mesh: Mesh, exported: Any) -> None:
        self.gang = gang
        self.id = info.program_id
        self.name = info.name
        self.mesh = mesh
        self.inputs = [wire.spec_from_pb(s) for s in info.inputs]
        self.outputs = [wire.spec_from_pb(s) for s in info.outputs]
        self.exported = exported
        self._out_sharding_specs = self._out_shardings()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Queues a call; arguments (pytrees of RemoteArrays or numpy arrays) as exported."""
        import jax

        if not kwargs and all(type(a) is RemoteArray for a in args):
            leaves: list[Any] = list(args)  # the usual call, flat already: no tree to walk
        else:
            leaves = jax.tree.leaves((args, kwargs), is_leaf=lambda x: isinstance(x, RemoteArray))
        # Referenced until the call is queued: no delete of an uploaded argument goes first.
        inputs = [self._as_remote(i, a) for i, a in enumerate(leaves)]
        self._check_call(inputs)
        handles = [a.handle for a in inputs]
        stream = self.gang.calls()
        stream.check(handles)  # an input whose call was refused: its error, now
        self.gang._flush_due()
        names, batch = stream.call(self.id, handles, len(self.outputs))
        outs = self._outputs(names, batch)
        if self.exported is not None:
            return jax.tree.unflatten(self.exported.out_tree, outs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def chain(self, n: int, *args: Any) -> Any:
        """Queues `n` calls, each fed the previous call's outputs (the first gets
        `args`), as one call of `n` runs on the gang's call stream: the workers launch
        them back to back, with no message per call, and keep only the last call's
        outputs, which this returns. Outputs must match inputs; at most 1,000,000 runs.
        An error names the run that failed."""
        if len(self.outputs) != len(self.inputs) or self.outputs != self.inputs:
            raise InvalidRequestError(
                f"chain needs a program whose outputs match its inputs; {self!r} does not"
            )
        if not 1 <= n <= MAX_CHAIN:
            raise InvalidRequestError(
                f"chain needs 1 to {MAX_CHAIN:,} calls, not {n:,}; split a longer chain"
            )
        inputs = [self._as_remote(i, a) for i, a in enumerate(args)]
        self._check_call(inputs)
        stream = self.gang.calls()
        stream.check([a.handle for a in inputs])
        self.gang._flush_due()
        names, batch = stream.call(self.id, [a.handle for a in inputs], len(self.outputs), repeat=n)
        outs = self._outputs(names, batch)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _check_call(self, inputs: Sequence[RemoteArray]) -> None:
        """The mistakes this client can see itself, raised as the controller would (the
        others come back on the call's outputs): the number, shapes and dtypes of the
        inputs, and inputs deleted or on another gang."""
        if len(inputs) != len(self.inputs):
            raise _local(
                ProgramMismatchError(
                    f"program {self.name!r} takes {len(self.inputs)} input(s) "
                    f"({', '.join(map(str, self.inputs))}) but was called with {len(inputs)}"
                )
            )
        for i, (want, a) in enumerate(zip(self.inputs, inputs, strict=True)):
            if a._lease.deleted:
                raise _local(NotFoundError(f"array {a.handle} was deleted"))
            if a.gang.id.partition("@")[0] != self.gang.id.partition("@")[0]:
                raise _local(
                    FailedPreconditionError(
                        f"array {a.handle} lives on gang {a.gang.id}, not on gang "
                        f"{self.gang.id}; fetch it and put it on this gang"
                    )
                )
            if a.spec != want:
                raise _local(
                    ProgramMismatchError(
                        f"input {i} of program {self.name!r}: expected {want}, got {a.spec} "
                        f"(array {a.handle})"
                    )
                )

    def _outputs(self, names: Sequence[str], batch: int) -> list[RemoteArray]:
        return [
            RemoteArray(self.gang, name, spec, sharding, batch)
            for name, spec, sharding in zip(
                names, self.outputs, self._out_sharding_specs, strict=True
            )
        ]

    def _out_shardings(self) -> list[ShardingSpec | None]:
        if self.exported is None:
            return [None] * len(self.outputs)
        return [
            None if s is None else ShardingSpec.from_partition_spec(self.mesh.spec, tuple(s.spec))
            for s in self.exported.out_shardings_jax(self.mesh.abstract)
        ]

    def _as_remote(self, i: int, arg: Any) -> RemoteArray:
        if isinstance(arg, RemoteArray):
            return arg
        sharding = None
        if self.exported is not None:
            want = self.exported.in_shardings_jax(self.mesh.abstract)[i]
            if want is not None:
                sharding = ShardingSpec.from_partition_spec(self.mesh.spec, tuple(want.spec))
        return self.gang.put(np.asarray(arg), sharding or ShardingSpec(self.mesh.spec, ()))

    def __repr__(self) -> str:
        sig = ", ".join(map(str, self.inputs))
        return f"Program({self.name}({sig}) -> {', '.join(map(str, self.outputs))})"


class RemoteArray:
    """An array that lives on a gang's workers.

    Freed by `delete()`, or once dropped: when the last RemoteArray of its handle is
    garbage-collected the handle is queued, and the gang sends its delete in a batch at
    its next put or call once `DELETE_BATCH` handles (or `DELETE_BATCH_BYTES`) are queued,
    on `gang.flush_deletes()`, and before a job is submitted on the gang; releasing the
    gang frees everything. A handle string kept after its arrays are dropped names nothing
    once the delete is sent.
    """

    def __init__(
        self,
        gang: Gang,
        handle: str,
        spec: ArraySpec,
        sharding: ShardingSpec | None,
        batch: int = 0,
    ) -> None:
        self.gang = gang
        self.handle = handle
        self.spec = spec
        self.sharding = sharding
        self._batch = batch  # the call-stream batch of the call that makes it (0: none)
        self._stream = gang._stream if batch else None
        self._lease = gang._drops.lease(handle, spec.nbytes)

    @classmethod
    def from_pb(cls, gang: Gang, info: pb.ArrayInfo, sharding: ShardingSpec | None) -> RemoteArray:
        return cls(gang, info.handle, wire.spec_from_pb(info.spec), sharding)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> np.dtype:
        return dtype_of(self.spec.dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def shape_dtype_struct(self) -> Any:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        sharding = None
        if self.sharding is not None:
            sharding = NamedSharding(
                self.sharding.mesh.abstract(), PartitionSpec(*self.sharding.partition_spec())
            )
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=sharding)

    def wait(self, timeout: float = 600.0) -> pb.ArrayInfo:
        """Blocks until the array is computed (or failed); returns its state."""
        after = self.gang._after([self])
        request = pb.WaitArraysRequest(handles=[self.handle], timeout_s=timeout, after_batch=after)
        try:
            reply = self.gang.client.stub.WaitArrays(request, timeout=timeout + 30)
        except grpc.RpcError as err:
            self.gang._refusal(self, err)
            _raise_from(err)
        return reply.arrays[0]

    def block_until_ready(self, timeout: float = 600.0) -> RemoteArray:
        info = self.wait(timeout)
        if info.state == pb.ARRAY_STATE_FAILED:
            self.gang._refusal(self, None)
            raise FailedPreconditionError(f"array {self.handle} failed: {info.error}")
        if info.state != pb.ARRAY_STATE_READY:
            raise DeadlineError(f"array {self.handle} not ready after {timeout:.0f} s")
        return self

    def fetch(self, timeout: float = 600.0) -> np.ndarray:
        """Downloads the whole array as numpy (waits for it to be computed)."""
        after = self.gang._after([self])
        if self.gang._goes_direct(self.spec.nbytes):
            result = self._fetch_direct(timeout, after)
            if result is not None:
                return result
        out = np.empty(self.spec.nbytes, dtype=np.uint8)
        offset = 0
        request = pb.FetchArrayRequest(handle=self.handle, timeout_s=timeout, after_batch=after)
        try:
            for chunk in self.gang.client.stub.FetchArray(request, timeout=timeout + 60):
                if chunk.HasField("data"):
                    out[offset : offset + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)
                    offset += len(chunk.data)
        except grpc.RpcError as err:
            self.gang._refusal(self, err)
            _raise_from(err)
        if offset != out.size:
            raise WorkerError(f"fetch of {self.handle} ended after {offset} of {out.size} bytes")
        return out.view(self.dtype).reshape(self.shape)

    def _fetch_direct(self, timeout: float, after: int) -> np.ndarray | None:
        """Reads the array straight from the hosts; None if they cannot be reached from
        here (the caller then fetches it through the controller)."""
        request = pb.BeginDirectFetchRequest(
            handle=self.handle, timeout_s=timeout, after_batch=after
        )
        try:
            transfer = self.gang.client.stub.BeginDirectFetch(request, timeout=timeout + 60)
        except grpc.RpcError as err:
            self.gang._refusal(self, err)
            _raise_from(err)
        out = np.empty(self.shape, self.dtype)
        hosts = [direct.HostPart(h.data_address, h.capability) for h in transfer.hosts]
        if not self.gang._direct_transfer(
            transfer, direct.fetch_into, transfer.transfer_id, out, hosts
        ):
            return None
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        result = self.fetch()
        return result if dtype is None else result.astype(dtype)

    def delete(self) -> None:
        """Deletes the array now (for every RemoteArray of its handle); it is not deleted
        again when dropped."""
        self.gang._confirmed([self])
        self._lease.cancel()
        _call(
            self.gang.client.stub.DeleteArrays,
            pb.DeleteArraysRequest(handles=[self.handle]),
            timeout=60,
        )

    def __repr__(self) -> str:
        return f"RemoteArray({self.handle}: {self.spec})"


class Lease:
    """A client's hold on one remote array, shared by every RemoteArray of its handle: the
    array is dropped when the lease is garbage-collected (`__del__`, one call, where a
    `weakref.finalize` and a WeakValueDictionary entry cost about ten per array, and one
    array is made per output of every call)."""

    __slots__ = ("__weakref__", "deleted", "generation", "handle", "nbytes", "queue")

    def __init__(self, queue: DropQueue, handle: str, nbytes: int) -> None:
        self.queue = queue
        self.handle = handle
        self.nbytes = nbytes
        self.generation = queue._generation
        self.deleted = False

    def cancel(self) -> None:
        """The array is deleted explicitly: dropping it queues nothing."""
        self.deleted = True

    def __del__(self) -> None:
        # Runs on whatever thread dropped the last reference (or at interpreter exit):
        # appends only, as the queue's docstring says; a dict pop and a deque append
        # cannot raise, and use no module globals. Out of the registry first: a handle
        # is only ever leased when its array is made, so nothing asks for a dying one.
        queue = self.queue
        queue._leases.pop(self.handle, None)
        if not self.deleted:
            queue._dropped.append((self.generation, self.handle, self.nbytes))


class DropQueue:
    """The remote arrays of one gang that the client holds, and the handles of those it
    dropped, waiting to be deleted in batches.

    `lease` gives every RemoteArray of one handle the same `Lease` (a registry of weak
    references by handle), so a handle is queued only when its last RemoteArray is gone.
    A dying lease only appends to a deque: it may die on any thread, in the middle of
    another call or at interpreter exit, so it takes no lock and sends nothing. Callers
    drain the queue with `take` and send the deletes themselves.
    """

    def __init__(
        self, batch_size: int = DELETE_BATCH, batch_bytes: int = DELETE_BATCH_BYTES
    ) -> None:
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        # handle -> a weak reference to its live lease (a dying lease removes itself).
        self._leases: dict[str, weakref.ref[Lease]] = {}
        # (generation, handle, bytes), appended by dying leases.
        self._dropped: deque[tuple[int, str, int]] = deque()
        # What callers moved out of `_dropped`: handle -> bytes, in drop order.
        self._pending: dict[str, int] = {}
        self._pending_bytes = 0
        self._lock = threading.Lock()  # callers only, never a dying lease
        self._generation = 0

    def lease(self, handle: str, nbytes: int) -> Lease:
        """The lease of `handle`, new or the one its other RemoteArrays share."""
        ref = self._leases.get(handle)
        lease = ref() if ref is not None else None
        if lease is None:
            lease = Lease(self, handle, nbytes)
            self._leases[handle] = weakref.ref(lease)
        return lease

    def forget(self) -> None:
        """Everything leased so far was freed as a whole (the gang was released): discards
        the queue, and those leases queue nothing when dropped later."""
        with self._lock:
            self._generation += 1
            self._collect()
            self._pending.clear()
            self._pending_bytes = 0

    def due(self) -> bool:
        """Whether a batch's worth is queued, in handles or bytes."""
        if not self._dropped and not self._pending:  # the usual case, without the lock
            return False
        with self._lock:
            self._collect()
            return len(self._pending) >= self.batch_size or self._pending_bytes >= self.batch_bytes

    def take(self, limit: int) -> list[str]:
        """Removes up to `limit` queued handles, oldest first, and returns them."""
        with self._lock:
            self._collect()
            handles = list(itertools.islice(self._pending, limit))
            for handle in handles:
                self._pending_bytes -= self._pending.pop(handle)
            return handles

    def _collect(self) -> None:
        while True:
            try:
                generation, handle, nbytes = self._dropped.popleft()
            except IndexError:
                return
            if generation == self._generation and handle not in self._pending:
                self._pending[handle] = nbytes
                self._pending_bytes += nbytes


def delete(arrays: Sequence[RemoteArray]) -> None:
    """Deletes several arrays in one call, now; they are not deleted again when dropped."""
    if arrays:
        arrays[0].gang._confirmed(arrays)
        for a in arrays:
            a._lease.cancel()
        _call(
            arrays[0].gang.client.stub.DeleteArrays,
            pb.DeleteArraysRequest(handles=list(dict.fromkeys(a.handle for a in arrays))),
            timeout=60,
        )
