"""What every benchmark shares: the machine description, summary statistics, a
controller to measure, a raw-socket baseline, and writing results as JSON + PNG."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"


def machine() -> dict[str, Any]:
    """Where and with what a result was measured."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    versions = {}
    for package in ("jax", "jaxlib", "ray", "grpcio", "protobuf", "numpy", "slicewise"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "os": platform.platform(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def interleaved(rounds: int, measures: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Each measure's value (a rate, or seconds) in every round. A round runs every measure
    once, back to back, in the order given, and the next round in the reverse order: on
    this shared VM the speed drifts by tens of percent within a minute, so two values are
    compared within a round (where they were measured moments apart) and a steady drift
    cancels over a pair of rounds."""
    values: dict[str, list[float]] = {name: [] for name in measures}
    for r in range(rounds):
        for name in list(measures) if r % 2 == 0 else list(reversed(measures)):
            values[name].append(measures[name]())
    return values


def round_ratios(values: dict[str, list[float]], top: str, bottom: str) -> list[float]:
    """`top` over `bottom` in each round of `interleaved`'s values: for rates, ours over
    the baseline's; for seconds, the baseline's over ours."""
    return [a / b for a, b in zip(values[top], values[bottom], strict=True)]


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max, p99 and count of a list of measurements."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p99": p99,
        "n": len(ordered),
    }


def write_result(
    name: str,
    result: dict[str, Any],
    plot: Callable[[dict, Path], None] | None,
    out_dir: Path = RESULTS,
) -> tuple[Path, Path | None]:
    """Writes results/<name>.json (and <name>.png when a plot function is given)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "machine": machine(), **result}
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2, default=float) + "\n")
    png_path = None
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        png_path = out_dir / f"{name}.png"
        plot(result, png_path)
    return json_path, png_path


@contextlib.contextmanager
def sim_controller(spec: str, *extra: str) -> Iterator[Any]:
    """A controller on a simulated cluster, its log in a temp file (path printed)."""
    from slicewise.launch import ControllerProcess

    log_path = Path(tempfile.gettempdir()) / f"slicewise-bench-{os.getpid()}-{spec}.log"
    with open(log_path, "w") as log:
        controller = ControllerProcess(sim=spec, stderr=log, extra_args=extra)
        try:
            yield controller
        finally:
            controller.stop()


