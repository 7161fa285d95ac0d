"""A fuzzing campaign against every RPC of protos/controller.proto, in one bounded run.

Hypothesis builds requests field by field from the proto's descriptors (strings empty,
unicode or huge; integers negative or huge; NaN, infinite and negative seconds; unknown
fields), both from scratch and as real requests with one or two fields changed, mixing
garbage with the ids of a real gang, array, program and job; it mutates the bytes of a
real exported program; it sends raw frames that are no request message at all; and it
follows what a fuzzed request created (a job, an array, a program, an attachment to a
shared gang) with fuzzed requests about it. Every answer is counted by RPC and status.

A client mistake must never be answered INTERNAL or UNKNOWN, the controller must not die
or stop answering, nothing the fuzz made may linger, and well-formed requests afterwards
must succeed. The campaign has a controller of its own, so that whatever it leaves behind
(or breaks) cannot reach the other modules' tests.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import grpc
import jax
import numpy as np
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import slicewise
from protos import controller_pb2 as pb
from slicewise import wire
from slicewise.testing import wait_until
from tests.integration.conftest import controller_log, start_controller
from tests.integration.fuzzing import (
    Watchdog,
    batch_refs,
    fill,
    garbage_text,
    message_of,
    mutations,
    near,
    near_valid,
    near_valid_stream,
    rarely,
    seconds,
    split,
    stream_of,
    unknown_fields,
)

pytestmark = pytest.mark.integration

SIM = "2xv5litepod-4"
V4 = "v5litepod-4"
SHARED = "fuzz-shared"  # the shared gang on the second slice, that fuzzed allocations attach to
SERVICE = pb.DESCRIPTOR.services_by_name["Controller"]
METHODS: dict[str, MethodDescriptor] = {m.name: m for m in SERVICE.methods}
OK = grpc.StatusCode.OK
# Client deadlines: a refusal comes back in milliseconds; a watch of a live gang or job
# never ends by itself.
CALL_TIMEOUT_S = 20.0
WATCH_TIMEOUT_S = 0.15
WATCHES = {"WatchGang", "WatchJob", "JobLogs"}  # JobLogs follows a live job when asked
# The longest the controller may take to answer Health while the campaign runs.
HEALTH_TIMEOUT_S = 5.0
# Never the answer to a client mistake: a bug in the controller, or in its error mapping.
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# A controller that a request sends into a runaway allocation fails it (MemoryError)
# instead of taking the machine's memory; it needs well under 1 GiB.
CONTROLLER_DATA_BYTES = 6 * 2**30

# Examples of each kind; the campaign sends more requests than these add up to (the
# chains' follow-ups, and the releases and cancellations of what fuzzed requests made).
FROM_SCRATCH = 90
NEAR_VALID = {name: 80 for name in METHODS} | {"WatchGang": 30, "WatchJob": 30, "JobLogs": 30}
RAW_FRAMES = 40
MUTATED_PROGRAMS = 150
CHAINS = {"job": 50, "array": 50, "program": 40, "attachment": 30, "direct": 40}
# Direct transfers the fuzz begins and leaves expire (and are cleaned up) during the campaign.
DIRECT_TTL_S = 5
MIN_REQUESTS = 5000

SETTINGS: dict[str, Any] = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "phases": [Phase.explicit, Phase.generate],  # no shrinking: every example is sent once
    "suppress_health_check": list(HealthCheck),
}

# Absolute paths and URLs a job may name for its checkpoints, most of them unusable.
CHECKPOINT_DIRS = ["/nonexistent/fuzz", "/etc/passwd", "/dev/null", "///", "gs://bucket/x",
                   "s3://b/x", "file:///tmp/x", "zz://a", "http://x/y"]  # fmt: skip
LM_KEYS = ["d_model", "n_heads", "seq_len", "batch_size", "total_steps", "warmup_steps",
           "learning_rate", "end_learning_rate", "beta1", "grad_clip", "seed", "corpus"]  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_controller(tmp_path_factory):
    proc = start_controller(
        tmp_path_factory,
        "fuzz-controller",
        sim=SIM,
        extra_args=("--direct-transfer-ttl", str(DIRECT_TTL_S)),
    )
    limit = (CONTROLLER_DATA_BYTES, CONTROLLER_DATA_BYTES)
    resource.prlimit(proc.pid, resource.RLIMIT_DATA, limit)
    try:
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, f"the fuzzed controller exited with {code}"


@dataclass
class Pool:
    """Real ids for the fuzz to mix with garbage. The campaign's own gang is first in
    `gangs`, a released one last; `spare` holds the arrays fuzzed requests created (those,
    and only those, fuzzed deletes may reach); `jobs` grows with fuzzed submissions."""

    gangs: list[str]
    handles: list[str]
    programs: list[str]
    jobs: list[str]
    spare: list[str] = field(default_factory=list)
    streamed: list[str] = field(default_factory=list)  # outputs named on call streams
    transfers: list[str] = field(default_factory=list)  # direct puts and fetches begun


Reply = tuple[grpc.StatusCode, list[bytes]]


@dataclass
class Campaign:
    """Sends requests as raw bytes, counts every answer by (RPC, status), and undoes what
    a fuzzed request happened to create (unless the caller `keep`s it, to use it)."""

    channel: grpc.Channel
    pool: Pool
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    seconds: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    forbidden: list[str] = field(default_factory=list)
    current: str = ""  # the request in flight, for the watchdog's report
    # Why the campaign stopped, if it did: every later request fails at once with it (also
    # hypothesis's replay of the example that stopped it).
    stopped: str = ""

    def call(self, name: str, payload: bytes | list[bytes], *, keep: bool = False) -> Reply:
        if self.stopped:
            raise AssertionError(self.stopped)
        method = METHODS[name]
        path = f"/{SERVICE.full_name}/{name}"
        timeout = WATCH_TIMEOUT_S if name in WATCHES else CALL_TIMEOUT_S
        raw: dict[str, Any] = {"request_serializer": None, "response_deserializer": None}
        replies: list[bytes] = []
        code, details = OK, ""
        started = time.perf_counter()
        shown = payload if isinstance(payload, bytes) else b"|".join(payload)
        self.current = f"{name} <- {shown[:300]!r}"
        try:
            if method.client_streaming and method.server_streaming:
                frames = payload if isinstance(payload, list) else [payload]
                replies = list(
                    self.channel.stream_stream(path, **raw)(iter(frames), timeout=timeout)
                )
            elif method.client_streaming:
                frames = payload if isinstance(payload, list) else [payload]
                stub = self.channel.stream_unary(path, **raw)
                replies = [stub(iter(frames), timeout=timeout)]
            elif method.server_streaming:
                assert isinstance(payload, bytes)
                replies = list(self.channel.unary_stream(path, **raw)(payload, timeout=timeout))
            else:
                replies = [self.channel.unary_unary(path, **raw)(payload, timeout=timeout)]
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
        self.seconds[name] += time.perf_counter() - started
        self.outcomes[(name, code.name)] += 1
        if code in FORBIDDEN:
            self.forbidden.append(f"{name} -> {code.name}: {details[:500]} <- {shown[:300]!r}")
        if code is OK:
            self._created(name, replies[0] if replies else b"", keep)
        elif code is grpc.StatusCode.DEADLINE_EXCEEDED and name not in WATCHES:
            self._check_serving()
        return code, replies

    def send(
        self,
        name: str,
        request: Message | list[Message],
        suffix: bytes = b"",
        *,
        keep: bool = False,
    ) -> Reply:
        """A request message (a list of them for a request stream), with `suffix` (unknown
        fields) after the first."""
        if isinstance(request, list):
            if name == "Calls":  # outputs it may have made: deleted when the campaign ends
                self.pool.streamed.extend(
                    o
                    for m in request
                    if isinstance(m, pb.CallBatch)
                    for c in m.calls
                    for o in c.outputs
                )
            frames = [m.SerializeToString() for m in request]
            return self.call(name, [frames[0] + suffix, *frames[1:]] if frames else [], keep=keep)
        return self.call(name, request.SerializeToString() + suffix, keep=keep)

    def _created(self, name: str, reply: bytes, keep: bool) -> None:
        if name == "AllocateGang" and not keep:
            gang = pb.GangInfo.FromString(reply)
            self.send("ReleaseGang", pb.ReleaseGangRequest(gang_id=gang.gang_id))
        elif name == "SubmitJob":
            # A job of two slices (or more: it fails) waits while the campaign's gang holds
            # one, for the rest of the campaign to use; one of fewer is cancelled at once.
            job = pb.JobInfo.FromString(reply)
            self.pool.jobs.append(job.job_id)
            if job.num_slices < 2:
                self.send("CancelJob", pb.CancelJobRequest(job_id=job.job_id))
        elif name in ("PutArray", "FinishDirectPut"):
            self.pool.spare.append(pb.ArrayInfo.FromString(reply).handle)
        elif name in ("BeginDirectPut", "BeginDirectFetch"):
            self.pool.transfers.append(pb.DirectTransfer.FromString(reply).transfer_id)
        elif name in ("Execute", "ExecuteBatch"):
            results = (
                [pb.ExecuteResponse.FromString(reply)]
                if name == "Execute"
                else pb.ExecuteBatchResponse.FromString(reply).results
            )
            self.pool.spare.extend(o.handle for r in results for o in r.outputs)
        elif name == "RegisterProgram":
            program_id = pb.ProgramInfo.FromString(reply).program_id
            if program_id not in self.pool.programs:
                self.pool.programs.append(program_id)

    def _check_serving(self) -> None:
        """Stops the campaign if the controller no longer answers at all (a request hung
        it), rather than let every request after it wait out its deadline."""
        health = self.channel.unary_unary(
            f"/{SERVICE.full_name}/Health", request_serializer=None, response_deserializer=None
        )
        try:
            health(b"", timeout=HEALTH_TIMEOUT_S)
        except grpc.RpcError as error:
            self.stopped = (
                f"the controller stopped answering (Health: {error.code().name}) after "
                f"{self.current}"
            )
            raise AssertionError(self.stopped) from None


def hints(pool: Pool, program_bytes: int) -> dict[str, st.SearchStrategy[Any]]:
    """Values for fields whose meaning garbage alone would hardly reach, by field name
    ("Message.field" first): for a repeated field, one element."""
    gangs = near(lambda: pool.gangs)
    # Requests that would take the campaign's gang away (or run a job on it) get only near
    # misses of its id; the released gang's id in full.
    not_ours = st.one_of(near(lambda: pool.gangs[:1], exact=False), st.just(pool.gangs[-1]))
    handles = st.one_of(near(lambda: pool.handles), near(lambda: pool.spare))
    slice_types = st.sampled_from([V4, "2x2", "v5litepod-16", "v5litepod-8", "4x4", "v4-8"])
    axis_names = st.sampled_from(["slice", "chip", "data", "fsdp", "tensor", "expert"])
    numbers = ["0", "-1", "1", "2", "1e999", "nan", "inf", "-inf", "1" * 5000, "0x10", "1,2"]
    return {
        "gang_id": st.one_of(gangs, garbage_text),
        "ReleaseGangRequest.gang_id": st.one_of(not_ours, garbage_text),
        "SubmitJobRequest.gang_id": st.one_of(not_ours, garbage_text),
        "GetTraceRequest.id": st.one_of(gangs, near(lambda: pool.jobs), garbage_text),
        "handle": st.one_of(handles, garbage_text),
        "transfer_id": st.one_of(near(lambda: pool.transfers), garbage_text),
        "handles": st.one_of(handles, garbage_text),
        "inputs": st.one_of(handles, batch_refs(), garbage_text),
        "program_id": st.one_of(near(lambda: pool.programs), garbage_text),
        "job_id": st.one_of(near(lambda: pool.jobs), garbage_text),
        "slice_type": st.one_of(slice_types, garbage_text),
        "alternatives": st.one_of(slice_types, garbage_text),
        "dtype": st.one_of(
            st.sampled_from(["float32", "bfloat16", "int4", "bool", "f4,f4", ">f4", "O", "V8"]),
            garbage_text,
        ),
        "SubmitJobRequest.program": st.one_of(st.sampled_from(["lm", "moe"]), garbage_text),
        "SubmitJobRequest.overrides": st.dictionaries(
            st.one_of(st.sampled_from(LM_KEYS), garbage_text),
            st.one_of(st.sampled_from(numbers), garbage_text),
            max_size=3,
        ),
        "InjectFaultRequest.kind": st.one_of(
            st.sampled_from(["kill-worker", "remove-host", "hang-collective", "kill-controller"]),
            garbage_text,
        ),
        "MeshAxis.name": st.one_of(axis_names, garbage_text),
        "PartitionDim.axes": st.one_of(axis_names, garbage_text),
        "checkpoint_dir": st.one_of(
            st.sampled_from(["", "relative/dir", *CHECKPOINT_DIRS]),
            garbage_text,
        ),
        "ProgramHeader.total_bytes": st.one_of(
            st.integers(program_bytes - 2, program_bytes + 2),
            st.sampled_from([0, -1, 2**31 - 1, 2**31, -(2**63)]),
        ),
        # Chains of up to a few runs, and counts the controller refuses: a valid count
        # in between (up to a million runs of the campaign's program) would only keep
        # its gang busy for minutes, which a client may ask of its own gang.
        "StreamCall.repeat": st.one_of(
            st.integers(0, 3), st.sampled_from([1_000_001, 2**31, 2**32 - 1])
        ),
        "ArraySpec.shape": st.one_of(
            st.integers(-2, 16), st.integers(-(2**63), 2**63 - 1), st.sampled_from([2**31, 2**62])
        ),
    }


def upload_bytes(header: pb.PutHeader) -> bytes:
    """The bytes an upload with this header needs, when that is a small amount."""
    try:
        size = math.prod(header.spec.shape) * np.dtype(header.spec.dtype).itemsize
    except (TypeError, ValueError):
        return b""
    return bytes(size) if 0 <= size <= 2**16 else b""


# -- the campaign -----------------------------------------------------------------------


@dataclass
class Real:
    """What the campaign's well-formed requests are made of."""

    gang: str
    released: str
    array: str
    program_id: str
    program: bytes
    mesh: pb.MeshSpec
    sharding: pb.ShardingSpec
    job: str
    transfer: str  # a direct put begun (and left to expire)


