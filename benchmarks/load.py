"""Load on one controller: many concurrent clients on one shared gang, round after round,
and the controller's resident memory after each round.

One controller on an embedded simulation (loopback only). Each run, `--clients` clients
(threads spread over `--processes` client processes, so that the clients' own GIL is not
what is measured), each with its own connection, attach to one shared gang, upload their
own input and then, for `--seconds`, call a small program (x -> x + 1) on their latest
result and fetch it. Client c's values are c * 2**20 + k after k calls, so every answer
is checked: an error, a lost result (a call accepted whose output cannot be fetched), a
mixed one (another client's values) or a wrong one (its own, but not the next) is
counted. When every client has detached the gang is released; the controller's resident
memory (/proc/PID/status) is read once it is. A short warm-up round comes first (the
first programs, connections and caches of a fresh controller are not a leak), and the
baseline is the memory after run 1: after the last run it should be within 10% of it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import sim_controller, write_result

SIM = "2xv5litepod-4"
SLICE_TYPE = "v5litepod-4"
SHARED = "load"
VALUE_BITS = 20  # client c's values are c << VALUE_BITS plus its call count
MAX_CONSECUTIVE_ERRORS = 20  # a client that fails this often in a row stops its run
RSS_TOLERANCE = 0.10


# -- one client ----------------------------------------------------------------------


def _client(
    address: str,
    cid: int,
    serialized: bytes,
    slices: int,
    on_ready: Any,
    go: Any,
    deadline: Any,
) -> dict[str, Any]:
    """One client's run: attach, upload, say so (`on_ready`), wait for `go`, then call and
    fetch until the deadline."""
    import slicewise

    out: dict[str, Any] = {
        "cid": cid,
        "ok": 0,
        "errors": 0,
        "lost": 0,
        "mixed": 0,
        "wrong": 0,
        "latencies": [],
        "first_error": "",
        "ended": 0.0,
    }
    base = cid << VALUE_BITS
    with slicewise.connect(address, name=f"load-{cid}") as client:
        gang = client.allocate(slices, SLICE_TYPE, shared=SHARED, timeout=600)
        try:
            mesh = gang.mesh(dcn={"slice": slices}, ici={"chip": gang.chips_per_slice})
            program = gang.load(serialized, mesh, name="plus_one")
            y = gang.put(np.full(8, base, np.int32))
            np.testing.assert_array_equal(y.fetch(), base)
            on_ready()
            if not go.wait(timeout=900):
                raise TimeoutError("the run did not start within 900 s")
            end = deadline.value
            k, failing = 0, 0
            latencies: list[float] = out["latencies"]
            while time.time() < end and failing < MAX_CONSECUTIVE_ERRORS:
                started = time.perf_counter()
                try:
                    nxt = program(y)
                except Exception as exc:  # noqa: BLE001 - counted, and the run goes on
                    out["errors"] += 1
                    failing += 1
                    out["first_error"] = out["first_error"] or f"execute: {exc!r}"
                    continue
                try:
                    value = nxt.fetch()
                except Exception as exc:  # noqa: BLE001
                    out["lost"] += 1
                    failing += 1
                    out["first_error"] = out["first_error"] or f"fetch: {exc!r}"
                    continue
                latencies.append(time.perf_counter() - started)
                failing = 0
                if value.shape == (8,) and bool(np.all(value == base + k + 1)):
                    out["ok"] += 1
                    y, k = nxt, k + 1
                elif bool(np.all((value >> VALUE_BITS) == cid)):
                    out["wrong"] += 1
                else:
                    out["mixed"] += 1
            out["ended"] = time.time()
        finally:
            gang.release()
    return out


def _client_process(
    address: str,
    serialized: bytes,
    slices: int,
    commands: Any,
    results: Any,
    ready: Any,
    go: Any,
    deadline: Any,
) -> None:
    """A client process: for each command (the client ids of a run), runs those clients
    on threads and puts their results; None ends it."""
    while (cids := commands.get()) is not None:
        done: list[dict[str, Any]] = []
        threads = [
            threading.Thread(
                target=_thread, args=(done, address, cid, serialized, slices, ready, go, deadline)
            )
            for cid in cids
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.put(done)


def _thread(
    done: list[dict[str, Any]],
    address: str,
    cid: int,
    serialized: bytes,
    slices: int,
    ready: Any,
    go: Any,
    deadline: Any,
) -> None:
    said: list[int] = []

    def on_ready() -> None:
        said.append(cid)
        ready.put(cid)

    try:
        done.append(_client(address, cid, serialized, slices, on_ready, go, deadline))
    except Exception as exc:  # noqa: BLE001 - the run reports it
        if not said:
            ready.put(cid)  # never leave the others waiting for this one
        done.append({"cid": cid, "failed": f"{type(exc).__name__}: {exc}"})


# -- the controller's memory -----------------------------------------------------------


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and its parts (anonymous, file-backed, shared memory) of a process, in MB."""
    out = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) / 1024
    return out


