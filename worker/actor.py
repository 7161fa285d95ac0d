"""The Ray actor that runs on each TPU host (or simulated host) of a gang.

A worker lives as long as its gang: it joins the gang's jax.distributed cluster once
(JAX allows that once per process) and is killed when the gang is released. Ray creates
it, forms the gang and serves the occasional request (stats, spans); the operations of
the gang, and their completions, travel on the control channel (channel.py).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

from slicewise.common.failpoints import failpoint
from slicewise.common.framing import Pieces
from slicewise.common.mesh import GangShape
from slicewise.common.ops import Completions, DeleteOp, ExecOp, Op, OpResult
from slicewise.common.trace import Span, SpanRecorder, now_us
from worker import sched
from worker.channel import WorkerEnd
from worker.executor import InOrderExecutor
from worker.runtime import JaxRuntime
from worker.transport import DataServer

log = logging.getLogger(__name__)

# How many programs may be launched and not yet finished on one host (see executor.py).
DEFAULT_WINDOW = 3


class HostWorker:
    """One host of a gang. Created by the controller with `ray.remote(HostWorker)`."""

    def __init__(
        self,
        gang_id: str,
        gang: GangShape,
        process_id: int,
        *,
        token: str,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        self.gang_id = gang_id
        self.process_id = process_id
        self.runtime = JaxRuntime(gang, process_id, window=window)
        self.spans = SpanRecorder()
        # How the spans of calls and deletes are described when somebody reads them.
        self._exec_spans = self.spans.describer(functools.partial(_describe_exec, self))
        self._delete_spans = self.spans.describer(functools.partial(_describe_delete, self))
        self._token = token
        self._channel: WorkerEnd | None = None  # once the gang is formed
        self._stashes: dict[str, Any] = {}  # stash actors started here, by name
        self.executor = InOrderExecutor(
            self.runtime.apply,
            window=window,
            on_failure=self.runtime.on_failure,
            # Module functions, not methods: Ray wraps every method of an actor class (to
            # resume traces), a frame and a check on each of the executor's per-op calls.
            on_done=functools.partial(_report_done, self),
            on_idle=functools.partial(_flush, self),
            on_start=sched.dispatch_thread,
        )
        self._started = time.time()
        import ray

        # Bound to the address Ray uses on this host, never to all interfaces.
        self.data = DataServer(
            ray.util.get_node_ip_address(),
            token,
            self._receive,
            self._send,
            self._control,
            on_drop=self.runtime.drop_staged,
        )

    def _describe(
        self, op: Op, launched_ns: int, started_ns: int, error: str | None
    ) -> tuple[str, str, str, dict[str, Any]]:
        name, args = self.runtime.describe(op)
        if error:
            args["error"] = error
        if launched_ns < started_ns:  # it waited for the program before it
            args["launched_us"] = launched_ns // 1000
        thread = "programs" if isinstance(op, ExecOp) else "executor"
        return name, "execute", thread, {"gang": self.gang_id, "seq": op.seq, **args}

    def _on_sent(self, done: Completions, started_ns: int, finished_ns: int) -> None:
        # One span per frame of completions: the timeline shows how they were batched.
        self.spans.record(
            "send completions",
            "control",
            started_ns // 1000,
            finished_ns // 1000,
            thread="control",
            gang=self.gang_id,
            seqs=list(done.seqs),
        )

    def _progress(self) -> dict[str, Any]:
        """What each heartbeat carries (see controller/health.py)."""
        progress = self.executor.progress()
        return {
            "oldest_seq": progress.oldest_seq,
            "oldest_kind": progress.oldest_kind,
            "stalled_s": progress.stalled_s,
            "compiling": self.runtime.compiling,
        }

    def _control(self, conn: socket.socket, hello: dict[str, Any], reply: Any) -> None:
        if self._channel is None:
            reply({"error": "this worker has not joined its gang yet"})
            return
        self._channel.serve(conn, hello, reply)

    def _receive(self, key: str, pieces: Pieces, started_us: int, expires: int) -> None:
        self.runtime.stage(key, pieces, expires)
        self.spans.record(
            "receive pieces",
            "transfer",
            started_us,
            now_us(),
            thread="data",
            gang=self.gang_id,
            bytes=sum(a.nbytes for _, a in pieces),
        )

    def _send(self, key: str) -> Pieces:
        started = now_us()
        pieces = self.runtime.read_pinned(key)
        self.spans.record(
            "fetch pieces",
            "transfer",
            started,
            now_us(),
            thread="data",
            gang=self.gang_id,
            bytes=sum(a.nbytes for _, a in pieces),
        )
        return pieces

    def data_address(self) -> str:
        """Where the controller sends and fetches array bytes (see worker/transport.py)."""
        return self.data.address

    def free_address(self, host: str) -> str:
        """An address on this host with a free port, for the jax.distributed coordinator."""
        with socket.socket() as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"

    def initialize(
        self,
        coordinator: str,
        epoch: int,
        *,
        partition_index: int,
        bind_address: str | None,
        timeout_s: int,
    ) -> dict[str, Any]:
        if failpoint("initialize_exit_process") == self.process_id + 1:
            # Tests: this process dies while its gang forms, after saying why on stderr.
            print(f"failpoint: process {self.process_id} exits while joining", file=sys.stderr)
            sys.stderr.flush()
            os._exit(3)
        info = self.runtime.initialize(
            coordinator,
            partition_index=partition_index,
            bind_address=bind_address,
            timeout_s=timeout_s,
        )
        self._channel = WorkerEnd(
            self._token,
            epoch,
            self.executor.enqueue,
            self._on_sent,
            progress=self._progress,
            backlog=self.executor.backlog,
        )
        log.info("gang %s process %d joined: %s", self.gang_id, self.process_id, info)
        return info | {"pid": os.getpid()}

    def drop_pin(self, pin_id: str) -> None:
        self.runtime.drop_pin(pin_id)

    def prepare_stash(self, name: str) -> None:
        """Starts the stash actor `name` on this host ahead of any failure (for a job
        with peer recovery) and waits until it answers: an actor takes about a second to
        start, and on the simulation a survivor may not outlive its peer by that much
        (see stash_state). The handle is kept before the wait, so that a `stash_state`
        arriving meanwhile puts into this actor rather than starting a second one."""
        import ray

        stash = self._stashes.get(name)
        if stash is None:
            stash = self._stashes[name] = self._start_stash(name)
        ray.get(stash.keys.remote())  # started and answering

    def stash_state(self, name: str, handles: list[str]) -> int:
        """Copies this host's pieces of the arrays into the stash actor `name` on this
        host (worker/stash.py; the one `prepare_stash` started, or a new one), out of band:
        the executor may be stuck in a collective with a lost peer. Returns the bytes
        stashed.

        Done as soon as it can be: on XLA:CPU a worker whose peer process died in a
        collective can abort a few hundred ms later (gloo's "op.preamble.length <=
        op.nbytes", the README's notes), taking its replica with it."""
        import ray

        pieces = self.runtime.pieces_of(handles)
        stash = self._stashes.pop(name, None) or self._start_stash(name)
        stashed: int = ray.get(stash.put.remote(pieces))
        return stashed

    def _start_stash(self, name: str) -> Any:
        """A new stash actor on this host (its handle at once; it starts meanwhile)."""
        import ray

        from worker.stash import StateStash, stash_options

        node = ray.get_runtime_context().get_node_id()
        return ray.remote(StateStash).options(name=name, **stash_options(node)).remote()

    def log_tail(self, lines: int) -> str:
        """The last `lines` lines this worker wrote to its stderr (Ray sends a worker's
        stderr to a file of the session's logs, on its own host), for `slicewise logs`;
        "" when stderr is not a file."""
        from slicewise.common.files import last_lines

        path = os.path.realpath(f"/proc/{os.getpid()}/fd/2")
        if not os.path.isfile(path):
            return ""
        return last_lines(path, lines, max_bytes=1 << 20)

    def prepare_data(self, program: str, overrides: tuple[tuple[str, str], ...]) -> None:
        """Begins loading the data of a program's batches on this host in the background
        (the first batch waits for it): a new worker reads the LM's corpus while its
        gang restores the state, not after (JaxRuntime.prepare_data)."""
        self.runtime.prepare_data(program, tuple((k, v) for k, v in overrides))

    def bench_loop(
        self, program_id: str, handles: list[str], n: int, window: int, pace_s: float = 0.0
    ) -> float:
        """The multi-controller baseline of `benchmarks/` (see JaxRuntime.run_loop), as a
        multi-controller program runs: on a thread of the default scheduling policy."""
        threading.current_thread().name = "bench-loop"  # for per-thread CPU figures
        return self.runtime.run_loop(program_id, handles, n, window, pace_s)

    def thread_names(self) -> dict[int, str]:
        """This process's Python threads by OS thread id (benchmarks: CPU by thread; the
        threads without a name here are native ones, XLA's and gloo's)."""
        return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}

    def bench_train_loop(self, *args: Any) -> float:
        """The multi-controller training baseline (see JaxRuntime.run_train_loop)."""
        return self.runtime.run_train_loop(*args)

    def trace_spans(self, since_us: int = 0, last: int = 0) -> list[Span]:
        """This host's spans since `since_us`; with `last`, only the most recent `last`."""
        return self.spans.spans(since_us, last=last)

    def compiled_text(self, program_id: str) -> str:
        return self.runtime.compiled_text(program_id)

    def stats(self) -> dict[str, Any]:
        return self.runtime.stats() | {
            "process_id": self.process_id,
            "pid": os.getpid(),
            "next_seq": self.executor.next_seq,
            "max_in_flight": self.executor.max_in_flight,
            "window": self.executor.window,
            "uptime_s": time.time() - self._started,
            "control": dict(self._channel.counts) if self._channel is not None else {},
        }