def templates(real: Real) -> dict[str, Message | list[Message]]:
    """A well-formed request of every RPC, each cheap: the allocation attaches to the
    shared gang (any other waits for slices, and gives up at once), and the job waits for
    slices until it is cancelled."""
    spec = pb.ArraySpec(shape=[8], dtype="float32")
    put = pb.PutHeader(gang_id=real.gang, spec=spec, sharding=real.sharding)
    header = pb.ProgramHeader(
        gang_id=real.gang, name="plus_one", mesh=real.mesh, total_bytes=len(real.program)
    )
    base = real.gang.partition("@")[0]
    calls = [
        pb.CallSpec(program_id=real.program_id, inputs=[real.array]),
        pb.CallSpec(program_id=real.program_id, inputs=["@0:0"]),
    ]
    job = real.job
    return {
        "Health": pb.HealthRequest(),
        "GetClusterInfo": pb.ClusterInfoRequest(),
        "AllocateGang": pb.AllocateGangRequest(
            num_slices=1,
            slice_type=V4,
            timeout_s=0.05,
            max_wait_s=0.01,
            client="fuzz",
            shared=SHARED,
            weight=2,
        ),
        "ReleaseGang": pb.ReleaseGangRequest(gang_id=real.released),
        "WatchGang": pb.WatchGangRequest(gang_id=real.released),
        "RegisterProgram": [pb.ProgramChunk(header=header), pb.ProgramChunk(data=real.program)],
        "PutArray": [pb.PutChunk(header=put), pb.PutChunk(data=bytes(32))],
        "Execute": pb.ExecuteRequest(
            gang_id=real.gang, program_id=real.program_id, inputs=[real.array]
        ),
        "ExecuteBatch": pb.ExecuteBatchRequest(gang_id=real.gang, calls=calls),
        "Calls": [
            pb.CallBatch(
                gang_id=real.gang,
                batch=1,
                stream=f"{base}/cfz",
                calls=[
                    pb.StreamCall(
                        program_id=real.program_id, inputs=[real.array], outputs=[f"{base}/cfz.1"]
                    ),
                    pb.StreamCall(
                        program_id=real.program_id,
                        inputs=[f"{base}/cfz.1"],
                        outputs=[f"{base}/cfz.2"],
                    ),
                ],
                deletes=[f"{base}/cfz.1", f"{base}/cfz.2"],
                sync=True,
            )
        ],
        "FetchArray": pb.FetchArrayRequest(handle=real.array, timeout_s=10),
        "BeginDirectPut": pb.BeginDirectPutRequest(
            gang_id=real.gang, spec=spec, sharding=real.sharding
        ),
        "FinishDirectPut": pb.FinishDirectPutRequest(transfer_id=real.transfer),
        "BeginDirectFetch": pb.BeginDirectFetchRequest(handle=real.array, timeout_s=10),
        "AbandonDirectTransfer": pb.AbandonDirectTransferRequest(transfer_id=real.transfer),
        "WaitArrays": pb.WaitArraysRequest(handles=[real.array], timeout_s=1),
        "DeleteArrays": pb.DeleteArraysRequest(handles=[]),
        "GetGangStats": pb.GangStatsRequest(gang_id=real.gang),
        "GetTrace": pb.GetTraceRequest(id=real.gang),
        "SubmitJob": pb.SubmitJobRequest(
            program="lm", num_slices=2, slice_type=V4, steps=4, overrides={"d_model": "64"}
        ),
        "GetJob": pb.GetJobRequest(job_id=job),
        "ListJobs": pb.ListJobsRequest(),
        "CancelJob": pb.CancelJobRequest(job_id=job),
        "KeepCheckpoint": pb.KeepCheckpointRequest(job_id=job, step=1),
        "WatchJob": pb.WatchJobRequest(job_id=job),
        "GetJobMetrics": pb.GetJobRequest(job_id=job),
        "InjectFault": pb.InjectFaultRequest(job_id=job, kind="kill-worker"),
        "JobLogs": pb.JobLogsRequest(job_id=job, tail=5),
    }