# -- runs ------------------------------------------------------------------------------


class _Clients:
    """The client processes, reused from run to run."""

    def __init__(self, address: str, serialized: bytes, slices: int, processes: int) -> None:
        ctx = mp.get_context("spawn")
        self._ctx = ctx
        self.results: Any = ctx.Queue()
        self.ready: Any = ctx.Queue()
        self.go: Any = ctx.Event()
        self.deadline: Any = ctx.Value("d", 0.0)
        self._commands = [ctx.Queue() for _ in range(processes)]
        self._procs = [
            ctx.Process(
                target=_client_process,
                args=(
                    address,
                    serialized,
                    slices,
                    commands,
                    self.results,
                    self.ready,
                    self.go,
                    self.deadline,
                ),
                daemon=True,
            )
            for commands in self._commands
        ]
        for p in self._procs:
            p.start()

    def run(self, clients: int, seconds: float) -> tuple[list[dict[str, Any]], float]:
        """Runs `clients` clients for `seconds` once all are attached; returns their
        results and when they started (time.time())."""
        self.go.clear()
        for i, commands in enumerate(self._commands):
            commands.put(list(range(i, clients, len(self._commands))))
        for _ in range(clients):
            self.ready.get(timeout=900)
        start = time.time()
        self.deadline.value = start + seconds
        self.go.set()
        results: list[dict[str, Any]] = []
        for _ in self._commands:
            results += self.results.get(timeout=seconds + 900)
        return results, start

    def close(self) -> None:
        for commands in self._commands:
            commands.put(None)
        for p in self._procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def _wait_released(client: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.health().num_gangs:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shared gang was not released within {timeout_s:g} s")
        time.sleep(0.2)


def _summary(results: list[dict[str, Any]], start: float, seconds: float) -> dict[str, Any]:
    failed = [r["failed"] for r in results if "failed" in r]
    ran = [r for r in results if "failed" not in r]
    # From the start to the end of the last client's last round trip.
    wall_s = max((r["ended"] for r in ran), default=start) - start
    latencies = np.array([x for r in ran for x in r["latencies"]], dtype=np.float64)
    total = {k: sum(r[k] for r in ran) for k in ("ok", "errors", "lost", "mixed", "wrong")}
    return {
        "seconds": seconds,
        "wall_s": wall_s,
        "clients": len(results),
        "clients_failed": failed,
        "round_trips": int(latencies.size),
        "requests_per_s": latencies.size / wall_s if wall_s else 0.0,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3) if latencies.size else None,
        "p99_ms": float(np.percentile(latencies, 99) * 1e3) if latencies.size else None,
        **total,
        "first_errors": sorted({r["first_error"] for r in ran if r["first_error"]})[:5],
    }