def _report_done(
    worker: HostWorker,
    op: Op,
    launched_ns: int,
    started_ns: int,
    finished_ns: int,
    error: str | None,
    values: Any,
) -> None:
    """The executor's `on_done`: the span, and the completion for the controller."""
    # The span is the interval the completion reports (what step times are made of).
    # Programs get a row of their own: their spans follow each other on the devices,
    # while the executor thread meanwhile applies the operations queued behind them.
    started_us, finished_us = started_ns // 1000, finished_ns // 1000
    if type(op) is ExecOp:
        # The operations of every call: described only if somebody reads the timeline,
        # and kept meanwhile as a tuple of their names (see SpanRecorder).
        worker.spans.record_later(
            started_us,
            finished_us,
            worker._exec_spans,
            op.seq,
            op.program_id,
            op.outputs,
            launched_ns,
            started_ns,
            error,
        )
    elif type(op) is DeleteOp:
        worker.spans.record_later(
            started_us, finished_us, worker._delete_spans, op.seq, launched_ns, started_ns, error
        )
    else:
        name, category, thread, args = worker._describe(op, launched_ns, started_ns, error)
        worker.spans.record(name, category, started_us, finished_us, thread=thread, **args)
    channel = worker._channel
    assert channel is not None  # operations only come through it
    if error is None and values is None:  # nearly all: no OpResult to make
        channel.ran(op.seq, started_ns, finished_ns)
    else:
        channel.completed(OpResult(op.seq, error, values, started_ns, finished_ns))


def _describe_exec(
    worker: HostWorker,
    seq: int,
    program_id: str,
    outputs: tuple[str, ...],
    launched_ns: int,
    started_ns: int,
    error: str | None,
) -> tuple[str, str, str, dict[str, Any]]:
    """A call's span, from what `_report_done` kept of it."""
    return worker._describe(ExecOp(seq, program_id, (), outputs), launched_ns, started_ns, error)


def _describe_delete(
    worker: HostWorker, seq: int, launched_ns: int, started_ns: int, error: str | None
) -> tuple[str, str, str, dict[str, Any]]:
    """A delete's span, from what `_report_done` kept of it."""
    return worker._describe(DeleteOp(seq, ()), launched_ns, started_ns, error)


def _flush(worker: HostWorker) -> None:
    """The executor's `on_idle`: what completed goes to the controller now."""
    if worker._channel is not None:
        worker._channel.flush()