def fuzz(campaign: Campaign, name: str, requests: Any, examples: int) -> None:
    """Sends `examples` requests drawn from `requests`, with unknown fields now and then."""

    @settings(max_examples=examples, **SETTINGS)
    @given(request=requests, suffix=rarely(st.just(b""), unknown_fields))
    def run(request: Message | list[Message], suffix: bytes) -> None:
        campaign.send(name, request, suffix)

    run()


def fuzz_raw(campaign: Campaign, name: str, frames: Any) -> None:
    """Sends frames that are no request message, or a broken one, as the request."""

    @settings(max_examples=RAW_FRAMES, **SETTINGS)
    @given(payload=st.lists(frames, max_size=4) if METHODS[name].client_streaming else frames)
    def run(payload: bytes | list[bytes]) -> None:
        campaign.call(name, payload)

    run()


def chain(examples: int, **strategies: Any) -> Any:
    """A chain of requests, run `examples` times. Everything it sends is drawn before it
    sends anything, so that no example stops half way (hypothesis ends an example that
    draws past its budget), leaving what it created behind."""

    def decorate(steps: Any) -> Any:
        return settings(max_examples=examples, **SETTINGS)(given(**strategies)(steps))

    return decorate


def run_chains(campaign: Campaign, real: Real, hinted: dict[str, Any]) -> None:
    """Fuzzed requests about what a fuzzed request just created."""
    valid = templates(real)
    anything = st.integers(-(2**63), 2**63 - 1)

    def pick(i: int, choices: list[int]) -> int:
        return choices[i % len(choices)]

    @chain(
        CHAINS["job"],
        request=near_valid(valid["SubmitJob"], hinted),
        # What the follow-ups depend on most: how long the job is, where it checkpoints.
        steps=st.one_of(st.sampled_from([4, 2**20, 2**40, 2**63 - 1]), st.integers(1, 2**63 - 1)),
        where=st.one_of(st.none(), st.sampled_from(CHECKPOINT_DIRS)),
        step=st.tuples(st.integers(0, 6), anything, anything),
        fault=near_valid(pb.InjectFaultRequest(job_id="<job>", kind="kill-worker"), hinted),
    )
    def job(
        request: pb.SubmitJobRequest,
        steps: int | None,
        where: str | None,
        step: tuple[int, int, int],
        fault: pb.InjectFaultRequest,
    ) -> None:
        request.steps = request.steps if steps is None else steps
        request.checkpoint_dir = request.checkpoint_dir if where is None else where
        code, replies = campaign.send("SubmitJob", request)
        if code is not OK:
            return
        info = pb.JobInfo.FromString(replies[0])
        j, n = info.job_id, info.steps
        keep = pick(step[0], [1, 2, n - 1, n, n + 1, 0, step[1]])
        campaign.send("KeepCheckpoint", pb.KeepCheckpointRequest(job_id=j, step=keep))
        fault.at_step = pick(step[0] + 1, [1, n - 1, n, 0, step[2]])
        campaign.send("InjectFault", fill(fault, "<job>", j))
        for name in ("GetJob", "GetJobMetrics", "WatchJob"):
            campaign.send(name, getattr(pb, METHODS[name].input_type.name)(job_id=j))
        campaign.send("GetTrace", pb.GetTraceRequest(id=j))
        campaign.send("CancelJob", pb.CancelJobRequest(job_id=j))
        # Ended: its checkpoint directory is read for committed steps.
        campaign.send("KeepCheckpoint", pb.KeepCheckpointRequest(job_id=j, step=keep))

    put_stream = near_valid_stream(
        valid["PutArray"], hinted, lambda h: rarely(st.just([upload_bytes(h)]), st.just([]))
    )
    use = pb.ExecuteRequest(gang_id=real.gang, program_id=real.program_id, inputs=["<array>"])
    batch = pb.ExecuteBatchRequest(
        gang_id=real.gang,
        calls=[
            pb.CallSpec(program_id=real.program_id, inputs=["<array>"]),
            pb.CallSpec(program_id=real.program_id, inputs=["<ref>"]),
        ],
    )

    @chain(
        CHAINS["array"],
        put=put_stream,
        timeouts=st.tuples(seconds, seconds),
        call=near_valid(use, hinted),
        batch=near_valid(batch, hinted),
        ref=batch_refs(),
    )
    def array(
        put: list[pb.PutChunk],
        timeouts: tuple[float, float],
        call: pb.ExecuteRequest,
        batch: pb.ExecuteBatchRequest,
        ref: str,
    ) -> None:
        code, replies = campaign.send("PutArray", put)
        if code is not OK:
            return
        a = pb.ArrayInfo.FromString(replies[0]).handle
        campaign.send("FetchArray", pb.FetchArrayRequest(handle=a, timeout_s=timeouts[0]))
        code, replies = campaign.send("Execute", fill(call, "<array>", a))
        made = pb.ExecuteResponse.FromString(replies[0]).outputs if code is OK else []
        outputs = [o.handle for o in made]
        campaign.send("ExecuteBatch", fill(fill(batch, "<array>", a), "<ref>", ref))
        wait = pb.WaitArraysRequest(handles=[a, *outputs], timeout_s=timeouts[1])
        campaign.send("WaitArrays", wait)
        campaign.send("DeleteArrays", pb.DeleteArraysRequest(handles=[a, *outputs, a]))
        campaign.send("FetchArray", pb.FetchArrayRequest(handle=a))
        campaign.send("Execute", fill(use, "<array>", a))

    @chain(CHAINS["program"], serialized=mutations(real.program))
    def program(serialized: bytes) -> None:
        header = pb.ProgramHeader(
            gang_id=real.gang, name="mutant", mesh=real.mesh, total_bytes=len(serialized)
        )
        chunks = [pb.ProgramChunk(header=header), pb.ProgramChunk(data=serialized)]
        code, replies = campaign.send("RegisterProgram", chunks)
        if code is not OK:
            return
        program_id = pb.ProgramInfo.FromString(replies[0]).program_id
        call = pb.ExecuteRequest(gang_id=real.gang, program_id=program_id, inputs=[real.array])
        code, replies = campaign.send("Execute", call)
        for output in pb.ExecuteResponse.FromString(replies[0]).outputs if code is OK else []:
            campaign.send("FetchArray", pb.FetchArrayRequest(handle=output.handle))
        campaign.send("GetGangStats", pb.GangStatsRequest(gang_id=real.gang))

    @chain(
        CHAINS["attachment"],
        request=near_valid(valid["AllocateGang"], hinted),
        requeue=st.booleans(),
    )
    def attachment(request: pb.AllocateGangRequest, requeue: bool) -> None:
        code, replies = campaign.send("AllocateGang", request, keep=True)
        if code is not OK:
            return
        g = pb.GangInfo.FromString(replies[0]).gang_id
        campaign.pool.gangs.insert(1, g)
        spec = pb.ArraySpec(shape=[8], dtype="float32")
        header = pb.PutHeader(gang_id=g, spec=spec, sharding=real.sharding)
        campaign.send("PutArray", [pb.PutChunk(header=header), pb.PutChunk(data=bytes(32))])
        call = pb.ExecuteRequest(gang_id=g, program_id=real.program_id, inputs=[real.array])
        campaign.send("Execute", call)
        for name in ("GetGangStats", "WatchGang"):
            campaign.send(name, getattr(pb, METHODS[name].input_type.name)(gang_id=g))
        campaign.send("GetTrace", pb.GetTraceRequest(id=g))
        campaign.send("ReleaseGang", pb.ReleaseGangRequest(gang_id=g, requeue=requeue))
        campaign.send("ReleaseGang", pb.ReleaseGangRequest(gang_id=g))
        campaign.send("GetGangStats", pb.GangStatsRequest(gang_id=g))

    @chain(
        CHAINS["direct"],
        put=near_valid(valid["BeginDirectPut"], hinted),
        fetch=near_valid(valid["BeginDirectFetch"], hinted),
        finish=st.booleans(),
    )
    def direct(
        put: pb.BeginDirectPutRequest, fetch: pb.BeginDirectFetchRequest, finish: bool
    ) -> None:
        code, replies = campaign.send("BeginDirectPut", put)
        if code is OK:
            t = pb.DirectTransfer.FromString(replies[0]).transfer_id
            # No pieces were sent: a finished put makes an array that failed.
            if finish:
                code, replies = campaign.send(
                    "FinishDirectPut", pb.FinishDirectPutRequest(transfer_id=t)
                )
                if code is OK:
                    a = pb.ArrayInfo.FromString(replies[0]).handle
                    campaign.send("WaitArrays", pb.WaitArraysRequest(handles=[a], timeout_s=5))
                    campaign.send("BeginDirectFetch", pb.BeginDirectFetchRequest(handle=a))
            campaign.send("AbandonDirectTransfer", pb.AbandonDirectTransferRequest(transfer_id=t))
            campaign.send("FinishDirectPut", pb.FinishDirectPutRequest(transfer_id=t))
        code, replies = campaign.send("BeginDirectFetch", fetch)
        if code is OK:
            t = pb.DirectTransfer.FromString(replies[0]).transfer_id
            campaign.send("AbandonDirectTransfer", pb.AbandonDirectTransferRequest(transfer_id=t))
            campaign.send("FinishDirectPut", pb.FinishDirectPutRequest(transfer_id=t))

    for steps in (job, array, program, attachment, direct):
        steps()