def _program(slices: int, chips: int) -> bytes:
    """x -> x + 1 on int32[8], replicated over the gang, exported for the simulation."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from slicewise.common.mesh import MeshSpec

    mesh = MeshSpec.build({"slice": slices}, {"chip": chips}).abstract()
    spec = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
    return bytes(jax.export.export(jax.jit(lambda a: a + 1), platforms=["cpu"])(spec).serialize())


def measure(
    *,
    seconds: float = 60.0,
    clients: int = 64,
    runs: int = 5,
    warmup_s: float = 10.0,
    processes: int = 0,
    sim: str = SIM,
    slices: int = 2,
) -> dict[str, Any]:
    import slicewise
    from slicewise.common.topology import slice_type

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the client processes inherit it
    processes = processes or max(1, min(clients, 2 * (os.cpu_count() or 1)))
    serialized = _program(slices, slice_type(SLICE_TYPE).chips)
    config = {
        "sim": sim,
        "gang": f"{slices} x {SLICE_TYPE}, shared by every client",
        "clients": clients,
        "client_processes": processes,
        "seconds": seconds,
        "runs": runs,
        "warmup_s": warmup_s,
        "program": "x -> x + 1 on int32[8], replicated; one Execute + one FetchArray per round trip",
    }
    out: dict[str, Any] = {"config": config, "runs": []}
    with sim_controller(sim) as controller, slicewise.connect(controller.address) as client:
        pool = _Clients(controller.address, serialized, slices, processes)
        try:
            out["rss_start"] = memory_mb(controller.pid)
            if warmup_s > 0:
                results, start = pool.run(clients, warmup_s)
                _wait_released(client)
                out["warmup"] = _summary(results, start, warmup_s) | {
                    "rss": memory_mb(controller.pid)
                }
                print(_row("warm-up", out["warmup"]), flush=True)
            for n in range(1, runs + 1):
                results, start = pool.run(clients, seconds)
                _wait_released(client)
                result = _summary(results, start, seconds) | {
                    "run": n,
                    "rss": memory_mb(controller.pid),
                }
                out["runs"].append(result)
                print(_row(f"run {n}", result), flush=True)
        finally:
            pool.close()
    first, last = out["runs"][0]["rss"]["VmRSS"], out["runs"][-1]["rss"]["VmRSS"]
    out["rss_ratio_last_to_first"] = last / first
    out["rss_within_10pct"] = abs(last / first - 1) <= RSS_TOLERANCE
    out["all_answers_right"] = all(
        r[k] == 0 and not r["clients_failed"]
        for r in out["runs"]
        for k in ("errors", "lost", "mixed", "wrong")
    )
    return out


def run(quick: bool = False) -> dict[str, Any]:
    """For `slicewise bench load`: the full measurement, or a short one with `quick`."""
    if quick:
        return measure(seconds=10, clients=16, runs=3, warmup_s=5)
    return measure()


# -- output ----------------------------------------------------------------------------

_HEADER = (
    f"{'':>8} {'round trips':>11} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} "
    f"{'lost':>5} {'mixed':>5} {'wrong':>5} {'RSS MB':>7} {'(anon)':>7}"
)


def _row(label: str, r: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return f"{v:7.1f}" if v is not None else f"{'-':>7}"

    failed = f"  {len(r['clients_failed'])} client(s) failed" if r["clients_failed"] else ""
    return (
        f"{label:>8} {r['round_trips']:>11} {r['requests_per_s']:>7.1f} {ms(r['p50_ms'])} "
        f"{ms(r['p99_ms'])} {r['errors']:>6} {r['lost']:>5} {r['mixed']:>5} {r['wrong']:>5} "
        f"{r['rss']['VmRSS']:>7.1f} {r['rss']['RssAnon']:>7.1f}{failed}"
    )


def report(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"{c['clients']} clients ({c['client_processes']} processes) on one shared gang "
        f"({c['gang']}), {c['runs']} runs of {c['seconds']:g} s on one controller; "
        f"controller RSS at start {result['rss_start']['VmRSS']:.1f} MB",
        _HEADER,
    ]
    if "warmup" in result:
        lines.append(_row("warm-up", result["warmup"]) + "  (not measured: first use)")
    lines += [_row(f"run {r['run']}", r) for r in result["runs"]]
    for r in result["runs"]:
        for e in r["first_errors"] + r["clients_failed"]:
            lines.append(f"   run {r['run']}: {e}")
    ratio = result["rss_ratio_last_to_first"]
    lines.append(
        f"RSS after run {len(result['runs'])} / after run 1: {ratio:.3f} "
        f"({'within' if result['rss_within_10pct'] else 'NOT within'} 10%); "
        f"every answer right: {'yes' if result['all_answers_right'] else 'NO'}"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [f"run {r['run']}" for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.bar(labels, [r["requests_per_s"] for r in runs], color="tab:blue")
    left.set_ylabel("execute + fetch round trips / s")
    left.set_title(f"{result['config']['clients']} clients on one shared gang")
    right.plot(labels, [r["rss"]["VmRSS"] for r in runs], "o-", label="VmRSS")
    right.plot(labels, [r["rss"]["RssAnon"] for r in runs], "s--", label="RssAnon")
    first = runs[0]["rss"]["VmRSS"]
    right.axhspan(first * (1 - RSS_TOLERANCE), first * (1 + RSS_TOLERANCE), alpha=0.15)
    right.set_ylabel("controller resident memory after the run (MB)")
    right.set_ylim(bottom=0)
    right.legend()
    right.set_title("controller memory, run after run (band: run 1 +-10%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of a run")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--runs", type=int, default=5, help="runs on the same controller")
    parser.add_argument(
        "--warmup", type=float, default=10.0, help="seconds of a first, unmeasured round (0: none)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        help="client processes the clients are spread over (default: 2 per core)",
    )
    parser.add_argument("--sim", default=SIM, help="the simulated cluster (default %(default)s)")
    parser.add_argument("--slices", type=int, default=2, help="slices of the shared gang")
    args = parser.parse_args()
    result = measure(
        seconds=args.seconds,
        clients=args.clients,
        runs=args.runs,
        warmup_s=args.warmup,
        processes=args.processes,
        sim=args.sim,
        slices=args.slices,
    )
    print(report(result))
    json_path, png_path = write_result("load", result, plot)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
