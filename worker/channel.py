"""The control channel between the controller and one worker: operations in, completions
out, over one TCP connection that lives as long as the gang.

Every step of a training job, and every call a client makes, is an operation to each
worker and a completion back. As Ray actor calls those cost about a millisecond of CPU
each on both sides, and on a busy host that CPU comes out of the programs' own time.
Here an operation batch is one frame, and completions are pushed without being asked
for: whatever completed goes out as soon as the worker's executor has nothing more to
launch, and while it works through a queue, in frames of up to FLUSH_AT completions at
most FLUSH_AFTER_S after the first of them (FLUSH_AFTER_DEEP_S while the queue is
deep). Operations that complete back to back travel together: a frame each way per call
would cost a wake-up of a thread on both ends and a turn of the controller's event loop
for every operation (about half a millisecond of CPU per call on the 2-core simulation,
measured with `slicewise bench dispatch`).

The connection is opened by the controller to the worker's data port (transport.py), with
a JSON hello carrying the gang's secret token and epoch; the worker decodes no frame from
a peer that has not shown the token it was created with (Ray hands it over). After that,
each message is a length-prefixed frame of msgpack (slicewise/common/codec.py):

    controller -> worker   ("submit", [op, ...]), and ("hurry", seq) when somebody waits
                           for operation seq: its completion goes out as soon as it is
                           made, not with the next frame
    worker -> controller   ("ready", None) once, then ("done", Completions) as
                           operations complete (seqs and run times in columns), or
                           ("error", message) when a batch is refused (a reused sequence number: a controller bug), and
                           ("beat", {...}) every BEAT_S seconds: the worker's progress
                           (see executor.Progress), and the program it is compiling

Frames hold plain data, decoded only into the registered types (operations, their
completions, mesh and sharding specs, numpy arrays), so that not even a peer with the
token can make the other end run code. A frame that is not a message its receiver may be
sent (codec.TO_WORKER, codec.TO_CONTROLLER) ends the connection: the worker logs it and
goes on serving; the controller's `receive` raises ChannelError.

A worker that dies closes the connection, and the controller's next `receive` says so. A
worker that hangs, or whose host stops, goes quiet: the beats are how the controller
tells (controller/health.py).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from slicewise.common.codec import TO_WORKER
from slicewise.common.framing import LENGTH, ChannelError, frame, frame_length, unframe
from slicewise.common.ops import Completions, Op, OpResult
from worker import sched

log = logging.getLogger(__name__)

# Completions queued on a worker that are sent without waiting for a flush.
FLUSH_AT = 64
# The longest a completion waits for others to go with it while the executor is busy.
# Step times are measured on the worker (OpResult.started_ns/finished_ns), so this delays
# only when the controller hears of a completion, never what it reports.
FLUSH_AFTER_S = 0.005
# ... and while the queue on this worker is deep: LONG_BACKLOG operations or more (a
# job's runner keeps ControllerOptions.steps_ahead, 4, steps queued beyond the one it
# reads: fewer than LONG_BACKLOG, so it hears of each step within FLUSH_AFTER_S however
# long its steps are). Then hearing later starves no one: the controller refills its
# window long before the queue runs dry, a worker that runs dry flushes at once, and a
# completion somebody waits for (a client's wait or fetch) goes out as soon as it is
# made, because the controller says so ("hurry"). A client's stream of calls costs a
# frame per ~100 ms instead of one per call or two (until 2026-12-04 a queue of 8-63
# short operations counted as shallow, so that a waiting client heard within 5 ms: the
# last 64 calls of every stream went out in frames of 2 or 3, 5 ms apart). Each frame
# wakes the controller's event loop, which on the 2-core simulation costs 100-300 us of
# CPU after a sleep (asyncio's own path; a blocking recv costs 20-70 us;
# benchmarks/wakeups.py): at 3-ms calls the controller's CPU per call went from 262 to
# 200 us with this bound at 0.1 s instead of 0.02 s, and at 9-ms calls from 525 to
# 300 us.
LONG_BACKLOG = 8
FLUSH_AFTER_DEEP_S = 0.1

# How often a worker says it is alive, and where it is.
BEAT_S = 0.5

# Told about every frame of completions sent: (completions, started_ns, finished_ns).
OnSent = Callable[[Completions, int, int], None]


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    data = bytearray(n)
    view = memoryview(data)
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise EOFError("the controller closed the control channel")
        view = view[got:]
    return data


class WorkerEnd:
    """The worker's end: hands each received batch to `submit`, and sends back what
    `completed` is told about (and `on_sent` about each frame that went out)."""

    def __init__(
        self,
        token: str,
        epoch: int,
        submit: Callable[[list[Op]], Any],
        on_sent: OnSent | None = None,
        progress: Callable[[], dict[str, Any]] | None = None,
        beat_s: float = BEAT_S,
        backlog: Callable[[], int] | None = None,
    ) -> None:
        if not token:
            raise ValueError("a control channel needs a token")
        self._token = token
        self._epoch = epoch
        self._submit = submit
        self._on_sent = on_sent
        self._progress = progress or dict
        self._beat_s = beat_s
        self._backlog = backlog or (lambda: 0)  # operations queued or running here
        # The completions not sent yet, as the columns they travel in (ops.Completions):
        # every one's seq and run times, and whole those that failed or report values.
        self._seqs: list[int] = []
        self._started: list[int] = []
        self._finished: list[int] = []
        self._full: list[OpResult] = []
        self._first_done = 0.0  # time.monotonic() when the oldest of them was queued
        # When the sender thread looks at the queue next (time.monotonic(); inf while it
        # waits to be told of a first completion): a first completion wakes it only if
        # that is too late for the bound, else it is timed when the sender looks. A
        # wake-up of the sender per frame cost the workers ~20 us of CPU per call at
        # 2.5-ms calls (its hand-over of the interpreter lock, on the 2-core simulation).
        self._sender_until = 0.0
        # The controller waits for the completion of this operation (0: of none): it goes
        # out as soon as it is made, on the thread that made it.
        self._hurry_to = 0
        self._last_seq = 0  # the newest operation completed here
        # `completed` takes the lock itself: `with` on a Condition is two calls in Python.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._conn: socket.socket | None = None
        self._send_lock = threading.Lock()
        # Frames and what they carried, each way: how well calls and completions batch.
        self.counts = {"frames_in": 0, "ops_in": 0, "frames_out": 0, "completions_out": 0}

    def completed(self, result: OpResult) -> None:
        """Queues a completion for the controller; it goes out on the next `flush`, at
        once when many are waiting, and at the latest FLUSH_AFTER_S from now."""
        full = result.error is not None or result.values is not None
        self.ran(result.seq, result.started_ns, result.finished_ns, result if full else None)

    def ran(
        self, seq: int, started_ns: int, finished_ns: int, full: OpResult | None = None
    ) -> None:
        """`completed`, from the columns' values: an operation that neither failed nor
        reports values (most of them) needs no OpResult; `full` is the one that does."""
        with self._lock:
            if full is not None:
                self._full.append(full)
            seqs = self._seqs
            seqs.append(seq)
            self._started.append(started_ns)
            self._finished.append(finished_ns)
            if seq > self._last_seq:
                self._last_seq = seq
            if len(seqs) == 1:
                now = self._first_done = time.monotonic()
                if self._sender_until > now + FLUSH_AFTER_S:
                    self._cond.notify()  # the sender times the bound from here
            elif len(seqs) >= FLUSH_AT:
                self._cond.notify()
            if not self._hurry_to or seq < self._hurry_to:
                return
            self._hurry_to = 0  # operations complete in order: what it waits for is done
        self.flush()

    def hurry(self, seq: int) -> None:
        """The controller waits for operation `seq`: its completion goes out as soon as
        it is made (at once, if it was made and is still queued here)."""
        with self._lock:
            if seq > self._last_seq:
                self._hurry_to = max(self._hurry_to, seq)
                return
            if not self._seqs or self._seqs[0] > seq:
                return  # sent already (completions are queued in the order they are made)
        self.flush()

    def _take(self) -> Completions:
        """The completions queued, as one frame's worth; the queue is left empty (under
        `_cond`)."""
        done = Completions(
            tuple(self._seqs), tuple(self._started), tuple(self._finished), tuple(self._full)
        )
        self._seqs, self._started, self._finished, self._full = [], [], [], []
        return done

    def flush(self) -> None:
        """Sends the queued completions now, on the calling thread (the executor calls
        this when it has nothing more to launch, so a run of operations that complete
        back to back costs one frame and the last of them is not held back). Sent here
        rather than by waking the sender thread: a wake-up and a hand-over of the
        interpreter lock per frame cost the workers 40-100 us of CPU per call in paired
        runs of 1-ms calls on the 2-core simulation; the executor was about to wait
        anyway. The sender thread still sends what waits past the bound."""
        with self._cond:
            conn = self._conn
            if not self._seqs or conn is None:
                return
            done = self._take()
        self._send_batch(conn, done)

    def serve(
        self, conn: socket.socket, hello: dict[str, Any], reply: Callable[[dict[str, Any]], None]
    ) -> None:
        """Runs one controller connection (on the data server's thread for it) until it
        closes. `reply` answers the hello with a JSON refusal."""
        if not hmac.compare_digest(str(hello.get("token", "")).encode(), self._token.encode()):
            reply(
                {
                    "error": "wrong or missing token: only this gang's controller may "
                    "send it operations"
                }
            )
            return
        threading.current_thread().name = "control-receiver"  # for per-thread CPU figures
        if hello.get("epoch") != self._epoch:
            reply({"error": f"stale epoch {hello.get('epoch')} (this worker is at {self._epoch})"})
            return
        with self._cond:
            if self._conn is not None:
                reply({"error": "this worker already has a controller connected"})
                return
            self._conn = conn
        sender = threading.Thread(
            target=self._send_completions, args=(conn,), name="control-sender", daemon=True
        )
        beating = threading.Event()
        beater = threading.Thread(
            target=self._beat, args=(conn, beating), name="control-beat", daemon=True
        )
        try:
            self._send(conn, "ready", None)
            sender.start()
            beater.start()
            # After starting the heartbeat: a thread starts under its starter's policy.
            sched.dispatch_thread()
            while True:
                length = frame_length(_recv_exact(conn, LENGTH.size))
                kind, payload = unframe(_recv_exact(conn, length), TO_WORKER)
                if kind == "hurry":
                    self.hurry(payload)
                    continue
                ops = payload
                self.counts["frames_in"] += 1
                self.counts["ops_in"] += len(ops)
                try:
                    self._submit(ops)
                except Exception as exc:  # noqa: BLE001 - the controller decides what now
                    self._send(conn, "error", f"{type(exc).__name__}: {exc}")
        except ChannelError as exc:
            log.warning("control channel: dropping the controller's connection: %s", exc)
        except (OSError, EOFError) as exc:
            log.info("control channel closed: %s", exc)
        finally:
            beating.set()
            with self._cond:
                self._conn = None
                self._cond.notify_all()
            if sender.is_alive():
                sender.join(timeout=5)

    def _send(self, conn: socket.socket, kind: str, payload: Any) -> None:
        data = frame(kind, payload)
        with self._send_lock:
            conn.sendall(data)

    def _beat(self, conn: socket.socket, stop: threading.Event) -> None:
        """Says where this worker is, every `beat_s`, until the connection ends."""
        while not stop.wait(self._beat_s):
            try:
                self._send(conn, "beat", self._progress())
            except OSError as exc:
                log.info("control channel: a heartbeat failed: %s", exc)
                return

    def _send_completions(self, conn: socket.socket) -> None:
        sched.dispatch_thread()
        while True:
            with self._cond:
                while self._conn is conn:
                    if not self._seqs:
                        self._sender_until = math.inf
                        self._cond.wait()
                        continue
                    bound = FLUSH_AFTER_DEEP_S if self._deep() else FLUSH_AFTER_S
                    now = time.monotonic()
                    left = self._first_done + bound - now
                    if len(self._seqs) >= FLUSH_AT or left <= 0:
                        break
                    self._sender_until = now + left
                    self._cond.wait(left)
                self._sender_until = 0.0
                if self._conn is not conn:
                    return
                done = self._take()
            if not self._send_batch(conn, done):
                return

    def _deep(self) -> bool:
        """Whether the queue here is deep enough to hold completions longer (see
        FLUSH_AFTER_DEEP_S); under `_cond`."""
        return self._backlog() >= LONG_BACKLOG

    def _send_batch(self, conn: socket.socket, done: Completions) -> bool:
        """Sends one frame of completions; False (and the connection shut) if it failed.
        Frames may go out from two threads: their order does not matter (each completion
        names its operation)."""
        started = time.time_ns()
        try:
            self._send(conn, "done", done)
        except OSError as exc:
            log.info("control channel: sending completions failed: %s", exc)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            return False
        with self._cond:
            self.counts["frames_out"] += 1
            self.counts["completions_out"] += len(done.seqs)
        if self._on_sent is not None:
            self._on_sent(done, started, time.time_ns())
        return True