def run_campaign(campaign: Campaign, real: Real) -> None:
    hinted = hints(campaign.pool, len(real.program))
    program = real.program

    # Mutated program bytes, under a header that declares them (mostly) or the original.
    @settings(max_examples=MUTATED_PROGRAMS, **SETTINGS)
    @given(
        data=mutations(program),
        honest=st.integers(0, 3),
        pieces=st.lists(st.integers(1, 4096), max_size=3),
    )
    def mutated(data: bytes, honest: int, pieces: list[int]) -> None:
        header = pb.ProgramHeader(
            gang_id=real.gang,
            name="mutant",
            mesh=real.mesh,
            total_bytes=len(data) if honest else len(program),
        )
        chunks = [pb.ProgramChunk(data=d) for d in split(data, pieces)]
        campaign.send("RegisterProgram", [pb.ProgramChunk(header=header), *chunks])

    mutated()

    # Real requests with one or two fields changed.
    valid = templates(real)
    near_requests: dict[str, Any] = {
        name: near_valid(template, hinted)
        for name, template in valid.items()
        if isinstance(template, Message)
    }
    program_bytes = st.one_of(st.just(program), mutations(program))
    near_requests["RegisterProgram"] = near_valid_stream(
        valid["RegisterProgram"], hinted, lambda h: program_bytes.map(lambda d: [d])
    )
    near_requests["PutArray"] = near_valid_stream(
        valid["PutArray"], hinted, lambda h: rarely(st.just([upload_bytes(h)]), st.just([]))
    )
    near_requests["Calls"] = st.lists(near_valid(valid["Calls"][0], hinted), min_size=1, max_size=3)
    for name in METHODS:
        fuzz(campaign, name, near_requests[name], NEAR_VALID[name])

    run_chains(campaign, real, hinted)

    # Requests from scratch, field by field; the streams' headers also near real ones.
    scratch: dict[str, Any] = {
        name: message_of(method.input_type, hinted)
        for name, method in METHODS.items()
        if not method.client_streaming
    }
    streams = {
        "RegisterProgram": (pb.ProgramChunk, st.one_of(st.just(program), mutations(program))),
        "PutArray": (pb.PutChunk, st.just(b"")),
    }
    scratch["Calls"] = st.lists(message_of(pb.CallBatch.DESCRIPTOR, hinted), max_size=4)
    for name, (chunk, data) in streams.items():
        header = valid[name][0].header
        headers = st.one_of(message_of(header.DESCRIPTOR, hinted), near_valid(header, hinted))
        scratch[name] = stream_of(chunk, headers, st.one_of(data, st.binary(max_size=256)))
    for name in METHODS:
        fuzz(campaign, name, scratch[name], FROM_SCRATCH)

    # Raw frames: bytes that are no request message, or a real one broken.
    for name in METHODS:
        template = valid[name]
        serialized = (
            b"".join(m.SerializeToString() for m in template)
            if isinstance(template, list)
            else template.SerializeToString()
        )
        frames = st.one_of(
            st.binary(max_size=64),
            mutations(serialized) if serialized else st.binary(min_size=1, max_size=8),
            st.sampled_from([b"\xff" * 16, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" * 9 + b"\x01"]),
        )
        fuzz_raw(campaign, name, frames)


def well_formed(client: slicewise.Client, gang: slicewise.client.Gang) -> None:
    """Upload (through the controller and directly), compute and download on the
    campaign's gang and on a new one."""
    for g in (gang, client.allocate(slices=1, slice_type=V4, timeout=120)):
        try:
            x = g.put(np.arange(8, dtype=np.float32), g.mesh().sharding("chip"))
            affine = g.compile(jax.jit(lambda a: a * 3 + 1), x)
            np.testing.assert_array_equal(
                affine(x).fetch(timeout=60), np.arange(8, dtype=np.float32) * 3 + 1
            )
            # Large enough to go straight between client and hosts, both ways.
            big = np.arange(slicewise.client.DIRECT_MIN_BYTES // 4, dtype=np.float32)
            np.testing.assert_array_equal(g.put(big, g.mesh().sharding("chip")).fetch(), big)
            assert g.direct_data
        finally:
            if g is not gang:
                g.release()


def only_gang_left(client: slicewise.Client, gang_id: str) -> bool:
    info = client.cluster_info()
    return [g.gang_id for g in info.gangs] == [gang_id] and not info.queue


def test_fuzz_every_rpc(fuzz_controller, tmp_path):
    started = time.monotonic()
    with (
        slicewise.connect(fuzz_controller.address, name="fuzz") as client,
        grpc.insecure_channel(fuzz_controller.address) as channel,
    ):
        # Top priority: no fuzzed allocation can preempt it. Released only at the end:
        # after a failure the controller may not answer, and stopping it releases all.
        gang = client.allocate(slices=1, slice_type=V4, timeout=120, priority=2**31 - 1)
        mesh = gang.mesh()
        x = gang.put(np.arange(8, dtype=np.float32), mesh.sharding("chip"))
        exported = jax.export.export(jax.jit(lambda a: a + 1), platforms=[gang.platform])(
            x.shape_dtype_struct()
        )
        program = gang.load(exported, mesh, name="plus_one")
        deleted = gang.put(np.zeros(4, np.float32))
        deleted.delete()
        transfer = client.stub.BeginDirectPut(
            pb.BeginDirectPutRequest(
                gang_id=gang.id,
                spec=pb.ArraySpec(shape=[8], dtype="float32"),
                sharding=wire.sharding_to_pb(x.sharding),
            )
        ).transfer_id
        with client.allocate(slices=1, slice_type=V4, timeout=120) as released:
            pass
        # The other slice: fuzzed allocations attach to this gang, or queue and give up.
        shared = client.allocate(slices=1, slice_type=V4, timeout=120, shared=SHARED)
        # Jobs of two slices stay queued while both are held: one cancelled, one waiting.
        cancelled = client.submit_job("lm", steps=2, slices=2, slice_type=V4)
        client.cancel_job(cancelled.job_id)
        queued = client.submit_job("lm", steps=4, slices=2, slice_type=V4, checkpoint_every=2)
        pool = Pool(
            gangs=[gang.id, shared.id, released.id],
            handles=[x.handle, deleted.handle],
            programs=[program.id],
            jobs=[cancelled.job_id, queued.job_id],
            transfers=[transfer],
        )
        campaign = Campaign(channel, pool)
        real = Real(
            gang=gang.id,
            released=released.id,
            array=x.handle,
            program_id=program.id,
            program=bytes(exported.serialize()),
            mesh=wire.mesh_to_pb(mesh.spec),
            sharding=wire.sharding_to_pb(x.sharding),
            job=cancelled.job_id,
            transfer=transfer,
        )
        with Watchdog(
            fuzz_controller.address,
            f"/{SERVICE.full_name}/Health",
            lambda: campaign.current,
            HEALTH_TIMEOUT_S,
        ) as watchdog:
            run_campaign(campaign, real)
        report(campaign, tmp_path, time.monotonic() - started)
        print(f"slowest Health during the campaign: {watchdog.slowest_s:.3f} s")

        assert fuzz_controller.proc.poll() is None, "the controller died under the fuzz"
        total = sum(campaign.outcomes.values())
        assert total >= MIN_REQUESTS, f"only {total} requests"
        assert {rpc for rpc, _ in campaign.outcomes} == set(METHODS)
        assert not campaign.forbidden, "\n".join(campaign.forbidden[:20])
        assert not watchdog.missed, "the controller froze: " + "\n".join(watchdog.missed[:10])
        log = controller_log(fuzz_controller)
        for sign in ("failed unexpectedly", "never retrieved", "Exception in callback"):
            assert sign not in log, f"the controller's log says {sign!r}"

        # Nothing the fuzz made lingers once the campaign's own gang, job and arrays go.
        if pool.spare:
            campaign.send("DeleteArrays", pb.DeleteArraysRequest(handles=pool.spare))
        if pool.streamed:  # a stream's deletes skip what is gone
            done = [pb.CallBatch(gang_id=gang.id, batch=1, deletes=pool.streamed, sync=True)]
            assert campaign.send("Calls", done)[0] is OK
        for job in client.jobs():
            if job.state < pb.JOB_STATE_SUCCEEDED:
                client.cancel_job(job.job_id)
        with contextlib.suppress(slicewise.SlicewiseError):  # a fuzzed request detached it
            shared.release()
        try:
            wait_until(lambda: only_gang_left(client, gang.id), timeout_s=60, what="leftovers")
        except TimeoutError:
            raise AssertionError(f"the fuzz left behind: {client.cluster_info()}") from None
        wait_until(
            lambda: all(j.state >= pb.JOB_STATE_SUCCEEDED for j in client.jobs()),
            timeout_s=60,
            what="every job to have ended",
        )
        assert client.job(cancelled.job_id).state == pb.JOB_STATE_CANCELLED
        well_formed(client, gang)
        gang.release()
    assert fuzz_controller.proc.poll() is None


def report(campaign: Campaign, tmp_path, elapsed_s: float) -> None:
    """Prints the (RPC, status) table and writes it as JSON next to the test's files."""
    outcomes = campaign.outcomes
    table: dict[str, dict[str, int]] = {}
    for (rpc, code), count in sorted(outcomes.items()):
        table.setdefault(rpc, {})[code] = count
    codes = sorted({code for _, code in outcomes})
    lines = [f"{'RPC':<16}" + "".join(f"{c[:11]:>12}" for c in codes) + f"{'total':>8}{'s':>7}"]
    for rpc, counts in table.items():
        cells = "".join(f"{counts.get(c, 0) or '':>12}" for c in codes)
        total = sum(counts.values())
        lines.append(f"{rpc:<16}{cells}{total:>8}{campaign.seconds[rpc]:>7.1f}")
    lines.append(f"{sum(outcomes.values())} requests over {len(table)} RPCs in {elapsed_s:.1f} s")
    print("\nfuzz campaign outcomes\n" + "\n".join(lines))
    (tmp_path / "fuzz_outcomes.json").write_text(json.dumps(table, indent=2, sort_keys=True))