@contextlib.contextmanager
def attached_to_ray(client: Any) -> Iterator[None]:
    """Joins the controller's Ray cluster as a second driver (for baselines that talk to
    workers directly)."""
    from controller.server import prepare_environment
    from controller.simcluster import ray_auth_env

    health = client.health()
    address = health.ray_address
    prepare_environment(address)
    auth = ray_auth_env(health.ray_auth_token_path) if health.ray_auth_token_path else {}
    saved = {k: os.environ.get(k) for k in auth}
    os.environ.update(auth)
    _reload_ray_auth()
    import ray

    try:
        ray.init(
            address=address,
            namespace="slicewise",
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        try:
            yield
        finally:
            ray.shutdown()
    finally:  # later drivers of this process start from its own settings again
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _reload_ray_auth()


def _reload_ray_auth() -> None:
    """Makes Ray read its authentication settings from the environment again: it reads
    them once per process, and this process may have been a driver before (as Ray's own
    tests do it, ray/_private/authentication_test_utils.py)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def run_job(client: Any, steps: int, **submit: Any) -> list[Any]:
    """Runs an LM training job of `steps` steps to its end (`submit` as for
    `Client.submit_job`) and returns its step records, in step order.

    Raises:
        TimeoutError: it did not end within 30 minutes.
        RuntimeError: it ended without recording every step.
    """
    job = client.submit_job("lm", steps=steps, **submit)
    deadline = time.monotonic() + 1800
    while client.job(job.job_id).state not in (6, 7, 8):  # succeeded, failed, cancelled
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job.job_id} did not finish")
        time.sleep(0.2)
    records = sorted(client.job_metrics(job.job_id).steps, key=lambda r: r.step)
    if len(records) != steps:
        raise RuntimeError(
            f"job {job.job_id} ended after {len(records)} steps: {client.job(job.job_id).error}"
        )
    return records


# -- the raw loopback socket: the limit of moving bytes between two processes here -----

_SOCKET_SERVER = r"""
import socket, sys
sock = socket.create_server(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
buf = bytearray(16 * 2**20)
view = memoryview(buf)
while True:
    conn, _ = sock.accept()
    with conn:
        header = conn.recv(8, socket.MSG_WAITALL)
        if len(header) < 8:
            break
        left = int.from_bytes(header, "big")
        while left:
            n = conn.recv_into(view[:min(left, len(buf))])
            if n == 0:
                break
            left -= n
        conn.sendall(b"k")
"""


class RawSocketSink:
    """A separate process that receives N bytes over loopback TCP and acknowledges."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SOCKET_SERVER], stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())

    def send(self, payload: memoryview) -> float:
        """Seconds to move `payload` to the other process (connection included)."""
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", self.port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(len(payload).to_bytes(8, "big"))
            conn.sendall(payload)
            if conn.recv(1) != b"k":
                raise RuntimeError("the raw socket sink did not acknowledge")
        return time.perf_counter() - started

    def close(self) -> None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
            pass
        self._proc.kill()
        self._proc.wait(timeout=10)

    def __enter__(self) -> RawSocketSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# One side of RawExchange: a process that opens `streams` connections to its peer and
# accepts as many from it; on "go N" it sends N bytes over its connections (N / streams
# each, one thread per connection, from a buffer written once) while it receives as many
# on the accepted ones, and says "done". Received bytes land in one reused 16-MiB buffer
# per connection.
_EXCHANGE_PEER = r"""
import socket, sys, threading
streams = int(sys.argv[1])
server = socket.create_server(("127.0.0.1", 0), backlog=streams)
print(server.getsockname()[1], flush=True)
peer = int(sys.stdin.readline())
outgoing = [socket.create_connection(("127.0.0.1", peer)) for _ in range(streams)]
incoming = [server.accept()[0] for _ in range(streams)]
for c in outgoing + incoming:
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
outbox = inbox = memoryview(bytearray(0))
warm_inboxes = [memoryview(bytearray(16 * 2**20)) for _ in incoming]
print("ready", flush=True)

def send(conn, view):
    conn.sendall(view)

def receive(conn, view, n):  # into view, from its start again when it is full
    at = 0
    while n:
        if at == len(view):
            at = 0
        got = conn.recv_into(view[at : at + n])
        if got == 0:
            raise EOFError("the peer closed its connection")
        at += got
        n -= got

for line in sys.stdin:
    _, nbytes, mode = line.split()
    each = int(nbytes) // streams
    if len(outbox) < each * streams:  # written once: real pages, not the zero page
        outbox = memoryview(bytearray(b"Z") * (each * streams))
        inbox = memoryview(bytearray(b"Z") * (each * streams))
    if mode == "own":  # every stream its own part of the outbox and of the inbox
        sent = [outbox[i * each : (i + 1) * each] for i in range(streams)]
        into = [inbox[i * each : (i + 1) * each] for i in range(streams)]
    else:  # "warm": every stream the outbox's first part, received into its own 16 MiB
        sent = [outbox[:each]] * streams
        into = warm_inboxes
    threads = [threading.Thread(target=send, args=(c, v)) for c, v in zip(outgoing, sent)]
    threads += [
        threading.Thread(target=receive, args=(c, v, each)) for c, v in zip(incoming, into)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("done", flush=True)
"""


class RawExchange:
    """Two processes that swap bytes over raw loopback TCP, each sending to the other
    over `streams` connections at once: the same streams a slice-to-slice `ppermute`
    uses between two simulated hosts (4 gloo connections each way, measured with
    `ss -tnpi` around one swap), with nothing but the kernel in between."""

    def __init__(self, streams: int) -> None:
        self._procs = [
            subprocess.Popen(
                [sys.executable, "-c", _EXCHANGE_PEER, str(streams)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        ports = [self._read(p) for p in self._procs]
        for proc, port in zip(self._procs, reversed(ports), strict=True):
            self._write(proc, port)
        for proc in self._procs:
            if self._read(proc) != "ready":
                raise RuntimeError("a raw exchange peer did not get ready")

    @staticmethod
    def _read(proc: subprocess.Popen, timeout_s: float = 120.0) -> str:
        assert proc.stdout is not None
        # One line at a time each way, so nothing waits in the reader's buffer unseen.
        if not select.select([proc.stdout], [], [], timeout_s)[0]:
            proc.kill()
            raise TimeoutError(f"a raw exchange peer said nothing for {timeout_s:.0f} s")
        line = proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"a raw exchange peer exited ({proc.poll()})")
        return line

    @staticmethod
    def _write(proc: subprocess.Popen, value: Any) -> None:
        assert proc.stdin is not None
        proc.stdin.write(f"{value}\n")
        proc.stdin.flush()

    def swap(self, nbytes_each_way: int, warm: bool = False) -> float:
        """Seconds for both processes to send `nbytes_each_way` to the other at once.

        Each stream sends its own part of `nbytes_each_way` of memory and receives into
        its own part of as much again, as a program moving an array does. `warm`: every
        stream sends the same part and receives into the same 16 MiB instead, a quarter
        of the memory and less: the baseline until 2026-12-06, which a large L3 (300 MiB
        on the VM here) serves from cache."""
        started = time.perf_counter()
        for proc in self._procs:
            self._write(proc, f"go {nbytes_each_way} {'warm' if warm else 'own'}")
        for proc in self._procs:
            if self._read(proc) != "done":
                raise RuntimeError("a raw exchange peer did not finish")
        return time.perf_counter() - started

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> RawExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def size_label(nbytes: int) -> str:
    return f"{nbytes // 2**30} GiB" if nbytes >= 2**30 else f"{nbytes // 2**20} MiB"


def _stat(path: str) -> tuple[str, list[str]]:
    """A /proc stat line (a process's, /proc/<pid>/stat, or one thread's,
    /proc/<pid>/task/<tid>/stat): the name, and the fields after it, field 3 of the line
    first. The name may hold spaces and parentheses: the fields count from its last ")"."""
    with open(path) as f:
        line = f.read()
    head, _, rest = line.rpartition(")")
    return head.partition("(")[2], rest.split()


def _cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds (fields 14 and 15 of a stat line, in clock ticks)."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process (all its threads) has used so far."""
    return _cpu_seconds(_stat(f"/proc/{pid}/stat")[1])


def thread_stats(pid: int) -> dict[int, tuple[str, list[str]]]:
    """Each thread of a process, by thread id: its name and the fields of its stat line
    after the name (see `_stat`); a thread that ends while it is read is left out."""
    found: dict[int, tuple[str, list[str]]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found[int(tid)] = _stat(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
    return found


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds each thread of a process has used so far, by thread id."""
    return {tid: _cpu_seconds(fields) for tid, (_, fields) in thread_stats(pid).items()}


class ThreadCpuMeter:
    """CPU seconds used by each thread of some processes while a block runs, by (pid,
    tid) (summed over the blocks, when used for several); `grouped` sums them by what a
    thread's name says it does."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.used: dict[tuple[int, int], float] = {}
        self._before: dict[tuple[int, int], float] = {}

    def _read(self) -> dict[tuple[int, int], float]:
        return {
            (pid, tid): seconds
            for pid in self.pids
            for tid, seconds in thread_cpu_seconds(pid).items()
        }

    def __enter__(self) -> ThreadCpuMeter:
        self._before = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        after = self._read()
        for key in after:
            self.used[key] = self.used.get(key, 0.0) + after[key] - self._before.get(key, 0.0)

    def grouped(
        self, names: dict[int, dict[int, str]], group: Callable[[str | None], str]
    ) -> dict[str, float]:
        """Seconds by group; `names[pid][tid]` is a thread's name (None when absent)."""
        out: dict[str, float] = {}
        for (pid, tid), seconds in self.used.items():
            key = group(names.get(pid, {}).get(tid))
            out[key] = out.get(key, 0.0) + seconds
        return out


class CpuMeter:
    """CPU seconds used by named groups of processes while a block runs:

    meter = CpuMeter({"client": [os.getpid()], "controller": [pid], "workers": pids})
    with meter:
        run()
    meter.used  # {"client": 0.8, ...}; workers summed over their processes

    A meter used for several blocks sums them (`wall_s` too): runs measured in turns
    with others, so that each sees the machine's drifting speed alike.
    """

    def __init__(self, groups: dict[str, Sequence[int]]) -> None:
        self.groups = {name: list(pids) for name, pids in groups.items()}
        self.used: dict[str, float] = {}
        self.wall_s = 0.0  # how long the block ran
        self._before: dict[str, float] = {}
        self._started = 0.0

    def _read(self) -> dict[str, float]:
        return {name: sum(map(cpu_seconds, pids)) for name, pids in self.groups.items()}

    def __enter__(self) -> CpuMeter:
        self._before = self._read()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s += time.perf_counter() - self._started
        after = self._read()
        for name in after:
            self.used[name] = self.used.get(name, 0.0) + after[name] - self._before[name]
